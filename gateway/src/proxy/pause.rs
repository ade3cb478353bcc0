//! [`Pauses`]: which routes are held. A paused route sends nothing to its
//! upstream: its forwarder answers `503 Service Unavailable` with
//! `Retry-After` itself (counted as shed), so that a channel route answers
//! its retryable failure reply to new copies while copies of a completed
//! key are still replayed from the store, a client-API route and the
//! unguarded requests under the prefix get the 503, and an
//! acknowledge-then-deliver route keeps queueing while its deliveries are
//! held, not counted as attempts, until it resumes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

/// Who paused a route, when and why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct PauseInfo {
    /// When it was paused, in milliseconds since the epoch.
    pub since_ms: u64,
    /// Who paused it.
    pub by: String,
    /// Why.
    pub reason: String,
}

impl PauseInfo {
    /// Paused at `since_ms` (milliseconds since the epoch) by `by`, for
    /// `reason`.
    pub fn new(since_ms: u64, by: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            since_ms,
            by: by.into(),
            reason: reason.into(),
        }
    }
}

/// The routes paused now, shared by a [`Gateway`](super::Gateway) and
/// whoever pauses and resumes them (cheap to clone: the clones share one
/// registry). Give it to
/// [`GatewayBuilder::pauses`](super::GatewayBuilder::pauses).
///
/// ```
/// use idempotency_gateway::proxy::{PauseInfo, Pauses};
///
/// let pauses = Pauses::new();
/// let info = PauseInfo::new(0, "ops", "deploy");
/// pauses.set("/notify/wechat/", Some(info));
/// assert!(pauses.is_paused("/notify/wechat"));
/// assert!(pauses.covers("/notify/wechat/v3"));
/// assert!(!pauses.covers("/notify/wechatx"));
/// assert_eq!(pauses.covering("/notify/wechat/v3").as_deref(), Some("/notify/wechat"));
/// pauses.set("/notify/wechat", None);
/// assert!(!pauses.is_paused("/notify/wechat"));
/// ```
#[derive(Debug, Clone, Default)]
pub struct Pauses {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// One flag per prefix a gate was asked for (the routes), read on
    /// every upstream call.
    gates: RwLock<HashMap<String, Arc<AtomicBool>>>,
    /// The paused prefixes and why.
    paused: RwLock<HashMap<String, PauseInfo>>,
    /// Set until the paused routes are first read (see
    /// [`Pauses::hold_deliveries_until_read`]).
    unread: AtomicBool,
}

/// A prefix in the form pauses are kept under: normal form, no trailing
/// `/`, ASCII lower case (routes match regardless of case).
pub fn pause_key(prefix: &str) -> String {
    let normal = super::path::normalize(prefix);
    let trimmed = normal.trim_end_matches('/');
    let decoded = super::path::decoded(trimmed);
    decoded.to_ascii_lowercase()
}

impl Pauses {
    /// No route paused.
    pub fn new() -> Self {
        Self::default()
    }

    /// Pauses (`Some`) or resumes (`None`) the route `prefix`.
    pub fn set(&self, prefix: &str, info: Option<PauseInfo>) {
        let key = pause_key(prefix);
        let on = info.is_some();
        {
            let mut paused = self.inner.paused.write().unwrap_or_else(|p| p.into_inner());
            match info {
                Some(info) => paused.insert(key.clone(), info),
                None => paused.remove(&key),
            };
        }
        self.flag(&key).store(on, Ordering::SeqCst);
    }

    /// Until the paused routes are first read ([`replace_all`](Self::replace_all)),
    /// every queued delivery through a gateway of these pauses is held (its
    /// entry waits, not counted as an attempt), and [`is_read`](Self::is_read)
    /// says `false`: a route paused where pauses are kept, not read yet,
    /// must not be delivered to (nor its parked entries woken).
    pub fn hold_deliveries_until_read(&self) {
        self.inner.unread.store(true, Ordering::SeqCst);
    }

    /// Whether the paused routes were read (always, unless
    /// [`hold_deliveries_until_read`](Self::hold_deliveries_until_read) was
    /// called and no read came since).
    pub fn is_read(&self) -> bool {
        !self.inner.unread.load(Ordering::SeqCst)
    }

    /// Makes the paused routes exactly `all` (as read from where pauses
    /// are kept).
    pub fn replace_all(&self, all: HashMap<String, PauseInfo>) {
        let all: HashMap<String, PauseInfo> =
            all.into_iter().map(|(k, v)| (pause_key(&k), v)).collect();
        let gone: Vec<String> = {
            let paused = self.inner.paused.read().unwrap_or_else(|p| p.into_inner());
            (paused.keys())
                .filter(|k| !all.contains_key(*k))
                .cloned()
                .collect()
        };
        for k in gone {
            self.set(&k, None);
        }
        for (k, v) in all {
            if self.get(&k).as_ref() != Some(&v) {
                self.set(&k, Some(v));
            }
        }
        self.inner.unread.store(false, Ordering::SeqCst);
    }

    /// Why `prefix` is paused, if it is.
    pub fn get(&self, prefix: &str) -> Option<PauseInfo> {
        let paused = self.inner.paused.read().unwrap_or_else(|p| p.into_inner());
        paused.get(&pause_key(prefix)).cloned()
    }

    /// Every paused prefix.
    pub fn all(&self) -> HashMap<String, PauseInfo> {
        let paused = self.inner.paused.read().unwrap_or_else(|p| p.into_inner());
        paused.clone()
    }

    /// Whether the route `prefix` is paused.
    pub fn is_paused(&self, prefix: &str) -> bool {
        self.get(prefix).is_some()
    }

    /// Whether `path` is under a paused prefix.
    pub fn covers(&self, path: &str) -> bool {
        let paused = self.inner.paused.read().unwrap_or_else(|p| p.into_inner());
        if paused.is_empty() {
            return false;
        }
        let path = pause_key(path);
        paused.keys().any(|p| {
            p.is_empty()
                || path == *p
                || path
                    .strip_prefix(p.as_str())
                    .is_some_and(|r| r.starts_with('/'))
        })
    }

    /// The paused prefix `path` is under (the longest, in the form pauses
    /// are kept under), if it is under one.
    pub fn covering(&self, path: &str) -> Option<String> {
        let paused = self.inner.paused.read().unwrap_or_else(|p| p.into_inner());
        if paused.is_empty() {
            return None;
        }
        let path = pause_key(path);
        (paused.keys())
            .filter(|p| {
                p.is_empty()
                    || path == **p
                    || path
                        .strip_prefix(p.as_str())
                        .is_some_and(|r| r.starts_with('/'))
            })
            .max_by_key(|p| p.len())
            .cloned()
    }

    fn flag(&self, key: &str) -> Arc<AtomicBool> {
        if let Some(f) = (self.inner.gates.read().unwrap_or_else(|p| p.into_inner())).get(key) {
            return f.clone();
        }
        let mut gates = self.inner.gates.write().unwrap_or_else(|p| p.into_inner());
        gates.entry(key.to_owned()).or_default().clone()
    }

    /// The gate of the route `prefix`.
    pub(crate) fn gate(&self, prefix: &str) -> PauseGate {
        let key = pause_key(prefix);
        let flag = self.flag(&key);
        flag.store(self.is_paused(&key), Ordering::SeqCst);
        PauseGate::Route(flag, self.clone())
    }

    /// The gate of the unguarded requests: held under any paused prefix.
    pub(crate) fn paths(&self) -> PauseGate {
        PauseGate::Paths(self.clone())
    }
}

/// What a forwarder asks before each call.
#[derive(Debug, Clone)]
pub(crate) enum PauseGate {
    /// One route's flag, and the registry it is of.
    Route(Arc<AtomicBool>, Pauses),
    /// By path, for the unguarded requests.
    Paths(Pauses),
}

impl PauseGate {
    pub(crate) fn holds(&self, path: &str) -> bool {
        match self {
            Self::Route(flag, _) => flag.load(Ordering::Relaxed),
            Self::Paths(pauses) => pauses.covers(path),
        }
    }

    /// Whether a queued delivery to `path` is held: paused, or the paused
    /// routes not read yet.
    pub(crate) fn holds_delivery(&self, path: &str) -> bool {
        let read = match self {
            Self::Route(_, pauses) | Self::Paths(pauses) => pauses.is_read(),
        };
        !read || self.holds(path)
    }
}
