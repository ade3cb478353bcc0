//! PayPal's order: a capture's, a sale's, an authorization's and a
//! checkout order's life.

use super::place::{Order, Placement};
use crate::key::Field;

/// The rank of an `event_type` in its resource's life; `None` outside it.
///
/// From PayPal's [webhook event names]: a capture (or a v1 sale) is
/// pending, then completed or denied (declined), then refunded or
/// reversed; an authorization is created, then captured or voided; a
/// checkout order is approved, then completed. The refund events'
/// `resource` is the refund itself: an object of its own.
///
/// [webhook event names]: https://developer.paypal.com/api/rest/webhooks/event-names/
fn rank(event_type: &str) -> Option<u32> {
    Some(match event_type {
        "PAYMENT.CAPTURE.PENDING" | "PAYMENT.SALE.PENDING" => 0,
        "PAYMENT.CAPTURE.COMPLETED"
        | "PAYMENT.CAPTURE.DENIED"
        | "PAYMENT.CAPTURE.DECLINED"
        | "PAYMENT.SALE.COMPLETED"
        | "PAYMENT.SALE.DENIED" => 1,
        "PAYMENT.CAPTURE.REFUNDED"
        | "PAYMENT.CAPTURE.REVERSED"
        | "PAYMENT.SALE.REFUNDED"
        | "PAYMENT.SALE.REVERSED" => 2,
        "PAYMENT.AUTHORIZATION.CREATED" => 0,
        "PAYMENT.AUTHORIZATION.VOIDED" => 1,
        "CHECKOUT.ORDER.APPROVED" => 0,
        "CHECKOUT.ORDER.COMPLETED" => 1,
        _ => return None,
    })
}

fn place(values: &[Option<String>]) -> Placement {
    super::place::object_version_state(values, rank)
}

impl Order {
    /// PayPal: the object is the event's `resource.id`, the version its
    /// `create_time` (RFC 3339), the state its `event_type`:
    /// `PENDING` < `COMPLETED` = `DENIED` < `REFUNDED` = `REVERSED` for
    /// captures and v1 sales, `CREATED` < `VOIDED` for authorizations,
    /// `APPROVED` < `COMPLETED` for checkout orders. PayPal does not
    /// promise to deliver events in order; other event types are unplaced.
    pub fn paypal() -> Self {
        Self::built_in(
            "paypal",
            [
                Field::json("/resource/id"),
                Field::json("/create_time"),
                Field::json("/event_type"),
            ],
            place,
        )
    }
}

#[cfg(test)]
mod tests {
    use crate::order::{Order, Placement};
    use crate::store::Position;
    use bytes::Bytes;

    #[test]
    fn the_shipped_sale_is_placed() {
        let body = Bytes::from_static(include_bytes!(
            "../../tests/fixtures/paypal_webhook_PayPal-Python-SDK_sample_PAYMENT.SALE.COMPLETED.json"
        ));
        let (parts, _) = http::Request::post("/").body(()).unwrap().into_parts();
        let Placement::Placed { object, position } = Order::paypal().place(&parts, &body) else {
            panic!("unplaced");
        };
        assert_eq!(object, "4EU7004268015634R");
        // 2015-05-18T15:45:13Z
        assert_eq!(position, Position::new(1_431_963_913_000_000, 1));
        let pending = body
            .as_ref()
            .windows(22)
            .position(|w| w == b"PAYMENT.SALE.COMPLETED")
            .map(|at| {
                let mut b = body.to_vec();
                b.splice(at..at + 22, b"PAYMENT.SALE.PENDING".iter().copied());
                Bytes::from(b)
            })
            .unwrap();
        let Placement::Placed { position: p, .. } = Order::paypal().place(&parts, &pending) else {
            panic!("unplaced");
        };
        assert!(p < position);
    }
}
