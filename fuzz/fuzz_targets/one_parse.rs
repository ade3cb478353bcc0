//! One parse: bytes spliced into a genuine signed notification (WeChat Pay
//! v2, Alipay, Adyen). Whenever the spliced body still verifies, the key and
//! fingerprint read from it must be those of the genuine body: every field
//! the key and fingerprint read is a field the verifier checked.
//!
//! Input: one byte picks the channel and whether to insert or overwrite, two
//! bytes the offset, the rest the bytes spliced in.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use std::time::SystemTime;
use tower_idempotency::verify::{AdyenKeys, AlipayKeys, Verifier, WechatPayV2Keys};
use tower_idempotency::Preset;

#[path = "common.rs"]
mod common;

struct Case {
    body: &'static [u8],
    preset: Preset,
    verifier: Box<dyn Verifier>,
}

fn cases() -> &'static [Case] {
    static CASES: OnceLock<Vec<Case>> = OnceLock::new();
    CASES.get_or_init(|| {
        vec![
            Case {
                body: include_bytes!(
                    "../../crates/tower-idempotency/tests/fixtures/wechatpay_v2_notify_SYNTHESIZED_md5_doc_key.xml"
                ),
                preset: Preset::wechatpay_v2(),
                verifier: Box::new(
                    WechatPayV2Keys::new()
                        .api_key("192006250b4c09247ec02edce69f6a2d")
                        .unwrap(),
                ),
            },
            Case {
                body: include_bytes!(
                    "../../crates/tower-idempotency/tests/fixtures/alipay_notify_trade_status_sync_alipay-sdk-nodejs-all.form"
                ),
                preset: Preset::alipay(),
                verifier: Box::new(
                    AlipayKeys::new()
                        .public_key(include_bytes!(
                            "../../crates/tower-idempotency/tests/fixtures/alipay_public_key_trade_status_sync.pem"
                        ))
                        .unwrap(),
                ),
            },
            Case {
                body: include_bytes!(
                    "../../crates/tower-idempotency/tests/fixtures/adyen_notify_adyen-python_colon_ENVELOPED.json"
                ),
                preset: Preset::adyen(),
                verifier: Box::new(
                    AdyenKeys::new()
                        .hmac_key("74F490DD33F7327BAECC88B2947C011FC02D014A473AAA33A8EC93E4DC069174")
                        .unwrap(),
                ),
            },
        ]
    })
}

fuzz_target!(|data: &[u8]| {
    let [pick, lo, hi, splice @ ..] = data else {
        return;
    };
    let case = &cases()[usize::from(pick % 3)];
    let at = usize::from(u16::from_le_bytes([*lo, *hi])) % (case.body.len() + 1);
    let mut body = case.body[..at].to_vec();
    body.extend_from_slice(splice);
    // Insert, or overwrite as many bytes as were spliced in.
    let rest = if pick & 0x80 == 0 {
        at
    } else {
        (at + splice.len()).min(case.body.len())
    };
    body.extend_from_slice(&case.body[rest..]);
    let body = Bytes::from(body);
    let parts = common::parts_with_headers(b"");
    common::check(&**case.preset.extractor(), &parts, &body);
    let verified = case
        .verifier
        .verify(&mut parts.clone(), &body, SystemTime::now())
        .is_ok();
    if verified {
        let genuine = Bytes::from_static(case.body);
        let want = case.preset.extractor().extract(&parts, &genuine).unwrap();
        let got = case.preset.extractor().extract(&parts, &body).unwrap();
        assert_eq!(got, want, "a body that verifies was read differently");
    }
});
