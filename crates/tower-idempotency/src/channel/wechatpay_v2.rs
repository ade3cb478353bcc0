//! WeChat Pay API v2: XML notifications keyed by `transaction_id`.

use super::{fixed, Preset};
use crate::key::{Field, FingerprintSpec, KeySpec};
use crate::normalize::Reply;

pub(super) fn preset() -> Preset {
    Preset::channel(
        "wechatpay-v2",
        KeySpec::new(
            [Field::xml("transaction_id")],
            FingerprintSpec::Fields(vec![
                Field::xml("out_trade_no"),
                Field::xml("total_fee"),
                Field::xml("result_code"),
            ]),
        ),
        Reply::new(
            fixed(
                200,
                "text/xml; charset=utf-8",
                "<xml><return_code><![CDATA[SUCCESS]]></return_code><return_msg><![CDATA[OK]]></return_msg></xml>",
            ),
            fixed(
                500,
                "text/xml; charset=utf-8",
                "<xml><return_code><![CDATA[FAIL]]></return_code><return_msg><![CDATA[FAIL]]></return_msg></xml>",
            ),
        ),
    )
}
