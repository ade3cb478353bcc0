//! Alipay: form-encoded notifications keyed by `notify_id`, answered with the
//! seven bytes `success`.

use super::{fixed, hours, Preset};
use crate::key::{Field, FingerprintSpec, KeySpec};
use crate::normalize::Reply;

pub(super) fn preset() -> Preset {
    Preset::channel(
        "alipay",
        KeySpec::new(
            [Field::form("notify_id")],
            FingerprintSpec::Fields(vec![
                Field::form("out_trade_no"),
                Field::form("trade_no"),
                Field::form("trade_status"),
                Field::form("total_amount"),
            ]),
        ),
        Reply::new(
            fixed(200, "text/plain; charset=utf-8", "success"),
            fixed(500, "text/plain; charset=utf-8", "fail"),
        ),
    )
    .with_window(hours(26))
}
