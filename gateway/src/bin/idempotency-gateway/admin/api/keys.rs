//! `/admin/keys`: find a key by the channel's id, inspect a key (its record
//! and its journal entry), and forget one (its record, and its queue marker).

use super::{
    error, journal_json, json_answer, other_call, paging, param, Admin, Answer, Calls, Pairs,
    STORE_TIMEOUT,
};
use crate::start::store::GatewayStore;
use axum::extract::{FromRequestParts, Path, State};
use http::request::Parts;
use http::{Method, StatusCode};
use idempotency_gateway::journal::{JournalEvent, JournalFilter, JournalOutcome};
use idempotency_gateway::proxy::{destination_stored_key, queued_keys};
use serde_json::{json, Value};
use std::time::SystemTime;
use tower_idempotency::store::{Forgotten, RecordState, Store};
use tower_idempotency::Preset;
use tower_idempotency_queue::destination_key;
use tower_idempotency_queue::Queue;
use tracing::{info, warn};

/// Records `/admin/keys?id=` looks at per page: past it the page ends
/// with a cursor, so that a search of a large journal answers in bounded time.
const KEYS_SCAN: usize = 10_000;

fn state_json(state: &RecordState) -> Value {
    match state {
        RecordState::Absent => json!({ "state": "absent" }),
        RecordState::InFlight {
            age, lease_left, ..
        } => json!({
            "state": "in_flight",
            "owner_age_ms": age.map(|a| a.as_millis() as u64),
            "lease_left_ms": lease_left.as_millis() as u64,
        }),
        RecordState::Completed { record, left } => json!({
            "state": "completed",
            "status": record.response.status.as_u16(),
            "body_bytes": record.response.body.len(),
            "body_omitted": record.response.body_omitted,
            "left_ms": left.as_millis() as u64,
        }),
        _ => json!({ "state": "unknown" }),
    }
}

/// A stored key for the log: its hash, never its text.
fn redact(key: &str) -> String {
    let hash = tower_idempotency::Fingerprint::of(key.as_bytes());
    format!("{hash:?}")
}

/// Another method on a key: 405, once the key is known to be UTF-8 (400).
pub(super) async fn other_key_call(method: Method, _: Key) -> Answer {
    other_call(method).await
}

/// The key of a `/admin/keys/{key}` call: the rest of the path,
/// percent-decoded once (a `%` that starts no escape is kept as it is),
/// empty on `/admin/keys/`; 400 when it decodes to bytes that are not UTF-8.
pub(super) struct Key(String);

impl<S: Send + Sync> FromRequestParts<S> for Key {
    type Rejection = Answer;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Answer> {
        match <Option<Path<String>>>::from_request_parts(parts, state).await {
            Ok(key) => Ok(Self(key.map(|Path(key)| key).unwrap_or_default())),
            // The one way a `{*key}` capture fails: its escapes decode to
            // bytes that are not UTF-8.
            Err(_) => Err(error(StatusCode::BAD_REQUEST, "the key is not valid UTF-8")),
        }
    }
}

pub(super) async fn inspect(State(calls): State<Calls>, Key(key): Key) -> Answer {
    calls.admin.inspect(&key, &calls.store).await
}

pub(super) async fn forget(State(calls): State<Calls>, Key(key): Key, Pairs(q): Pairs) -> Answer {
    let who = param(&q, "by").unwrap_or("admin API");
    calls.admin.forget(&key, who, &calls.store).await
}

pub(super) async fn find(State(calls): State<Calls>, Pairs(q): Pairs) -> Answer {
    calls.admin.find(&q, &calls.store).await
}

impl Admin {
    /// Forgets `key` (and its copies) in the queue, if there is one: whether
    /// a marker of a delivered key was forgotten. An error while an entry of
    /// the key is still queued, or when the queue fails.
    async fn forget_queued(&self, key: &str) -> Result<bool, String> {
        let Some(queue) = self.queue.get() else {
            return Ok(false);
        };
        let mut forgot = false;
        let scoped = (self.destinations_of(key).into_iter()).map(|d| destination_key(key, &d));
        let all: Vec<String> = std::iter::once(key.to_owned()).chain(scoped).collect();
        for queued in all.iter().flat_map(|k| queued_keys(k).collect::<Vec<_>>()) {
            match tokio::time::timeout(STORE_TIMEOUT, queue.forget(&queued)).await {
                Ok(Ok(done)) => forgot |= done,
                Ok(Err(e)) => return Err(e.to_string()),
                Err(_) => return Err("the queue did not answer".into()),
            }
        }
        Ok(forgot)
    }

    /// The destinations of the route `key` was stored for (its third part,
    /// the route's prefix): none for a route with one upstream.
    fn destinations_of(&self, key: &str) -> Vec<String> {
        let Some(routes) = self.routes.get() else {
            return Vec::new();
        };
        let Some(route) = key.split(':').nth(2) else {
            return Vec::new();
        };
        let Ok(route) = percent_encoding::percent_decode_str(route).decode_utf8() else {
            return Vec::new();
        };
        (routes.list.iter())
            .find(|r| r.prefix == route)
            .map(|r| r.destinations.clone())
            .unwrap_or_default()
    }

    /// Each destination of `key`'s route and the stored key of its delivery.
    fn delivery_keys(&self, key: &str) -> Vec<(String, String)> {
        (self.destinations_of(key).into_iter())
            .filter_map(|d| destination_stored_key(key, &d).map(|k| (d, k)))
            .collect()
    }

    /// The store that holds `key`: its route's (the route and the preset
    /// are the stored key's third and second parts), or the one store.
    fn store_of(&self, key: &str, store: &GatewayStore) -> GatewayStore {
        let Some(pick) = self.stores.get() else {
            return store.clone();
        };
        let mut parts = key.splitn(4, ':');
        let (_, Some(preset), Some(route)) = (parts.next(), parts.next(), parts.next()) else {
            return store.clone();
        };
        let decode = |s| percent_encoding::percent_decode_str(s).decode_utf8();
        let (Ok(preset), Ok(route)) = (decode(preset), decode(route)) else {
            return store.clone();
        };
        match Preset::from_name(&preset) {
            Some(preset) => pick(&route, &preset),
            // A configured preset is a channel's: its records are in its
            // route's channel store.
            None if !preset.is_empty() => pick(&route, &Preset::stripe()),
            None => store.clone(),
        }
    }

    async fn journal_of(&self, key: &str) -> Value {
        let Some(journal) = self.journal.get() else {
            return Value::Null;
        };
        match journal.get(key).await {
            Ok(Some(record)) => journal_json(&record),
            Ok(None) => Value::Null,
            Err(e) => json!({ "error": e.to_string() }),
        }
    }

    async fn state(&self, key: &str, store: &GatewayStore) -> Result<Value, Answer> {
        let store = self.store_of(key, store);
        match tokio::time::timeout(STORE_TIMEOUT, store.inspect(key)).await {
            Ok(Ok(state)) => Ok(state_json(&state)),
            Ok(Err(e)) => {
                warn!(error = %e, "admin: inspect failed");
                Err(error(StatusCode::SERVICE_UNAVAILABLE, "the store failed"))
            }
            Err(_) => Err(error(
                StatusCode::SERVICE_UNAVAILABLE,
                "the store did not answer",
            )),
        }
    }

    async fn inspect(&self, key: &str, store: &GatewayStore) -> Answer {
        let record = match self.state(key, store).await {
            Ok(v) => v,
            Err(res) => return res,
        };
        let journal = self.journal_of(key).await;
        let mut answer = json!({ "key": key, "record": record, "journal": journal });
        // A route with several destinations: each one's delivery.
        let mut destinations = Vec::new();
        for (destination, stored) in self.delivery_keys(key) {
            let record = match self.state(&stored, store).await {
                Ok(v) => v,
                Err(res) => return res,
            };
            destinations.push(json!({ "destination": destination, "record": record }));
        }
        if !destinations.is_empty() {
            answer["destinations"] = Value::Array(destinations);
        }
        json_answer(StatusCode::OK, &answer)
    }

    /// `?id=ID[&preset=P][&route=R][&limit=N][&cursor=C]`: the keys the
    /// journal knows that end in the channel's id, each inspected, a page
    /// at a time.
    async fn find(&self, q: &[(String, String)], store: &GatewayStore) -> Answer {
        let Some(id) = param(q, "id") else {
            return error(StatusCode::BAD_REQUEST, "`id` is needed");
        };
        let Some(journal) = self.journal.get() else {
            return error(
                StatusCode::CONFLICT,
                "the journal is off (--journal): inspect the stored key instead",
            );
        };
        let (limit, cursor) = match paging(q) {
            Ok(p) => p,
            Err(e) => return error(StatusCode::BAD_REQUEST, &e),
        };
        let mut filter = JournalFilter::default()
            .key_suffix(format!(":{id}"))
            .max_records(limit)
            .scan(KEYS_SCAN);
        if let Some(route) = param(q, "route") {
            filter = filter.route(route);
        }
        if let Some(cursor) = cursor {
            filter = filter.after(cursor);
        }
        let page = match journal.page(&filter).await {
            Ok(p) => p,
            Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
        };
        let preset = param(q, "preset");
        let mut matches = Vec::new();
        for record in (page.records.iter()).filter(|r| preset.is_none_or(|p| r.preset == p)) {
            let state = match self.state(&record.key, store).await {
                Ok(v) => v,
                Err(res) => return res,
            };
            matches.push(
                json!({ "key": record.key, "record": state, "journal": journal_json(record) }),
            );
        }
        let next = page.next.map(|c| c.to_string());
        json_answer(
            StatusCode::OK,
            &json!({ "matches": matches, "next_cursor": next }),
        )
    }

    async fn forget(&self, key: &str, who: &str, store: &GatewayStore) -> Answer {
        // The queue's marker first (acknowledge-then-deliver routes): while
        // it stays, the next copy would be answered "already queued" and
        // never delivered. An entry still queued keeps everything.
        let queued = match self.forget_queued(key).await {
            Ok(queued) => queued,
            Err(e) => {
                warn!(key = %redact(key), error = %e, "admin: the queue did not forget the key");
                let message = format!("the queue did not forget the key: {e}");
                return error(StatusCode::SERVICE_UNAVAILABLE, &message);
            }
        };
        let store = self.store_of(key, store);
        // The notification's record, then each destination's delivery's:
        // its next copy is delivered to every destination again.
        let mut done = Forgotten::Absent;
        let stored = (self.delivery_keys(key).into_iter()).map(|(_, k)| k);
        for stored in std::iter::once(key.to_owned()).chain(stored) {
            let one = match tokio::time::timeout(STORE_TIMEOUT, store.forget(&stored)).await {
                Ok(Ok(one)) => one,
                Ok(Err(e)) => {
                    warn!(error = %e, "admin: forget failed");
                    return error(StatusCode::SERVICE_UNAVAILABLE, "the store failed");
                }
                Err(_) => {
                    return error(StatusCode::SERVICE_UNAVAILABLE, "the store did not answer")
                }
            };
            done = match (done, one) {
                (Forgotten::InFlight, _) | (_, Forgotten::InFlight) => Forgotten::InFlight,
                (Forgotten::Deleted, _) | (_, Forgotten::Deleted) => Forgotten::Deleted,
                (_, one) => one,
            };
        }
        // The record had gone (its window ended) but the queue remembered
        // the key: forgotten there, the next copy runs again too.
        let done = match done {
            Forgotten::Absent if queued => Forgotten::Deleted,
            done => done,
        };
        let (status, word) = match done {
            Forgotten::Deleted => (StatusCode::OK, "deleted"),
            Forgotten::Absent => (StatusCode::NOT_FOUND, "absent"),
            Forgotten::InFlight => (StatusCode::CONFLICT, "in_flight"),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "unknown"),
        };
        if done == Forgotten::Deleted {
            let at = humantime::format_rfc3339_millis(SystemTime::now());
            info!(key = %redact(key), by = who, "admin: record forgotten; the next copy runs again");
            if let Some(journal) = self.journal.get() {
                let note = format!("forgotten by {who} at {at}");
                let event = JournalEvent::new(key, "", "", JournalOutcome::Forgotten).note(note);
                journal.record(event);
                journal.flush().await;
            }
        }
        json_answer(status, &json!({ "key": key, "forgotten": word }))
    }
}
