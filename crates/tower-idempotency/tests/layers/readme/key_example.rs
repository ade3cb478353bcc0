use axum::{routing::post, Router};
use tower_idempotency::IdempotencyLayer;

/// Runs once per `Idempotency-Key`: a retry with the same key and body gets
/// this answer again (with `idempotent-replayed: true`), not a second order.
async fn create_order(body: String) -> String {
    format!("order created from {body}\n")
}

fn app() -> Router {
    Router::new().route(
        "/orders",
        post(create_order).layer(IdempotencyLayer::idempotency_key()),
    )
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    axum::serve(listener, app()).await?;
    Ok(())
}
