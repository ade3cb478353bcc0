//! A notification's business identity: the channel's transaction id, the
//! merchant's order number, the amount in minor units (fen, cents) and the
//! trade state, read from the body where the channel sends them in the clear.

use serde::Deserialize;
use tower_idempotency::key::CapturedRequest;

/// What a payment notification says it is about, for reconciliation with
/// the channel's bill. Every field is optional: a channel, or a copy, may
/// not carry it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Business {
    /// The channel's transaction id (WeChat Pay `transaction_id`, Alipay `trade_no`).
    pub transaction_id: Option<String>,
    /// The merchant's order number (`out_trade_no`).
    pub out_trade_no: Option<String>,
    /// The order's amount in minor units (fen): WeChat Pay `total_fee` /
    /// `amount.total`, Alipay `total_amount` (yuan) × 100, exactly.
    pub amount_minor: Option<i64>,
    /// The trade state the notification reports (`SUCCESS`, `TRADE_SUCCESS`,
    /// `TRADE_FINISHED`, ...; `REFUND` for an Alipay refund notification,
    /// `REFUND_<status>` for a WeChat Pay v3 refund).
    pub trade_state: Option<String>,
}

impl Business {
    /// Reads the identity of a notification guarded by `preset` from the
    /// request the key layer captured: WeChat Pay v2 XML (`transaction_id`,
    /// `out_trade_no`, `total_fee`, `result_code`), Alipay forms (`trade_no`,
    /// `out_trade_no`, `total_amount`, `trade_status`), and WeChat Pay v3
    /// only from the resource the verify layer decrypted (the body's
    /// resource is encrypted: without the route's APIv3 key there is none).
    /// `None` for other presets or when nothing could be read.
    pub fn read(preset: &str, captured: &CapturedRequest) -> Option<Self> {
        let found = match preset {
            "wechatpay-v2" => wechatpay_v2(&captured.body),
            "alipay" => alipay(&captured.body),
            "wechatpay-v3" => wechatpay_v3(captured.decrypted.as_deref()?),
            _ => None,
        }?;
        (found != Self::default()).then_some(found)
    }

    /// Whether the trade state is a successful payment (or unknown).
    pub fn is_paid(&self) -> bool {
        self.trade_state
            .as_deref()
            .is_none_or(|s| matches!(s, "SUCCESS" | "TRADE_SUCCESS" | "TRADE_FINISHED"))
    }
}

fn non_empty(s: &str) -> Option<String> {
    let s = s.trim();
    (!s.is_empty()).then(|| s.to_owned())
}

fn wechatpay_v2(body: &[u8]) -> Option<Business> {
    let fields = tower_idempotency::__private::flat_fields(body).ok()?;
    let get = |name: &str| {
        fields
            .iter()
            .find(|(k, _)| k == name)
            .and_then(|(_, v)| non_empty(v))
    };
    Some(Business {
        transaction_id: get("transaction_id"),
        out_trade_no: get("out_trade_no"),
        amount_minor: get("total_fee").and_then(|f| f.parse().ok()),
        trade_state: get("result_code"),
    })
}

fn alipay(body: &[u8]) -> Option<Business> {
    let wanted = [
        "trade_no",
        "out_trade_no",
        "total_amount",
        "trade_status",
        "refund_fee",
        "gmt_refund",
    ];
    let fields = tower_idempotency::__private::parse_form(body, &wanted);
    let get = |name: &str| {
        fields
            .iter()
            .find(|(k, _)| *k == name)
            .and_then(|(_, v)| non_empty(v))
    };
    // A partial refund is notified with the trade's status (TRADE_SUCCESS)
    // and the refund's fields: it is no second payment.
    let refund = get("refund_fee").is_some() || get("gmt_refund").is_some();
    Some(Business {
        transaction_id: get("trade_no"),
        out_trade_no: get("out_trade_no"),
        amount_minor: get("total_amount").and_then(|a| parse_yuan(&a)),
        trade_state: if refund {
            Some("REFUND".into())
        } else {
            get("trade_status")
        },
    })
}

#[derive(Deserialize)]
struct V3Resource {
    transaction_id: Option<String>,
    out_trade_no: Option<String>,
    trade_state: Option<String>,
    refund_status: Option<String>,
    amount: Option<V3Amount>,
}

#[derive(Deserialize)]
struct V3Amount {
    total: Option<i64>,
}

fn wechatpay_v3(plain: &[u8]) -> Option<Business> {
    let r: V3Resource = serde_json::from_slice(plain).ok()?;
    let refund = r.refund_status.map(|s| format!("REFUND_{s}"));
    Some(Business {
        transaction_id: r.transaction_id.as_deref().and_then(non_empty),
        out_trade_no: r.out_trade_no.as_deref().and_then(non_empty),
        amount_minor: r.amount.and_then(|a| a.total),
        trade_state: r.trade_state.or(refund),
    })
}

/// An amount in yuan (`12`, `0.10`, `-35.8`) in fen, exactly: at most two
/// decimals, no exponent, no float on the way; `None` for anything else.
pub(crate) fn parse_yuan(s: &str) -> Option<i64> {
    let s = s.trim();
    let (negative, s) = match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    let (whole, frac) = s.split_once('.').unwrap_or((s, ""));
    let digits = |p: &str| p.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || whole.len() > 15 || frac.len() > 2 || !digits(whole) || !digits(frac) {
        return None;
    }
    let cents = match frac.len() {
        0 => 0,
        1 => frac.parse::<i64>().ok()? * 10,
        _ => frac.parse::<i64>().ok()?,
    };
    let minor = whole
        .parse::<i64>()
        .ok()?
        .checked_mul(100)?
        .checked_add(cents)?;
    Some(if negative { -minor } else { minor })
}

/// Fen as yuan with two decimals (`10` → `0.10`).
pub fn format_yuan(minor: i64) -> String {
    let sign = if minor < 0 { "-" } else { "" };
    let abs = minor.unsigned_abs();
    format!("{sign}{}.{:02}", abs / 100, abs % 100)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn captured(body: &str) -> CapturedRequest {
        CapturedRequest::new(Bytes::from(body.to_owned()), None, false)
    }

    #[test]
    fn reads_wechatpay_v2_and_alipay() {
        let v2 = "<xml><transaction_id><![CDATA[42]]></transaction_id>\
                  <out_trade_no>o1</out_trade_no><total_fee>101</total_fee>\
                  <result_code>SUCCESS</result_code></xml>";
        let b = Business::read("wechatpay-v2", &captured(v2)).unwrap();
        assert_eq!(b.transaction_id.as_deref(), Some("42"));
        assert_eq!(b.amount_minor, Some(101));
        assert!(b.is_paid());
        let form = "trade_no=T1&out_trade_no=O1&total_amount=0.10&trade_status=TRADE_SUCCESS";
        let b = Business::read("alipay", &captured(form)).unwrap();
        assert_eq!(
            (b.transaction_id.as_deref(), b.amount_minor),
            (Some("T1"), Some(10))
        );
        let refund = format!("{form}&refund_fee=0.05");
        let b = Business::read("alipay", &captured(&refund)).unwrap();
        assert!(!b.is_paid());
        // v3: the resource the verify layer decrypted.
        let plain = r#"{"transaction_id":"4200000914","out_trade_no":"S1","trade_state":"SUCCESS","amount":{"total":1,"currency":"CNY"}}"#;
        let v3 = CapturedRequest::new(
            Bytes::from_static(b"{}"),
            Some(Bytes::from_static(plain.as_bytes())),
            true,
        );
        let b = Business::read("wechatpay-v3", &v3).unwrap();
        assert_eq!(
            (b.out_trade_no.as_deref(), b.amount_minor),
            (Some("S1"), Some(1))
        );
        let refund = r#"{"transaction_id":"4200000914","out_trade_no":"S1","refund_status":"SUCCESS","amount":{"total":1}}"#;
        let v3 = CapturedRequest::new(
            v3.body,
            Some(Bytes::from_static(refund.as_bytes())),
            v3.verified,
        );
        assert!(!Business::read("wechatpay-v3", &v3).unwrap().is_paid());
        // v3 without the decrypted resource: nothing.
        assert_eq!(Business::read("wechatpay-v3", &captured("{}")), None);
        assert_eq!(Business::read("stripe", &captured("{}")), None);
        assert_eq!(Business::read("wechatpay-v2", &captured("<xml>")), None);
    }

    #[test]
    fn yuan_reads_exactly() {
        assert_eq!(parse_yuan("0.10"), Some(10));
        assert_eq!(parse_yuan("1299.02"), Some(129_902));
        assert_eq!(parse_yuan("-35.8"), Some(-3580));
        assert_eq!(parse_yuan("0.001"), None);
        assert_eq!(parse_yuan("1e3"), None);
    }

    #[test]
    fn yuan_round_trips_exactly() {
        for minor in [0, 1, 10, 99, 100, 12_345, -3580] {
            assert_eq!(parse_yuan(&format_yuan(minor)), Some(minor));
        }
        for bad in ["", ".5", "1.234", "1,00", "abc", "--1", "1.-1"] {
            assert_eq!(parse_yuan(bad), None, "{bad}");
        }
    }
}
