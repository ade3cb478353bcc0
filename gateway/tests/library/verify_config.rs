//! A route's `verify` table ([`VerifyConfig`]): built into the route's
//! verifier, strict about its fields, secrets read from where it says.

use test_support::common;
use test_support::verify_support::{through, wechatpay_v3};

use http::StatusCode;
use idempotency_gateway::config::VerifyConfig;

#[tokio::test]
async fn a_verify_table_builds_the_route_verifier() {
    let case = wechatpay_v3();
    let base = common::vectors::fixtures_dir();
    let config: VerifyConfig = serde_json::from_value(serde_json::json!({
        "platform_keys": { "D7CE59D1F522D701": "wechatpay_v3_platform_cert.pem" },
        "api_v3_key": { "value": "testMchAPIv3Key0" },
        "tolerance": "5m",
    }))
    .unwrap();
    let layer = config.layer("wechatpay-v3", &base).unwrap();
    let (status, _, ran) = through(layer.clone(), case.now, &case.headers, case.body.clone()).await;
    assert_eq!(status, StatusCode::OK);
    assert!(ran);
    let (status, _, _) = through(layer, case.now + 301, &case.headers, case.body.clone()).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    // A field another channel reads is an error, and so is a misspelt one.
    let stray: VerifyConfig =
        serde_json::from_value(serde_json::json!({ "secrets": ["whsec_x"] })).unwrap();
    assert!(stray
        .layer("wechatpay-v3", &base)
        .unwrap_err()
        .to_string()
        .contains("secrets"));
    assert!(
        serde_json::from_value::<VerifyConfig>(serde_json::json!({ "secret": ["whsec_x"] }))
            .is_err()
    );
    // Secrets from the environment; a missing variable is reported by name.
    let env: VerifyConfig = serde_json::from_value(
        serde_json::json!({ "secrets": [{ "env": "TOWER_IDEMPOTENCY_TEST_UNSET_SECRET" }] }),
    )
    .unwrap();
    assert!(env
        .layer("stripe", &base)
        .unwrap_err()
        .to_string()
        .contains("TOWER_IDEMPOTENCY_TEST_UNSET_SECRET"));
}
