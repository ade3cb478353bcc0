//! The dead-letter calls: `GET /admin/dead`, `GET` and `DELETE
//! /admin/dead/{id}`, `POST /admin/dead/{id}/replay` and `POST
//! /admin/dead/replay`, over what [`admin_dead`] does for them and for the
//! offline `dlq` commands.

use super::{error, json_answer, limit, param, Admin, Answer, Calls, Pairs};
use crate::admin::dead::{self, DeadFilter};
use crate::start::ack::GatewayQueue;
use axum::extract::{Path, State};
use http::StatusCode;
use serde_json::{json, Value};
use tower_idempotency_queue::Queue as _;

/// The queue, or 409 when no route acknowledges then delivers.
fn queue_of(admin: &Admin) -> Result<&GatewayQueue, Box<Answer>> {
    admin.queue.get().ok_or_else(|| {
        Box::new(error(
            StatusCode::CONFLICT,
            "no queue: no route acknowledges then delivers (--ack-then-deliver)",
        ))
    })
}

/// `GET /admin/dead?[since=T][&until=T][&route=P][&error=TEXT][&limit=N][&cursor=C]`.
pub(super) async fn dead_list(State(calls): State<Calls>, Pairs(q): Pairs) -> Answer {
    let queue = match queue_of(&calls.admin) {
        Ok(q) => q,
        Err(res) => return *res,
    };
    let filter = match DeadFilter::parse(&q, &["limit", "cursor"]) {
        Ok(f) => f,
        Err(e) => return error(StatusCode::BAD_REQUEST, &e),
    };
    let limit = match limit(&q) {
        Ok(n) => n,
        Err(e) => return error(StatusCode::BAD_REQUEST, &e),
    };
    let cursor = param(&q, "cursor")
        .filter(|c| !c.is_empty())
        .map(tower_idempotency_queue::EntryId::new);
    let stats = queue.stats().await.ok();
    match dead::page(queue, &filter, limit, cursor).await {
        Ok((letters, next)) => {
            let letters: Vec<Value> = letters.iter().map(dead::summary).collect();
            json_answer(
                StatusCode::OK,
                &json!({
                    "dead_letters": letters,
                    "total": stats.map(|s| s.dead),
                    "next_cursor": next.map(|c| c.to_string()),
                }),
            )
        }
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, &e),
    }
}

/// `GET /admin/dead/{id}`.
pub(super) async fn dead_show(State(calls): State<Calls>, Path(id): Path<String>) -> Answer {
    let queue = match queue_of(&calls.admin) {
        Ok(q) => q,
        Err(res) => return *res,
    };
    match dead::show(queue, &id).await {
        Ok(Some(v)) => json_answer(StatusCode::OK, &v),
        Ok(None) => error(
            StatusCode::NOT_FOUND,
            "no such dead letter (replayed or deleted?)",
        ),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, &e),
    }
}

/// `POST /admin/dead/{id}/replay[?force=true]`.
pub(super) async fn dead_replay(
    State(calls): State<Calls>,
    Path(id): Path<String>,
    Pairs(q): Pairs,
) -> Answer {
    let queue = match queue_of(&calls.admin) {
        Ok(q) => q,
        Err(res) => return *res,
    };
    if let Some((other, _)) = q.iter().find(|(k, _)| k != "force") {
        return error(
            StatusCode::BAD_REQUEST,
            &format!("unknown parameter `{other}`"),
        );
    }
    let force = match flag(&q, "force") {
        Ok(f) => f,
        Err(res) => return *res,
    };
    let key = calls.admin.queue_key.get();
    match dead::replay_one(queue, key, &id, force).await {
        Ok(dead::ReplayOne::Replayed) => {
            json_answer(StatusCode::OK, &json!({ "id": id, "replayed": true }))
        }
        Ok(dead::ReplayOne::Absent) => error(
            StatusCode::NOT_FOUND,
            "no such dead letter (already replayed?)",
        ),
        Ok(dead::ReplayOne::Unauthenticated) => {
            error(StatusCode::FORBIDDEN, &dead::unauthenticated_refusal(&id))
        }
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, &e),
    }
}

/// A boolean query parameter: absent is false.
fn flag(q: &[(String, String)], name: &str) -> Result<bool, Box<Answer>> {
    match param(q, name) {
        None | Some("false" | "0") => Ok(false),
        Some("true" | "1" | "") => Ok(true),
        Some(_) => Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            &format!("`{name}` is true or false"),
        ))),
    }
}

/// `POST /admin/dead/replay?[since=T][&until=T][&route=P][&error=TEXT][&dry_run=true][&force=true]`.
pub(super) async fn dead_replay_all(State(calls): State<Calls>, Pairs(q): Pairs) -> Answer {
    let queue = match queue_of(&calls.admin) {
        Ok(q) => q,
        Err(res) => return *res,
    };
    let filter = match DeadFilter::parse(&q, &["dry_run", "force"]) {
        Ok(f) => f,
        Err(e) => return error(StatusCode::BAD_REQUEST, &e),
    };
    let (dry_run, force) = match (flag(&q, "dry_run"), flag(&q, "force")) {
        (Ok(d), Ok(f)) => (d, f),
        (Err(res), _) | (_, Err(res)) => return *res,
    };
    let key = calls.admin.queue_key.get();
    match dead::replay_selected(queue, key, &filter, dry_run, force).await {
        Ok(v) => json_answer(StatusCode::OK, &v),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, &e),
    }
}

/// `DELETE /admin/dead/{id}?[by=WHO][&reason=WHY]`.
pub(super) async fn dead_delete(
    State(calls): State<Calls>,
    Path(id): Path<String>,
    Pairs(q): Pairs,
) -> Answer {
    let queue = match queue_of(&calls.admin) {
        Ok(q) => q,
        Err(res) => return *res,
    };
    let who = param(&q, "by").unwrap_or("admin API");
    let why = param(&q, "reason").unwrap_or("no reason given");
    let journal = calls.admin.journal.get();
    match dead::delete(queue, journal, &id, who, why).await {
        Ok(Some(d)) => json_answer(
            StatusCode::OK,
            &json!({ "id": id, "deleted": true, "key": d.message.key }),
        ),
        Ok(None) => error(
            StatusCode::NOT_FOUND,
            "no such dead letter (replayed or deleted?)",
        ),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, &e),
    }
}
