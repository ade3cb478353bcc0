//! The admin API on `--admin-listen`, on only with `--admin-token-file`:
//! inspect and forget a key, read the journal. Every call needs
//! `Authorization: Bearer TOKEN`, checked in constant time. Described in
//! `deploy/openapi/admin.json`.
//!
//! An axum [`Router`]: `GET /admin/journal`, `GET /admin/keys`, and `GET` or
//! `DELETE` on `/admin/keys/{key}` (the key is the rest of the path,
//! percent-decoded once). Every other call answers as the API always has,
//! with a JSON body: a path that is no call is 404 for `GET` and `DELETE`,
//! any other method 405 (with no `Allow` header: `HEAD` included, which
//! axum would otherwise route to the `GET` handler). The keys' calls are
//! in `keys`, the journal's in `journal`, the dead letters' in `dead`, the
//! routes' (pause, resume) and the console's statistics in `routes`.

mod dead;
mod journal;
mod keys;
mod routes;

use crate::start::ack::GatewayQueue;
use crate::start::pauses::PauseKeeper;
use crate::start::store::GatewayStore;
use axum::extract::{FromRequestParts, Query, Request, State};
use axum::middleware::{self, Next};
use axum::routing::any;
use axum::Router;
use dead::{dead_delete, dead_list, dead_replay, dead_replay_all, dead_show};
use http::request::Parts;
use http::{header, HeaderMap, HeaderValue, Method, Response, StatusCode};
use idempotency_gateway::journal::{Journal, JournalCursor, JournalRecord};
use journal::journal;
use keys::{find, forget, inspect, other_key_call};
use routes::{route_pause, route_resume, routes_list, stats};
use serde_json::{json, Value};
use std::path::Path as FilePath;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, UNIX_EPOCH};
use subtle::ConstantTimeEq;
use tower_idempotency::Preset;

/// The longest an admin call waits for the store.
const STORE_TIMEOUT: Duration = Duration::from_secs(5);
/// Records (or matches) per page unless `limit` says otherwise.
const DEFAULT_LIMIT: usize = 100;
/// The most records (or matches) one page holds.
pub(crate) const MAX_LIMIT: usize = 1000;
/// `limit` of a paged call: [`DEFAULT_LIMIT`] when absent.
fn limit(q: &[(String, String)]) -> Result<usize, String> {
    match param(q, "limit") {
        None => Ok(DEFAULT_LIMIT),
        Some(n) => match n.parse::<usize>() {
            Ok(n) if (1..=MAX_LIMIT).contains(&n) => Ok(n),
            _ => Err(format!("`limit` is a number from 1 to {MAX_LIMIT}")),
        },
    }
}

/// `limit` and `cursor` of a paged call on the journal.
fn paging(q: &[(String, String)]) -> Result<(usize, Option<JournalCursor>), String> {
    let limit = limit(q)?;
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
pub(crate) fn read_token(path: &FilePath) -> Result<String, String> {
    crate::private::check_secret_file(path, "admin token file")?;
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
pub(crate) type PickStore = dyn Fn(&str, &Preset) -> GatewayStore + Send + Sync;

/// The admin API's state: its token, the journal once it is open, the
/// routes' own stores when each route has one (the memory store), and the
/// queue of the acknowledge-then-deliver routes.
#[derive(Clone)]
pub(crate) struct Admin {
    token: Arc<str>,
    journal: Arc<OnceLock<Journal>>,
    stores: Arc<OnceLock<Arc<PickStore>>>,
    queue: Arc<OnceLock<GatewayQueue>>,
    /// The key the queue's entries are sealed with: a replay seals afresh.
    pub(crate) queue_key: Arc<OnceLock<tower_idempotency_queue::QueueKey>>,
    routes: Arc<OnceLock<Routes>>,
    samples: Arc<OnceLock<crate::admin::samples::Samples>>,
}

/// A configured route, for `GET /admin/routes`.
#[derive(Debug, Clone)]
pub(crate) struct RouteInfo {
    /// Its prefix.
    pub(crate) prefix: String,
    /// Its preset's name, or `auto`.
    pub(crate) preset: String,
    /// Whether it acknowledges then delivers.
    pub(crate) acked: bool,
    /// The named upstream it sends to (`[[upstreams]]`), if not the
    /// default one.
    pub(crate) upstream: Option<String>,
    /// The named upstreams it delivers each notification to (`deliver`).
    pub(crate) destinations: Vec<String>,
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
pub(crate) fn not_found() -> Answer {
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
pub(crate) fn parse_time(s: &str) -> Result<u64, String> {
    if let Ok(ms) = s.parse::<u64>() {
        return Ok(ms);
    }
    let at = humantime::parse_rfc3339_weak(s)
        .map_err(|e| format!("`{s}`: expected RFC 3339 or milliseconds since the epoch: {e}"))?;
    Ok(crate::admin::dead::ms_of(at))
}

fn journal_json(record: &JournalRecord) -> Value {
    let mut v = serde_json::to_value(record).unwrap_or(Value::Null);
    v["first_seen"] = json!(rfc3339(record.first_seen_ms));
    v["last_seen"] = json!(rfc3339(record.last_seen_ms));
    v
}

fn param<'a>(q: &'a [(String, String)], name: &str) -> Option<&'a str> {
    q.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

impl Admin {
    /// The API with this bearer token.
    pub(crate) fn new(token: String) -> Self {
        Self {
            token: token.into(),
            journal: Arc::default(),
            stores: Arc::default(),
            queue: Arc::default(),
            queue_key: Arc::default(),
            routes: Arc::default(),
            samples: Arc::default(),
        }
    }

    /// The request counters sampled for `GET /admin/stats`.
    pub(crate) fn set_samples(&self, samples: crate::admin::samples::Samples) {
        let _ = self.samples.set(samples);
    }

    /// The configured routes (for `GET /admin/routes`) and their pauses.
    pub(crate) fn set_routes(&self, keeper: PauseKeeper, list: Vec<RouteInfo>, upstream: String) {
        let _ = self.routes.set(Routes {
            keeper,
            list,
            upstream,
        });
    }

    /// The queue whose key markers `forget` clears too.
    pub(crate) fn set_queue(&self, queue: GatewayQueue) {
        let _ = self.queue.set(queue);
    }

    /// The key the queue's entries are sealed with.
    pub(crate) fn set_queue_key(&self, key: tower_idempotency_queue::QueueKey) {
        let _ = self.queue_key.set(key);
    }

    /// The routes' own stores: a key is looked up in its route's.
    pub(crate) fn set_stores(&self, pick: Arc<PickStore>) {
        let _ = self.stores.set(pick);
    }

    /// The journal the API reads (once it is open).
    pub(crate) fn set_journal(&self, journal: Journal) {
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
    pub(crate) fn router(&self, store: GatewayStore) -> Router {
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
