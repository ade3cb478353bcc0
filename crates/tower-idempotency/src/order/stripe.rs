//! Stripe's order: a payment intent's and a charge's life.

use super::place::{Order, Placement};
use crate::key::Field;

/// The rank of an event type in its object's life; `None` outside it.
///
/// From Stripe's [payment intent life cycle] and [event types]: an intent
/// is created, may require an action (3-D Secure) or be partially funded,
/// is processing (asynchronous methods), fails (`payment_failed`, after
/// which the customer may try again: the retry's events have a later
/// `created`, so they are ahead of the failure) or has funds on hold
/// (`amount_capturable_updated`), and ends succeeded or canceled. A charge
/// is pending, then failed or succeeded, then captured or expired (an
/// authorisation not captured), then refunded; `charge.refunded` carries
/// the charge with its total refunded, so a later one includes an earlier
/// one. Other types (`charge.updated`, disputes, refunds' own events, every
/// other object) are unplaced.
///
/// [payment intent life cycle]: https://docs.stripe.com/payments/paymentintents/lifecycle
/// [event types]: https://docs.stripe.com/api/events/types
fn rank(event_type: &str) -> Option<u32> {
    Some(match event_type {
        "payment_intent.created" => 0,
        "payment_intent.requires_action" => 1,
        "payment_intent.partially_funded" => 2,
        "payment_intent.processing" => 3,
        "payment_intent.payment_failed" => 4,
        "payment_intent.amount_capturable_updated" => 5,
        "payment_intent.succeeded" | "payment_intent.canceled" => 6,
        "charge.pending" => 0,
        "charge.failed" | "charge.succeeded" => 1,
        "charge.captured" | "charge.expired" => 2,
        "charge.refunded" => 3,
        _ => return None,
    })
}

fn place(values: &[Option<String>]) -> Placement {
    super::place::object_version_state(values, rank)
}

impl Order {
    /// Stripe: the object is the event's `data.object.id` (a payment
    /// intent or a charge), the version its `created` (seconds), the state
    /// its `type`, ranked by the object's life:
    ///
    /// | object | ranks |
    /// |---|---|
    /// | payment intent | `created` < `requires_action` < `partially_funded` < `processing` < `payment_failed` < `amount_capturable_updated` < `succeeded` = `canceled` |
    /// | charge | `pending` < `failed` = `succeeded` < `captured` = `expired` < `refunded` |
    ///
    /// Stripe does not deliver events in the order they were created
    /// ([webhooks: event ordering](https://docs.stripe.com/webhooks#event-ordering));
    /// the rank breaks ties within one second. A failed payment followed
    /// by a successful retry is ahead (a later `created`, or in the same
    /// second a higher rank); a `processing` or a `payment_failed` that
    /// arrives after `succeeded` is stale. Other event types are unplaced.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use tower_idempotency::order::{Order, Placement};
    /// use tower_idempotency::store::Position;
    ///
    /// let (parts, _) = http::Request::post("/").body(()).unwrap().into_parts();
    /// let body = Bytes::from_static(br#"{"id":"evt_1","type":"payment_intent.succeeded",
    ///     "created":1700000000,"data":{"object":{"id":"pi_1","object":"payment_intent"}}}"#);
    /// assert_eq!(
    ///     Order::stripe().place(&parts, &body),
    ///     Placement::Placed { object: "pi_1".into(), position: Position::new(1_700_000_000, 6) }
    /// );
    /// ```
    pub fn stripe() -> Self {
        Self::built_in(
            "stripe",
            [
                Field::json("/data/object/id"),
                Field::json("/created"),
                Field::json("/type"),
            ],
            place,
        )
    }
}

#[cfg(test)]
mod tests {
    use crate::order::{Order, Placement, Unplaced};
    use crate::store::Position;
    use bytes::Bytes;

    fn event(kind: &str, created: i64, object: &str) -> Bytes {
        Bytes::from(format!(
            r#"{{"id":"evt_{kind}_{created}","object":"event","api_version":"2025-09-30.clover",
            "created":{created},"type":"{kind}","livemode":false,"pending_webhooks":1,
            "data":{{"object":{{"id":"{object}","object":"payment_intent","amount":2000,
            "currency":"usd","status":"succeeded"}}}}}}"#
        ))
    }

    fn place(body: &Bytes) -> Placement {
        let (parts, _) = http::Request::post("/").body(()).unwrap().into_parts();
        Order::stripe().place(&parts, body)
    }

    fn position(body: &Bytes) -> Position {
        match place(body) {
            Placement::Placed { position, .. } => position,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_payment_intents_life_moves_forward() {
        let t = 1_700_000_000;
        let life = [
            event("payment_intent.created", t, "pi_1"),
            event("payment_intent.processing", t, "pi_1"),
            event("payment_intent.payment_failed", t + 1, "pi_1"),
            event("payment_intent.requires_action", t + 5, "pi_1"),
            event("payment_intent.processing", t + 6, "pi_1"),
            event("payment_intent.succeeded", t + 6, "pi_1"),
            event("charge.refunded", t + 9, "pi_1"),
        ];
        let positions: Vec<Position> = life.iter().map(position).collect();
        assert!(positions.windows(2).all(|w| w[0] < w[1]), "{positions:?}");
        // A failure followed by a later success, in the same second too.
        assert!(
            position(&event("payment_intent.payment_failed", t, "pi_1"))
                < position(&event("payment_intent.succeeded", t, "pi_1"))
        );
        // The object is the payment intent's id, not the event's.
        assert!(matches!(
            place(&life[0]),
            Placement::Placed { object, .. } if object == "pi_1"
        ));
    }

    #[test]
    fn what_it_cannot_place_is_unplaced() {
        assert_eq!(
            place(&event("customer.created", 1, "cus_1")),
            Placement::Unplaced(Unplaced::UnknownState)
        );
        assert_eq!(
            place(&event("charge.updated", 1, "ch_1")),
            Placement::Unplaced(Unplaced::UnknownState)
        );
        // The shipped fixture: an event without data.
        let fixture = Bytes::from_static(include_bytes!(
            "../../tests/fixtures/stripe_webhook_SYNTHESIZED_stripe-go_testPayload.json"
        ));
        assert!(matches!(place(&fixture), Placement::Unplaced(_)));
        assert_eq!(
            place(&Bytes::from_static(b"not json")),
            Placement::Unplaced(Unplaced::Unreadable)
        );
        let no_created = Bytes::from_static(
            br#"{"type":"payment_intent.succeeded","data":{"object":{"id":"pi_1"}}}"#,
        );
        assert_eq!(place(&no_created), Placement::Unplaced(Unplaced::NoVersion));
    }
}
