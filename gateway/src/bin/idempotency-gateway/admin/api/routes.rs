//! The route calls: `GET /admin/routes`, `POST
//! /admin/routes/pause|resume?prefix=…`, and the console's `GET
//! /admin/stats`.

use super::{
    error, json_answer, param, rfc3339, Admin, Answer, Calls, Pairs, Routes, STORE_TIMEOUT,
};
use axum::extract::State;
use http::StatusCode;
use serde_json::{json, Value};
use std::time::SystemTime;
use tower_idempotency_queue::{Queue as _, SharedPacing as _};
use tracing::info;

fn pause_json(info: &idempotency_gateway::proxy::PauseInfo) -> Value {
    json!({
        "since": rfc3339(info.since_ms),
        "since_ms": info.since_ms,
        "by": info.by,
        "reason": info.reason,
    })
}

/// The routes, or 409 before the gateway gave them.
fn routes_of(admin: &Admin) -> Result<&Routes, Box<Answer>> {
    (admin.routes.get())
        .ok_or_else(|| Box::new(error(StatusCode::CONFLICT, "the routes are not known yet")))
}

/// `GET /admin/routes`: every route, its preset, upstream, mode and pause,
/// and the queue's depth and dead letters (the whole queue's: said by
/// `queue_scope`).
pub(super) async fn routes_list(State(calls): State<Calls>) -> Answer {
    let routes = match routes_of(&calls.admin) {
        Ok(r) => r,
        Err(res) => return *res,
    };
    let queue = calls.admin.queue.get();
    let stats = match queue {
        Some(q) => tokio::time::timeout(STORE_TIMEOUT, q.stats())
            .await
            .ok()
            .and_then(Result::ok),
        None => None,
    };
    let mut out = Vec::new();
    for r in &routes.list {
        let paused = routes.keeper.pauses().get(&r.prefix);
        // The embedded queue shares no breaker (each route's is the
        // worker's own): none to show.
        let shared = queue.and_then(crate::start::ack::shared);
        let breaker = match (shared, r.acked) {
            (Some(q), true) => {
                let state = tokio::time::timeout(STORE_TIMEOUT, q.breaker_state(&r.prefix)).await;
                match state {
                    Ok(Ok(Some(s))) => json!(format!("{s:?}").to_lowercase()),
                    _ => Value::Null,
                }
            }
            _ => Value::Null,
        };
        let queued = match (&stats, r.acked) {
            (Some(s), true) => json!({
                "depth": s.depth,
                "oldest_s": s.oldest.map(|d| d.as_secs_f64()),
                "dead_letters": s.dead,
                "scope": "queue",
            }),
            _ => Value::Null,
        };
        out.push(json!({
            "prefix": r.prefix,
            "preset": r.preset,
            "upstream": r.upstream.as_ref().unwrap_or(&routes.upstream),
            "mode": if r.acked { "ack_then_deliver" } else { "synchronous" },
            "paused": paused.as_ref().map(pause_json),
            "breaker": breaker,
            "queue": queued,
        }));
        if !r.destinations.is_empty() {
            out.last_mut().expect("pushed")["destinations"] = json!(r.destinations);
        }
    }
    json_answer(StatusCode::OK, &json!({ "routes": out }))
}

/// The configured route `?prefix=` names (with `&upstream=NAME`: that
/// destination of the route), or 400/404.
fn named_route<'a>(routes: &'a Routes, q: &[(String, String)]) -> Result<&'a str, Box<Answer>> {
    let Some(prefix) = param(q, "prefix") else {
        return Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            "`prefix` is needed",
        )));
    };
    if let Some(upstream) = param(q, "upstream") {
        let scope = idempotency_gateway::proxy::destination_scope(prefix, upstream);
        return routes.keeper.route(&scope).ok_or_else(|| {
            Box::new(error(
                StatusCode::NOT_FOUND,
                "this route delivers to no such upstream (its `deliver` list names its destinations)",
            ))
        });
    }
    routes.keeper.route(prefix).ok_or_else(|| {
        Box::new(error(
            StatusCode::NOT_FOUND,
            "no route has this prefix (GET /admin/routes lists them)",
        ))
    })
}

/// `POST /admin/routes/pause?prefix=P[&by=WHO][&reason=WHY]`.
pub(super) async fn route_pause(State(calls): State<Calls>, Pairs(q): Pairs) -> Answer {
    let routes = match routes_of(&calls.admin) {
        Ok(r) => r,
        Err(res) => return *res,
    };
    let prefix = match named_route(routes, &q) {
        Ok(p) => p,
        Err(res) => return *res,
    };
    let since_ms = crate::admin::dead::ms_of(SystemTime::now());
    let by: String = param(&q, "by")
        .unwrap_or("admin API")
        .chars()
        .take(200)
        .collect();
    let reason: String = param(&q, "reason")
        .unwrap_or("")
        .chars()
        .take(1000)
        .collect();
    let info = idempotency_gateway::proxy::PauseInfo::new(since_ms, by, reason);
    match routes.keeper.pause(prefix, info.clone()).await {
        Ok(()) => {
            info!(route = prefix, by = %info.by, reason = %info.reason, "admin: route paused");
            json_answer(
                StatusCode::OK,
                &json!({ "prefix": prefix, "paused": pause_json(&info) }),
            )
        }
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, &e),
    }
}

/// `POST /admin/routes/resume?prefix=P`.
pub(super) async fn route_resume(State(calls): State<Calls>, Pairs(q): Pairs) -> Answer {
    let routes = match routes_of(&calls.admin) {
        Ok(r) => r,
        Err(res) => return *res,
    };
    let prefix = match named_route(routes, &q) {
        Ok(p) => p,
        Err(res) => return *res,
    };
    match routes.keeper.resume(prefix).await {
        Ok(was) => {
            info!(route = prefix, was_paused = was, "admin: route resumed");
            json_answer(
                StatusCode::OK,
                &json!({ "prefix": prefix, "paused": null, "was_paused": was }),
            )
        }
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, &e),
    }
}

/// `GET /admin/stats`: this instance's request counters by outcome, read
/// every 5 seconds over the last hour.
pub(super) async fn stats(State(calls): State<Calls>) -> Answer {
    match calls.admin.samples.get() {
        Some(samples) => json_answer(StatusCode::OK, &samples.json()),
        None => json_answer(
            StatusCode::OK,
            &json!({ "interval_ms": 5000, "samples": [] }),
        ),
    }
}
