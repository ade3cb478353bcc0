//! Alipay's order: a trade's `trade_status`.

use super::place::{Order, Placement, Unplaced};
use crate::key::Field;
use crate::store::Position;

/// The rank of a `trade_status`; `None` for anything else.
fn rank(status: &str) -> Option<u32> {
    Some(match status {
        "WAIT_BUYER_PAY" => 0,
        "TRADE_SUCCESS" => 1,
        "TRADE_FINISHED" | "TRADE_CLOSED" => 2,
        _ => return None,
    })
}

fn place(values: &[Option<String>]) -> Placement {
    let [trade, status, out_biz_no, gmt_refund, refund_fee] = values else {
        return Placement::Unplaced(Unplaced::Unreadable);
    };
    let Some(trade) = trade else {
        return Placement::Unplaced(Unplaced::NoObject);
    };
    let Some(rank) = status.as_deref().and_then(rank) else {
        return Placement::Unplaced(Unplaced::UnknownState);
    };
    // A refund's notification is an object of its own: the refund request's
    // number, else its time, else the total refunded so far (each refund
    // of a trade has its own).
    let object = match (out_biz_no, gmt_refund, refund_fee) {
        (None, None, None) => trade.clone(),
        (Some(refund), _, _) | (None, Some(refund), _) | (None, None, Some(refund)) => {
            let mut object = String::with_capacity(trade.len() + refund.len() + 8);
            object.push_str(trade);
            object.push_str("#refund:");
            object.push_str(refund);
            object
        }
    };
    Placement::Placed {
        object,
        position: Position::new(0, rank),
    }
}

impl Order {
    /// Alipay: the object is the merchant's `out_trade_no`, the state its
    /// `trade_status`: `WAIT_BUYER_PAY` < `TRADE_SUCCESS` <
    /// `TRADE_FINISHED` = `TRADE_CLOSED` (no version: the rank alone). A
    /// `TRADE_SUCCESS` that arrives after the trade's `TRADE_FINISHED` is
    /// stale.
    ///
    /// A refund's notification carries the trade's fields with the refund's
    /// (`out_biz_no`, the refund request's number; `gmt_refund`, its time;
    /// `refund_fee`, the total refunded), and its `trade_status` is the
    /// trade's after the refund (`TRADE_SUCCESS` after a partial refund,
    /// `TRADE_CLOSED` after a full one), as Alipay's
    /// [asynchronous notification parameters](https://opendocs.alipay.com/open/203/105286)
    /// describe them. Such a notification (any of the three present) is an
    /// object of its own, `out_trade_no#refund:out_biz_no` (or the refund's
    /// time, or its total, when the number is missing): a refund is never
    /// stale because of the trade's status, and never makes the trade's own
    /// notifications stale.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use tower_idempotency::order::{Order, Placement};
    /// use tower_idempotency::store::Position;
    ///
    /// let (parts, _) = http::Request::post("/").body(()).unwrap().into_parts();
    /// let paid = Bytes::from_static(b"out_trade_no=T1&trade_status=TRADE_SUCCESS&notify_id=n1");
    /// assert_eq!(
    ///     Order::alipay().place(&parts, &paid),
    ///     Placement::Placed { object: "T1".into(), position: Position::new(0, 1) }
    /// );
    /// let refund = Bytes::from_static(
    ///     b"out_trade_no=T1&trade_status=TRADE_CLOSED&out_biz_no=R1&refund_fee=0.10&notify_id=n2",
    /// );
    /// assert_eq!(
    ///     Order::alipay().place(&parts, &refund),
    ///     Placement::Placed { object: "T1#refund:R1".into(), position: Position::new(0, 2) }
    /// );
    /// ```
    pub fn alipay() -> Self {
        Self::built_in(
            "alipay",
            [
                Field::form("out_trade_no"),
                Field::form("trade_status"),
                Field::form("out_biz_no"),
                Field::form("gmt_refund"),
                Field::form("refund_fee"),
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

    const FIXTURE: &[u8] = include_bytes!(
        "../../tests/fixtures/alipay_notify_trade_status_sync_alipay-sdk-nodejs-all.form"
    );

    fn place(body: &[u8]) -> Placement {
        let (parts, _) = http::Request::post("/").body(()).unwrap().into_parts();
        Order::alipay().place(&parts, &Bytes::copy_from_slice(body))
    }

    /// The shipped notification with its `trade_status` replaced, and
    /// `extra` fields added.
    fn with_status(status: &str, extra: &str) -> Vec<u8> {
        let body = std::str::from_utf8(FIXTURE).unwrap();
        let mut out = body.replace(
            "trade_status=TRADE_SUCCESS",
            &format!("trade_status={status}"),
        );
        out.push_str(extra);
        out.into_bytes()
    }

    #[test]
    fn the_trades_status_moves_forward() {
        assert_eq!(
            place(FIXTURE),
            Placement::Placed {
                object: "20190815155618536-564-57".into(),
                position: Position::new(0, 1)
            }
        );
        let ranks: Vec<Position> = ["WAIT_BUYER_PAY", "TRADE_SUCCESS", "TRADE_FINISHED"]
            .iter()
            .map(|s| match place(&with_status(s, "")) {
                Placement::Placed { position, .. } => position,
                other => panic!("{other:?}"),
            })
            .collect();
        assert!(ranks.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(
            place(&with_status("TRADE_UNKNOWN", "")),
            Placement::Unplaced(Unplaced::UnknownState)
        );
    }

    #[test]
    fn a_refund_is_an_object_of_its_own() {
        let refund = with_status(
            "TRADE_CLOSED",
            "&out_biz_no=20190815-R1&refund_fee=0.10&gmt_refund=2019-08-16%2010%3A00%3A00.123",
        );
        assert_eq!(
            place(&refund),
            Placement::Placed {
                object: "20190815155618536-564-57#refund:20190815-R1".into(),
                position: Position::new(0, 2)
            }
        );
        // Without the request's number: its time.
        let refund = with_status("TRADE_SUCCESS", "&refund_fee=0.05&gmt_refund=2019-08-16");
        assert!(matches!(
            place(&refund),
            Placement::Placed { object, .. } if object == "20190815155618536-564-57#refund:2019-08-16"
        ));
    }
}
