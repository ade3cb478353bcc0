//! WeChat Pay API v3: JSON notifications keyed by `/id`.

use super::{fixed, Preset};
use crate::key::{Field, FingerprintSpec, KeySpec};
use crate::normalize::Reply;

pub(super) fn preset() -> Preset {
    Preset::channel(
        "wechatpay-v3",
        KeySpec::new(
            [Field::json("/id")],
            FingerprintSpec::Fields(vec![
                Field::json("/event_type"),
                Field::json("/resource/original_type"),
            ]),
        ),
        Reply::new(
            fixed(
                200,
                "application/json",
                r#"{"code":"SUCCESS","message":"成功"}"#,
            ),
            fixed(
                500,
                "application/json",
                r#"{"code":"FAIL","message":"失败"}"#,
            ),
        ),
    )
}
