use axum::{http::StatusCode, routing::post, Router};
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

async fn create_order(body: String) -> String {
    format!("created from {body}")
}

fn app(wechat_keys: impl Into<VerifyLayer>) -> Router {
    Router::new()
        .route(
            "/notify/wechatpay",
            post(on_wechat_paid).layer(IdempotencyLayer::wechatpay_v3().verify(wechat_keys)),
        )
        .route(
            "/orders",
            post(create_order).layer(IdempotencyLayer::idempotency_key()),
        )
}
