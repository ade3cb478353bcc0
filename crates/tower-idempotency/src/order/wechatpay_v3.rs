//! WeChat Pay v3's order: a transaction's `trade_state` and a refund's
//! `refund_status`, read from the resource the verify layer decrypted.

use super::place::{Order, Placement, Unplaced};
use crate::key::{Field, FingerprintSpec, KeySpec};
use crate::store::Position;
use crate::verify::DecryptedResource;
use bytes::Bytes;
use http::request::Parts;
use std::sync::LazyLock;

/// The fields of a decrypted resource: a transaction's or a refund's.
static RESOURCE: LazyLock<KeySpec> = LazyLock::new(|| {
    KeySpec::new(
        [
            Field::json("/out_trade_no"),
            Field::json("/trade_state"),
            Field::json("/out_refund_no"),
            Field::json("/refund_status"),
        ],
        FingerprintSpec::None,
    )
});

/// The rank of a transaction's `trade_state`.
fn trade_rank(state: &str) -> Option<u32> {
    Some(match state {
        "NOTPAY" => 0,
        "USERPAYING" => 1,
        "PAYERROR" => 2,
        "SUCCESS" => 3,
        "REFUND" | "CLOSED" | "REVOKED" => 4,
        _ => return None,
    })
}

/// The rank of a refund's `refund_status`.
fn refund_rank(status: &str) -> Option<u32> {
    Some(match status {
        "PROCESSING" => 0,
        "ABNORMAL" => 1,
        "SUCCESS" | "CLOSED" => 2,
        _ => return None,
    })
}

fn place(parts: &Parts, _body: &Bytes) -> Placement {
    let Some(DecryptedResource(resource)) = parts.extensions.get::<DecryptedResource>() else {
        return Placement::Unplaced(Unplaced::Unreadable);
    };
    let Ok(values) = RESOURCE.values(parts, resource) else {
        return Placement::Unplaced(Unplaced::Unreadable);
    };
    let [trade, trade_state, refund, refund_status] = &values[..] else {
        return Placement::Unplaced(Unplaced::Unreadable);
    };
    let Some(trade) = trade else {
        return Placement::Unplaced(Unplaced::NoObject);
    };
    let (object, rank) = match refund {
        // A refund: an object of its own, never judged by the trade.
        Some(refund) => (
            format!("{trade}#refund:{refund}"),
            refund_status.as_deref().and_then(refund_rank),
        ),
        None => (trade.clone(), trade_state.as_deref().and_then(trade_rank)),
    };
    let Some(rank) = rank else {
        return Placement::Unplaced(Unplaced::UnknownState);
    };
    Placement::Placed {
        object,
        position: Position::new(0, rank),
    }
}

impl Order {
    /// WeChat Pay v3 (feature `verify`), from the `resource` the verify
    /// layer decrypted with the APIv3 key (a route that does not decrypt
    /// leaves every notification unplaced). A transaction is its
    /// `out_trade_no`, ranked by its `trade_state`: `NOTPAY` < `USERPAYING`
    /// < `PAYERROR` < `SUCCESS` < `REFUND` = `CLOSED` = `REVOKED`
    /// ([payment notification](https://pay.weixin.qq.com/wiki/doc/apiv3/apis/chapter3_1_5.shtml)).
    /// A refund (its resource has `out_refund_no`) is an object of its own,
    /// `out_trade_no#refund:out_refund_no`, ranked by its `refund_status`:
    /// `PROCESSING` < `ABNORMAL` < `SUCCESS` = `CLOSED` (an abnormal refund
    /// the merchant handles ends in success;
    /// [refund notification](https://pay.weixin.qq.com/wiki/doc/apiv3/apis/chapter3_1_11.shtml)).
    /// No version: the rank alone.
    pub fn wechatpay_v3() -> Self {
        Self::built_in_request("wechatpay-v3", place)
    }
}

#[cfg(test)]
mod tests {
    use crate::order::{Order, Placement, Unplaced};
    use crate::store::Position;
    use crate::verify::DecryptedResource;
    use bytes::Bytes;

    /// The official doc's notification, its resource as decrypted.
    const NOTIFICATION: &[u8] = include_bytes!(
        "../../tests/fixtures/wechatpay_v3_notify_official_doc_transaction_success.json"
    );

    fn place(resource: Option<&str>) -> Placement {
        let (mut parts, _) = http::Request::post("/").body(()).unwrap().into_parts();
        if let Some(resource) = resource {
            parts
                .extensions
                .insert(DecryptedResource(Bytes::copy_from_slice(
                    resource.as_bytes(),
                )));
        }
        Order::wechatpay_v3().place(&parts, &Bytes::from_static(NOTIFICATION))
    }

    #[test]
    fn transactions_and_refunds() {
        let paid = r#"{"mchid":"1230000109","appid":"wxd678efh567hg6787","out_trade_no":"1217752501201407033233368018",
            "transaction_id":"1217752501201407033233368018","trade_type":"JSAPI","trade_state":"SUCCESS",
            "trade_state_desc":"支付成功","success_time":"2018-06-08T10:34:56+08:00","amount":{"total":100}}"#;
        assert_eq!(
            place(Some(paid)),
            Placement::Placed {
                object: "1217752501201407033233368018".into(),
                position: Position::new(0, 3)
            }
        );
        let refund = r#"{"mchid":"1900000100","out_trade_no":"1217752501201407033233368018",
            "transaction_id":"1217752501201407033233368018","out_refund_no":"1217752501201407033233368018",
            "refund_id":"50000000382019052709732678859","refund_status":"SUCCESS",
            "success_time":"2018-06-08T10:34:56+08:00","amount":{"total":999,"refund":1}}"#;
        assert_eq!(
            place(Some(refund)),
            Placement::Placed {
                object: "1217752501201407033233368018#refund:1217752501201407033233368018".into(),
                position: Position::new(0, 2)
            }
        );
        assert_eq!(place(None), Placement::Unplaced(Unplaced::Unreadable));
        assert_eq!(
            place(Some(r#"{"out_trade_no":"1","trade_state":"LOST"}"#)),
            Placement::Unplaced(Unplaced::UnknownState)
        );
    }
}
