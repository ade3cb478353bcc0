//! The admin API on `--metrics-listen`, on only with `--admin-token-file`:
//! inspect and forget a key, read the journal. Every call needs
//! `Authorization: Bearer TOKEN`, checked in constant time. Described in
//! `deploy/openapi/admin.json`.
//!
//! An axum [`Router`]: `GET /admin/journal`, `GET /admin/keys`, and `GET` or
//! `DELETE` on `/admin/keys/{key}` (the key is the rest of the path,
//! percent-decoded once). Every other call answers as the API always has,
//! with a JSON body: a path that is no call is 404 for `GET` and `DELETE`,
//! any other method 405 (with no `Allow` header: `HEAD` included, which
//! axum would otherwise route to the `GET` handler). The dead letters'
//! calls are in `dead`, the routes' (pause, resume) and the console's
//! statistics in `routes`.

mod dead;
mod routes;

use crate::ack::GatewayQueue;
use crate::pauses::PauseKeeper;
use crate::store::GatewayStore;
use axum::extract::{FromRequestParts, Path, Query, Request, State};
use axum::middleware::{self, Next};
use axum::routing::any;
use axum::Router;
use dead::{dead_delete, dead_list, dead_replay, dead_replay_all, dead_show};
use http::request::Parts;
use http::{header, HeaderMap, HeaderValue, Method, Response, StatusCode};
use idempotency_gateway::journal::{
    Journal, JournalCursor, JournalEvent, JournalFilter, JournalOutcome, JournalRecord,
};
use idempotency_gateway::proxy::queued_keys;
use routes::{route_pause, route_resume, routes_list, stats};
use serde_json::{json, Value};
use std::path::Path as FilePath;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use subtle::ConstantTimeEq;
use tower_idempotency::store::{Forgotten, RecordState, Store};
use tower_idempotency::Preset;
use tower_idempotency_queue::Queue;
use tracing::{info, warn};

/// The longest an admin call waits for the store.
const STORE_TIMEOUT: Duration = Duration::from_secs(5);
/// Records (or matches) per page unless `limit` says otherwise.
const DEFAULT_LIMIT: usize = 100;
/// The most records (or matches) one page holds.
pub const MAX_LIMIT: usize = 1000;
/// Records `/admin/keys?id=` looks at per page: past it the page ends
/// with a cursor, so that a search of a large journal answers in bounded time.
const KEYS_SCAN: usize = 10_000;

/// `limit` and `cursor` of a paged call.
fn paging(q: &[(String, String)]) -> Result<(usize, Option<JournalCursor>), String> {
    let limit = match param(q, "limit") {
        None => DEFAULT_LIMIT,
        Some(n) => match n.parse::<usize>() {
            Ok(n) if (1..=MAX_LIMIT).contains(&n) => n,
            _ => return Err(format!("`limit` is a number from 1 to {MAX_LIMIT}")),
        },
    };
    let cursor = match param(q, "cursor") {
        None | Some("") => None,
        Some(c) => Some(
            c.parse()
                .map_err(|_| "`cursor` is not one this API gave".to_owned())?,
        ),
    };
    Ok((limit, cursor))
}

/// Reads the bearer token from `path`: its first line, which must not be
/// empty; a file that its group or others can read is refused (as ssh
/// refuses such a key).
pub fn read_token(path: &FilePath) -> Result<String, String> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let meta = std::fs::metadata(path)
            .map_err(|e| format!("cannot read the admin token file {}: {e}", path.display()))?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(format!(
                "permissions {mode:04o} for the admin token file {} are too open: \
                 it must not be accessible by others (chmod 600 it)",
                path.display()
            ));
        }
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the admin token file {}: {e}", path.display()))?;
    let token = text.lines().next().unwrap_or_default().trim().to_owned();
    if token.len() < 16 {
        return Err(format!(
            "the admin token in {} is shorter than 16 characters",
            path.display()
        ));
    }
    Ok(token)
}

/// Picks the store of a route's records for one of its presets.
pub type PickStore = dyn Fn(&str, &Preset) -> GatewayStore + Send + Sync;

/// The admin API's state: its token, the journal once it is open, the
/// routes' own stores when each route has one (the memory store), and the
/// queue of the acknowledge-then-deliver routes.
#[derive(Clone)]
pub struct Admin {
    token: Arc<str>,
    journal: Arc<OnceLock<Journal>>,
    stores: Arc<OnceLock<Arc<PickStore>>>,
    queue: Arc<OnceLock<GatewayQueue>>,
    routes: Arc<OnceLock<Routes>>,
    samples: Arc<OnceLock<crate::samples::Samples>>,
}

/// A configured route, for `GET /admin/routes`.
#[derive(Debug, Clone)]
pub struct RouteInfo {
    /// Its prefix.
    pub prefix: String,
    /// Its preset's name, or `auto`.
    pub preset: String,
    /// Whether it acknowledges then delivers.
    pub acked: bool,
}

/// The routes and where their pauses are kept.
struct Routes {
    keeper: PauseKeeper,
    list: Vec<RouteInfo>,
    upstream: String,
}

type Answer = Response<axum::body::Body>;

fn json_answer(status: StatusCode, body: &Value) -> Answer {
    let mut res = Response::new(axum::body::Body::from(body.to_string() + "\n"));
    *res.status_mut() = status;
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    res
}

fn error(status: StatusCode, message: &str) -> Answer {
    json_answer(status, &json!({ "error": message }))
}

/// `/admin/...` while the admin API is off.
pub fn not_found() -> Answer {
    error(
        StatusCode::NOT_FOUND,
        "the admin API is off (start the gateway with --admin-token-file)",
    )
}

/// Milliseconds since the epoch as RFC 3339.
fn rfc3339(ms: u64) -> String {
    let at = UNIX_EPOCH + Duration::from_millis(ms);
    humantime::format_rfc3339_millis(at).to_string()
}

/// A time given as RFC 3339 (`2026-12-01T02:14:00Z`) or milliseconds since
/// the epoch.
pub fn parse_time(s: &str) -> Result<u64, String> {
    if let Ok(ms) = s.parse::<u64>() {
        return Ok(ms);
    }
    let at = humantime::parse_rfc3339_weak(s)
        .map_err(|e| format!("`{s}`: expected RFC 3339 or milliseconds since the epoch: {e}"))?;
    let ms = at
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis();
    Ok(u64::try_from(ms).unwrap_or(u64::MAX))
}

fn journal_json(record: &JournalRecord) -> Value {
    let mut v = serde_json::to_value(record).unwrap_or(Value::Null);
    v["first_seen"] = json!(rfc3339(record.first_seen_ms));
    v["last_seen"] = json!(rfc3339(record.last_seen_ms));
    v
}

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

fn param<'a>(q: &'a [(String, String)], name: &str) -> Option<&'a str> {
    q.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

impl Admin {
    /// The API with this bearer token.
    pub fn new(token: String) -> Self {
        Self {
            token: token.into(),
            journal: Arc::default(),
            stores: Arc::default(),
            queue: Arc::default(),
            routes: Arc::default(),
            samples: Arc::default(),
        }
    }

    /// The request counters sampled for `GET /admin/stats`.
    pub fn set_samples(&self, samples: crate::samples::Samples) {
        let _ = self.samples.set(samples);
    }

    /// The configured routes (for `GET /admin/routes`) and their pauses.
    pub fn set_routes(&self, keeper: PauseKeeper, list: Vec<RouteInfo>, upstream: String) {
        let _ = self.routes.set(Routes {
            keeper,
            list,
            upstream,
        });
    }

    /// The queue whose key markers `forget` clears too.
    pub fn set_queue(&self, queue: GatewayQueue) {
        let _ = self.queue.set(queue);
    }

    /// Forgets `key` (and its copies) in the queue, if there is one: whether
    /// a marker of a delivered key was forgotten. An error while an entry of
    /// the key is still queued, or when the queue fails.
    async fn forget_queued(&self, key: &str) -> Result<bool, String> {
        let Some(queue) = self.queue.get() else {
            return Ok(false);
        };
        let mut forgot = false;
        for queued in queued_keys(key) {
            match tokio::time::timeout(STORE_TIMEOUT, queue.forget(&queued)).await {
                Ok(Ok(done)) => forgot |= done,
                Ok(Err(e)) => return Err(e.to_string()),
                Err(_) => return Err("the queue did not answer".into()),
            }
        }
        Ok(forgot)
    }

    /// The routes' own stores: a key is looked up in its route's.
    pub fn set_stores(&self, pick: Arc<PickStore>) {
        let _ = self.stores.set(pick);
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

    /// The journal the API reads (once it is open).
    pub fn set_journal(&self, journal: Journal) {
        let _ = self.journal.set(journal);
    }

    fn authorized(&self, headers: &HeaderMap) -> bool {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or_default();
        // Constant time in the token's content (its length is not secret).
        bool::from(given.as_bytes().ct_eq(self.token.as_bytes()))
    }

    /// The API's routes, for every path under `/admin/`; `store` is the
    /// one store, or the store of keys no route's own store holds.
    pub fn router(&self, store: GatewayStore) -> Router {
        // Each route starts from `any(..)`, its fallback for the methods no
        // call takes: a method router built from `get(..)` would add an
        // `Allow` header to those answers, which the API never sent. `HEAD`
        // is no call: without a handler of its own, axum would run the
        // `GET` one.
        let key = any(other_key_call)
            .get(inspect)
            .delete(forget)
            .head(other_key_call);
        Router::new()
            .route(
                "/admin/journal",
                any(other_call).get(journal).head(other_call),
            )
            .route("/admin/keys", any(other_call).get(find).head(other_call))
            .route(
                "/admin/dead",
                any(other_call).get(dead_list).head(other_call),
            )
            .route("/admin/dead/replay", any(other_call).post(dead_replay_all))
            .route(
                "/admin/dead/{id}",
                any(other_call)
                    .get(dead_show)
                    .delete(dead_delete)
                    .head(other_call),
            )
            .route("/admin/dead/{id}/replay", any(other_call).post(dead_replay))
            .route(
                "/admin/routes",
                any(other_call).get(routes_list).head(other_call),
            )
            .route("/admin/stats", any(other_call).get(stats).head(other_call))
            .route("/admin/routes/pause", any(other_call).post(route_pause))
            .route("/admin/routes/resume", any(other_call).post(route_resume))
            // `{*key}` needs one character at least: the empty key is its own.
            .route("/admin/keys/", key.clone())
            .route("/admin/keys/{*key}", key)
            .fallback(other_call)
            // Around the fallback too: no call is answered without the token.
            .layer(middleware::from_fn_with_state(self.clone(), authorize))
            .with_state(Calls {
                admin: self.clone(),
                store,
            })
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
        json_answer(
            StatusCode::OK,
            &json!({ "key": key, "record": record, "journal": journal }),
        )
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
        let done = match tokio::time::timeout(STORE_TIMEOUT, store.forget(key)).await {
            Ok(Ok(done)) => done,
            Ok(Err(e)) => {
                warn!(error = %e, "admin: forget failed");
                return error(StatusCode::SERVICE_UNAVAILABLE, "the store failed");
            }
            Err(_) => return error(StatusCode::SERVICE_UNAVAILABLE, "the store did not answer"),
        };
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

    /// `?[since=T][&until=T][&route=R][&outcome=O][&limit=N][&cursor=C]`:
    /// a page of records, oldest last copy first.
    async fn journal(&self, q: &[(String, String)]) -> Answer {
        let Some(journal) = self.journal.get() else {
            return error(StatusCode::CONFLICT, "the journal is off (--journal)");
        };
        let (limit, cursor) = match paging(q) {
            Ok(p) => p,
            Err(e) => return error(StatusCode::BAD_REQUEST, &e),
        };
        let mut filter = JournalFilter::default().max_records(limit);
        if let Some(cursor) = cursor {
            filter = filter.after(cursor);
        }
        for (name, value) in q {
            filter = match name.as_str() {
                "since" | "until" => match parse_time(value) {
                    Ok(ms) if name == "since" => filter.since_ms(ms),
                    Ok(ms) => filter.until_ms(ms),
                    Err(e) => return error(StatusCode::BAD_REQUEST, &e),
                },
                "route" => filter.route(value.as_str()),
                "outcome" => filter.outcome(value.as_str()),
                "limit" | "cursor" => filter,
                other => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        &format!("unknown parameter `{other}`"),
                    )
                }
            };
        }
        match journal.page(&filter).await {
            Ok(page) => {
                let records: Vec<Value> = page.records.iter().map(journal_json).collect();
                let next = page.next.map(|c| c.to_string());
                json_answer(
                    StatusCode::OK,
                    &json!({ "records": records, "dropped": journal.dropped(), "next_cursor": next }),
                )
            }
            Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
        }
    }
}

/// A stored key for the log: its hash, never its text.
fn redact(key: &str) -> String {
    let hash = tower_idempotency::Fingerprint::of(key.as_bytes());
    format!("{hash:?}")
}

/// What the handlers share: the API, and the store of keys no route's own
/// store holds.
#[derive(Clone)]
struct Calls {
    admin: Admin,
    store: GatewayStore,
}

/// Every call: 401 without the token; then what the journal was given
/// before the call is written, so that the call reads it.
async fn authorize(State(admin): State<Admin>, req: Request, next: Next) -> Answer {
    if !admin.authorized(req.headers()) {
        let mut res = error(StatusCode::UNAUTHORIZED, "a valid bearer token is needed");
        res.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"gateway admin\""),
        );
        return res;
    }
    if let Some(journal) = admin.journal.get() {
        journal.flush().await;
    }
    next.run(req).await
}

/// A path that is no call (404 for `GET` and `DELETE`), or a method no
/// call takes (405).
async fn other_call(method: Method) -> Answer {
    if matches!(method, Method::GET | Method::DELETE) {
        error(StatusCode::NOT_FOUND, "no such admin call")
    } else {
        error(
            StatusCode::METHOD_NOT_ALLOWED,
            "use GET, or DELETE on a key",
        )
    }
}

/// Another method on a key: 405, once the key is known to be UTF-8 (400).
async fn other_key_call(method: Method, _: Key) -> Answer {
    other_call(method).await
}

/// The key of a `/admin/keys/{key}` call: the rest of the path,
/// percent-decoded once (a `%` that starts no escape is kept as it is),
/// empty on `/admin/keys/`; 400 when it decodes to bytes that are not UTF-8.
struct Key(String);

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

/// The query string's `name=value` pairs, form-decoded, in their order.
struct Pairs(Vec<(String, String)>);

impl<S: Send + Sync> FromRequestParts<S> for Pairs {
    type Rejection = Answer;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Answer> {
        // Form decoding takes any string (bytes that are not UTF-8 are
        // replaced), so this is never refused.
        match <Query<Vec<(String, String)>>>::from_request_parts(parts, state).await {
            Ok(Query(pairs)) => Ok(Self(pairs)),
            Err(e) => Err(error(StatusCode::BAD_REQUEST, &e.body_text())),
        }
    }
}

async fn inspect(State(calls): State<Calls>, Key(key): Key) -> Answer {
    calls.admin.inspect(&key, &calls.store).await
}

async fn forget(State(calls): State<Calls>, Key(key): Key, Pairs(q): Pairs) -> Answer {
    let who = param(&q, "by").unwrap_or("admin API");
    calls.admin.forget(&key, who, &calls.store).await
}

async fn find(State(calls): State<Calls>, Pairs(q): Pairs) -> Answer {
    calls.admin.find(&q, &calls.store).await
}

async fn journal(State(calls): State<Calls>, Pairs(q): Pairs) -> Answer {
    calls.admin.journal(&q).await
}
