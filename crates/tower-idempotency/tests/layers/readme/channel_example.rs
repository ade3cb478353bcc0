use axum::{http::StatusCode, routing::post, Router};
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_idempotency::verify::{DecryptedResource, VerifyLayer, WechatPayV3Keys};
use tower_idempotency::IdempotencyLayer;

/// Runs once per notification, after its signature was checked;
/// `resource` is the decrypted transaction (JSON).
async fn on_wechat_paid(DecryptedResource(resource): DecryptedResource) -> StatusCode {
    let Ok(tx) = serde_json::from_slice::<serde_json::Value>(&resource) else {
        return StatusCode::UNPROCESSABLE_ENTITY; // a failure: WeChat Pay retries
    };
    tracing::info!(%tx, "paid"); // mark tx["out_trade_no"] paid, ship, credit points…
    StatusCode::OK // any 2xx is success
}

fn app(wechat_keys: impl Into<VerifyLayer>) -> Router {
    Router::new()
        .route(
            "/notify/wechatpay",
            post(on_wechat_paid).layer(IdempotencyLayer::wechatpay_v3().verify(wechat_keys)),
        )
        // Each request gets an `x-request-id` (the sender's, or a new UUID),
        // answered back and named in the layers' log lines: why a
        // notification was refused is logged with it.
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
}

// The platform certificate (or WeChat Pay public key) under its serial, the
// `Wechatpay-Serial` header's value, and the APIv3 key: here wechatpay-go's
// test keys; yours are in the merchant platform ("API security").
const PLATFORM_SERIAL: &str = "D7CE59D1F522D701";
const PLATFORM_CERT: &str = "\
-----BEGIN CERTIFICATE-----
MIIDVzCCAj+gAwIBAgIJANfOWdH1ItcBMA0GCSqGSIb3DQEBCwUAMEIxCzAJBgNV
BAYTAlhYMRUwEwYDVQQHDAxEZWZhdWx0IENpdHkxHDAaBgNVBAoME0RlZmF1bHQg
Q29tcGFueSBMdGQwHhcNMjEwNDI3MDg1NTIzWhcNMzEwNDI1MDg1NTIzWjBCMQsw
CQYDVQQGEwJYWDEVMBMGA1UEBwwMRGVmYXVsdCBDaXR5MRwwGgYDVQQKDBNEZWZh
dWx0IENvbXBhbnkgTHRkMIIBIjANBgkqhkiG9w0BAQEFAAOCAQ8AMIIBCgKCAQEA
2VCTd91fnUn73Xy9DLvt/V62TVxRTEEstVdeRaZ3B3leO0pldE806mXO4RwdHXag
HQ4vGeZN0yqm++rDsGK+U3AH7kejyD2pXshNP9Cq5YwbptiLGtjcquw4HNxJQUOm
DeJf2vg6byms9RUipiq4SzbJKqJFlUpbuIPDpSpWz10PYmyCNeDGUUK65E5h2B83
4uxl1zNLYQCrkdBzb8oUxwYeP5a2DNxmjL5lsJML7DGr5znsevnoqGRwTm9fxCGf
y8wus7hwKz6clt3Whmmda7UAdb1c08hEQFVRbF14AR73xbnd8N0obCWJPCbzMCtk
aSef4FdEEgEXJiw0VAJT8wIDAQABo1AwTjAdBgNVHQ4EFgQUT1c7nd/SUO76HSoZ
umNUJv1R5PwwHwYDVR0jBBgwFoAUT1c7nd/SUO76HSoZumNUJv1R5PwwDAYDVR0T
BAUwAwEB/zANBgkqhkiG9w0BAQsFAAOCAQEAfTjxKRQMzNB/U6ZoCUS+BSNfa2Oh
0plMN6ZuzwiVVZwg1jywvv5yv04koS7Pd4i9E4gt9ZBUQXlpq+A3oOCEEHNRR6b2
kyazGRM7s0OP5X21WrbpSmKmU6K7hkfx30yYs08LVs/Q8DIhvaj1FCFeJzUCzYn/
fHMq4tsbKO0dKAeydPM/nrUZBmaYQVKMVOORGLFjFKVO7JV6Kq/R86ouhjEPgJOe
2xulNBUcjicqtZlBdEh/PWCYP2SpGVDclKm8jeo175T3EVAkdKzzmfpxtMmnMlmq
cTJOU9TxuGvNASMtjj7pYIerTx+xgZDXEVBWFW9PjJ0TV06tCRsgSHItgg==
-----END CERTIFICATE-----";
const API_V3_KEY: &str = "testMchAPIv3Key0";

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt::init(); // the layers' warnings: refusals and their reasons
    let keys = WechatPayV3Keys::new()
        .platform_key(PLATFORM_SERIAL, PLATFORM_CERT)?
        .api_v3_key(API_V3_KEY)?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    axum::serve(listener, app(keys)).await?;
    Ok(())
}
