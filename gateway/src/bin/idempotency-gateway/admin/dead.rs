//! The dead letters through the admin API, for every queue while the
//! gateway runs: `GET /admin/dead` (a page, with filters), `GET
//! /admin/dead/{id}`, `POST /admin/dead/{id}/replay`, `POST
//! /admin/dead/replay` (the filtered set, or a dry run counting it) and
//! `DELETE /admin/dead/{id}` (journaled, and the key's queue marker
//! forgotten so that a later copy is queued again).

use crate::start::ack::GatewayQueue;
use base64::Engine as _;
use serde_json::{json, Value};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tower_idempotency_queue::{original_key, DeadLetter, EntryId, Queue, QueueError, QueueKey};

/// Dead letters one page of `GET /admin/dead` looks at: past it the page
/// ends with a cursor, so that a filtered list answers in bounded time.
const SCAN: usize = 10_000;
/// Dead letters the queue is asked for at a time.
const BATCH: usize = 500;
/// Dead letters a bulk replay looks at, at most.
pub(crate) const BULK: usize = 1_000_000;
/// The longest one queue call of the API waits.
const QUEUE_TIMEOUT: Duration = Duration::from_secs(30);

/// Which dead letters a list or a bulk replay selects.
#[derive(Debug, Clone, Default)]
pub(crate) struct DeadFilter {
    since_ms: Option<u64>,
    until_ms: Option<u64>,
    route: Option<String>,
    destination: Option<String>,
    error: Option<String>,
}

impl DeadFilter {
    /// The filters of the query `q` (`since`, `until`, `route`,
    /// `destination`, `error`);
    /// `extra` are the other parameters the call takes. An unknown
    /// parameter is an error.
    pub(crate) fn parse(q: &[(String, String)], extra: &[&str]) -> Result<Self, String> {
        let mut f = Self::default();
        for (name, value) in q {
            match name.as_str() {
                "since" => f.since_ms = Some(crate::admin::api::parse_time(value)?),
                "until" => f.until_ms = Some(crate::admin::api::parse_time(value)?),
                "route" => f.route = Some(value.clone()),
                "destination" => f.destination = Some(value.clone()),
                "error" => f.error = Some(value.clone()),
                other if extra.contains(&other) => {}
                other => return Err(format!("unknown parameter `{other}`")),
            }
        }
        Ok(f)
    }

    fn matches(&self, d: &DeadLetter) -> bool {
        let at = ms_of(d.dead_at);
        self.since_ms.is_none_or(|s| at >= s)
            && self.until_ms.is_none_or(|u| at <= u)
            && (self.route.as_deref()).is_none_or(|r| under(d.message.uri.path(), r))
            && (self.destination.as_deref())
                .is_none_or(|w| d.message.destination.as_deref() == Some(w))
            && (self.error.as_deref()).is_none_or(|e| d.error.contains(e))
    }
}

/// Whether `path` is `prefix` or below it (`/notify` covers `/notify/x`,
/// not `/notifyx`).
pub(crate) fn under(path: &str, prefix: &str) -> bool {
    let prefix = prefix.trim_end_matches('/');
    prefix.is_empty()
        || path == prefix
        || path
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with('/'))
}

/// Milliseconds since the epoch (0 before it).
pub(crate) fn ms_of(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// `t` in RFC 3339, held within what it can write (the epoch to the end of
/// year 9999): a time read from a broker's header is anyone's, and a
/// formatter's error would be a panic here.
fn rfc3339(t: SystemTime) -> String {
    let latest = UNIX_EPOCH + std::time::Duration::from_millis(253_402_300_799_999);
    humantime::format_rfc3339_millis(t.clamp(UNIX_EPOCH, latest)).to_string()
}

/// A dead letter's line in a list.
pub(crate) fn summary(d: &DeadLetter) -> Value {
    json!({
        "id": d.id.as_str(),
        "key": d.message.key,
        "method": d.message.method.as_str(),
        "path": d.message.uri.path(),
        "attempts": d.attempts,
        "error": d.error,
        "dead_at": rfc3339(d.dead_at),
        "dead_at_ms": ms_of(d.dead_at),
        "body_bytes": d.message.body.len(),
        "destination": d.message.destination,
    })
}

/// A dead letter in full: its failed attempts the queue kept (each with its
/// number, time and error; the first and the latest), how many others it
/// made, the request's headers and its body as base64.
pub(crate) fn detail(d: &DeadLetter) -> Value {
    let mut v = summary(d);
    let headers: Vec<Value> = (d.message.headers.iter())
        .map(|(name, value)| {
            json!({
                "name": name.as_str(),
                "value": String::from_utf8_lossy(value.as_bytes()),
            })
        })
        .collect();
    let attempts: Vec<Value> = (d.history.iter())
        .map(|a| {
            json!({
                "attempt": a.number,
                "error": a.error,
                "at": rfc3339(a.at),
            })
        })
        .collect();
    v["uri"] = json!(d.message.uri.to_string());
    v["attempt_errors"] = Value::Array(attempts);
    v["attempts_not_kept"] = json!(d.attempts_not_kept);
    v["headers"] = Value::Array(headers);
    v["body_base64"] = json!(base64::engine::general_purpose::STANDARD.encode(&d.message.body));
    v
}

/// A queue call bounded by [`QUEUE_TIMEOUT`], its error as text.
async fn bounded<T>(
    call: impl std::future::Future<Output = Result<T, tower_idempotency_queue::QueueError>>,
) -> Result<T, String> {
    match tokio::time::timeout(QUEUE_TIMEOUT, call).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("the queue failed: {e}")),
        Err(_) => Err("the queue did not answer".into()),
    }
}

/// A page of the dead letters `filter` selects, at most `limit`, after
/// `cursor`: the letters and the cursor of the next page (`None` once the
/// queue has no more).
pub(crate) async fn page(
    queue: &GatewayQueue,
    filter: &DeadFilter,
    limit: usize,
    cursor: Option<EntryId>,
) -> Result<(Vec<DeadLetter>, Option<EntryId>), String> {
    let mut out = Vec::new();
    let mut after = cursor;
    let mut scanned = 0;
    loop {
        let batch = bounded(queue.dead_page(after.as_ref(), BATCH)).await?;
        let full = batch.len() == BATCH;
        for d in batch {
            scanned += 1;
            after = Some(d.id.clone());
            if filter.matches(&d) {
                out.push(d);
            }
            if out.len() == limit || scanned == SCAN {
                // More may follow this one.
                return Ok((out, after));
            }
        }
        if !full {
            return Ok((out, None));
        }
    }
}

/// The dead letters `filter` selects (at most `most`, of at most
/// [`BULK`] looked at), and how many were looked at.
pub(crate) async fn page_all<Q: Queue>(
    queue: &Q,
    filter: &DeadFilter,
    most: usize,
) -> Result<(Vec<DeadLetter>, usize), String> {
    let mut out = Vec::new();
    let mut after = None;
    let mut seen = 0;
    while seen < BULK && out.len() < most {
        let batch = bounded(queue.dead_page(after.as_ref(), BATCH)).await?;
        let full = batch.len() == BATCH;
        seen += batch.len();
        after = batch.last().map(|d| d.id.clone());
        out.extend(batch.into_iter().filter(|d| filter.matches(d)));
        if !full {
            break;
        }
    }
    out.truncate(most);
    Ok((out, seen))
}

/// Whether `d` was dead-lettered because it failed authentication (it was
/// not queued by a gateway holding the queue's key): replayed only when
/// forced.
pub(crate) fn unauthenticated(d: &DeadLetter) -> bool {
    d.error == tower_idempotency_queue::UNAUTHENTICATED
}

/// `POST /admin/dead/replay`: replays what `filter` selects (each at most
/// once), or with `dry_run` counts it; dead letters that failed
/// authentication only when `force`d (else counted as `refused`).
pub(crate) async fn replay_selected(
    queue: &GatewayQueue,
    key: Option<&QueueKey>,
    filter: &DeadFilter,
    dry_run: bool,
    force: bool,
) -> Result<Value, String> {
    let (mut chosen, total) = page_all(queue, filter, BULK).await?;
    let before = chosen.len();
    if !force {
        chosen.retain(|d| !unauthenticated(d));
    }
    let refused = before - chosen.len();
    if dry_run {
        let ids: Vec<&str> = chosen.iter().take(1000).map(|d| d.id.as_str()).collect();
        return Ok(json!({
            "dry_run": true, "matched": chosen.len(), "dead_letters": total,
            "replayed": 0, "refused_unauthenticated": refused, "ids": ids,
        }));
    }
    let mut replayed = 0;
    for d in &chosen {
        replayed += usize::from(bounded(replay(queue, key, &d.id)).await?);
    }
    tracing::info!(
        matched = chosen.len(),
        replayed,
        refused_unauthenticated = refused,
        force,
        "admin: dead letters replayed"
    );
    Ok(json!({
        "dry_run": false, "matched": chosen.len(), "dead_letters": total, "replayed": replayed,
        "refused_unauthenticated": refused,
    }))
}

/// `GET /admin/dead/{id}`.
pub(crate) async fn show(queue: &GatewayQueue, id: &str) -> Result<Option<Value>, String> {
    let found = bounded(queue.find_dead(&EntryId::new(id))).await?;
    Ok(found.as_ref().map(detail))
}

/// What a replay of one dead letter did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReplayOne {
    /// Queued again.
    Replayed,
    /// No such dead letter.
    Absent,
    /// It failed authentication, and the replay was not forced.
    Unauthenticated,
}

/// `POST /admin/dead/{id}/replay[?force=true]`: a dead letter that failed
/// authentication is replayed only when `force`d.
pub(crate) async fn replay_one(
    queue: &GatewayQueue,
    key: Option<&QueueKey>,
    id: &str,
    force: bool,
) -> Result<ReplayOne, String> {
    let id = EntryId::new(id);
    if !force {
        match bounded(queue.find_dead(&id)).await? {
            None => return Ok(ReplayOne::Absent),
            Some(d) if unauthenticated(&d) => return Ok(ReplayOne::Unauthenticated),
            Some(_) => {}
        }
    }
    let done = bounded(replay(queue, key, &id)).await?;
    if !done {
        return Ok(ReplayOne::Absent);
    }
    tracing::info!(id = id.as_str(), force, "admin: dead letter replayed");
    Ok(ReplayOne::Replayed)
}

/// Replays the dead letter `id`, sealed afresh under `key` (the queue's,
/// when it seals its entries) if its MAC holds: delivered however long it
/// waited.
pub(crate) async fn replay(
    queue: &GatewayQueue,
    key: Option<&QueueKey>,
    id: &EntryId,
) -> Result<bool, QueueError> {
    match key {
        Some(key) => {
            let key = key.clone();
            queue.replay_with(id, &move |m| key.reseal(m)).await
        }
        None => queue.replay(id).await,
    }
}

/// The refusal of an unforced replay of a dead letter that failed
/// authentication.
pub(crate) fn unauthenticated_refusal(id: &str) -> String {
    format!(
        "dead letter {id} failed authentication (`unauthenticated`): it was not queued by a \
         gateway holding this queue's key; replay it with --force (force=true) only if you know \
         where it came from"
    )
}

/// `DELETE /admin/dead/{id}`: the deleted letter; the journal (or the log
/// when it is off) notes who deleted it, when and why.
pub(crate) async fn delete(
    queue: &GatewayQueue,
    journal: Option<&idempotency_gateway::journal::Journal>,
    id: &str,
    who: &str,
    why: &str,
) -> Result<Option<DeadLetter>, String> {
    let Some(letter) = bounded(queue.delete_dead(&EntryId::new(id))).await? else {
        return Ok(None);
    };
    let at = rfc3339(SystemTime::now());
    let key = original_key(&letter.message.key);
    let hash = tower_idempotency::Fingerprint::of(key.as_bytes());
    tracing::info!(
        id, key = ?hash, by = who, reason = why, path = letter.message.uri.path(),
        "admin: dead letter deleted; a later copy is queued again"
    );
    if let Some(journal) = journal {
        use idempotency_gateway::journal::{JournalEvent, JournalOutcome};
        let note = format!("dead letter {id} deleted by {who} at {at}: {why}");
        let event = JournalEvent::new(key, "", "", JournalOutcome::Forgotten).note(note);
        journal.record(event);
        journal.flush().await;
    }
    Ok(Some(letter))
}
