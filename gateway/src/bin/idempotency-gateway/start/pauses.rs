//! Where the paused routes are kept: in the store when it is shared (Redis,
//! SQL), so that every instance on it obeys a pause within a second and a
//! restart keeps it; in `pauses.json` in the data directory with the memory
//! store. Read again every half second into the gateway's
//! [`Pauses`], and shown as the gauge `idempotency_route_paused{route}`.

use crate::start::store::GatewayStore;
use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use idempotency_gateway::proxy::{pause_key, PauseInfo, Pauses};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tower_idempotency::store::{
    Claim, CompletedRecord, Forgotten, OwnerToken, RecordState, Store, StoredResponse,
};
use tower_idempotency::Fingerprint;
use tower_idempotency_queue::{Park, QueueError};
use tracing::{info, warn};

/// How often the kept pauses are read again.
const POLL: Duration = Duration::from_millis(500);
/// How long a pause is kept in the store: until it is resumed.
const KEPT: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// The longest one read or write of the pauses waits.
const TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Clone)]
enum Place {
    Store(GatewayStore),
    File(PathBuf),
}

/// The pauses of the configured routes, and where they are kept.
#[derive(Clone)]
pub(crate) struct PauseKeeper {
    place: Place,
    pauses: Pauses,
    /// The configured routes' prefixes.
    routes: Arc<[String]>,
}

fn store_key(prefix: &str) -> String {
    format!("idem-pause:{}", pause_key(prefix))
}

impl PauseKeeper {
    /// Kept in `store`, or with the memory store (`memory`) in `data_dir`.
    pub(crate) fn new(
        store: &GatewayStore,
        memory: bool,
        data_dir: PathBuf,
        routes: Vec<String>,
    ) -> Self {
        let place = if memory {
            Place::File(data_dir.join("pauses.json"))
        } else {
            Place::Store(store.clone())
        };
        Self {
            place,
            pauses: Pauses::new(),
            routes: routes.into(),
        }
    }

    /// The registry the gateways obey.
    pub(crate) fn pauses(&self) -> &Pauses {
        &self.pauses
    }

    /// The configured route `prefix` is (its normal form), if it is one.
    pub(crate) fn route(&self, prefix: &str) -> Option<&str> {
        let want = pause_key(prefix);
        self.routes
            .iter()
            .find(|r| pause_key(r) == want)
            .map(String::as_str)
    }

    async fn read(&self) -> Result<HashMap<String, PauseInfo>, String> {
        match &self.place {
            Place::File(path) => match std::fs::read(path) {
                Ok(bytes) => {
                    serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", path.display()))
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(HashMap::new()),
                Err(e) => Err(format!("cannot read {}: {e}", path.display())),
            },
            Place::Store(store) => {
                let mut out = HashMap::new();
                for route in self.routes.iter() {
                    let state = tokio::time::timeout(TIMEOUT, store.inspect(&store_key(route)))
                        .await
                        .map_err(|_| "the store did not answer".to_owned())?
                        .map_err(|e| e.to_string())?;
                    if let RecordState::Completed { record, .. } = state
                        && let Ok(info) = serde_json::from_slice(&record.response.body)
                    {
                        out.insert(pause_key(route), info);
                    }
                }
                Ok(out)
            }
        }
    }

    /// Reads the kept pauses into the registry and the gauge.
    pub(crate) async fn refresh(&self) -> Result<(), String> {
        let all = self.read().await?;
        self.pauses.replace_all(all);
        for route in self.routes.iter() {
            let on = self.pauses.is_paused(route);
            metrics::gauge!("idempotency_route_paused", "route" => route.clone())
                .set(f64::from(u8::from(on)));
        }
        Ok(())
    }

    /// Reads the kept pauses every half second, for as long as the process
    /// runs.
    pub(crate) fn spawn_poller(&self) {
        let this = self.clone();
        tokio::spawn(async move {
            let mut failing = false;
            loop {
                tokio::time::sleep(POLL).await;
                match this.refresh().await {
                    Ok(()) => failing = false,
                    Err(e) if !failing => {
                        failing = true;
                        warn!(error = %crate::redact::redact_text(&e), "cannot read the paused routes; the last ones read still hold");
                    }
                    Err(_) => {}
                }
            }
        });
    }

    async fn write_file(
        &self,
        path: &PathBuf,
        all: &HashMap<String, PauseInfo>,
    ) -> Result<(), String> {
        if let Some(dir) = path.parent() {
            crate::start::ack::create_private_dir(dir)?;
        }
        let tmp = path.with_extension("json.tmp");
        let text = serde_json::to_vec_pretty(all).map_err(|e| e.to_string())?;
        crate::private::owner_only_file(&tmp)?;
        std::fs::write(&tmp, text).map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, path).map_err(|e| format!("cannot write {}: {e}", path.display()))
    }

    /// Pauses the route `prefix` (a configured one) for every instance.
    pub(crate) async fn pause(&self, prefix: &str, info: PauseInfo) -> Result<(), String> {
        match &self.place {
            Place::File(path) => {
                let mut all = self.read().await?;
                all.insert(pause_key(prefix), info.clone());
                self.write_file(path, &all).await?;
            }
            Place::Store(store) => {
                let key = store_key(prefix);
                let body = serde_json::to_vec(&info).map_err(|e| e.to_string())?;
                let fp = Fingerprint::of(b"pause");
                let record = Arc::new(CompletedRecord::new(
                    fp,
                    StoredResponse::new(StatusCode::OK, HeaderMap::new(), Bytes::from(body)),
                ));
                let write = async {
                    if store.replace(&key, record.clone(), KEPT).await? {
                        return Ok(true);
                    }
                    let token = OwnerToken::new();
                    match store.claim(&key, fp, token, TIMEOUT).await? {
                        Claim::Acquired(_) => {
                            store.complete(&key, token, record, KEPT).await?;
                            Ok(true)
                        }
                        _ => Ok(false),
                    }
                };
                let done: Result<bool, tower_idempotency::store::StoreError> =
                    tokio::time::timeout(TIMEOUT, write)
                        .await
                        .map_err(|_| "the store did not answer".to_owned())?;
                if !done.map_err(|e| e.to_string())? {
                    return Err(
                        "another pause or resume of this route ran at once: try again".into(),
                    );
                }
            }
        }
        self.pauses.set(prefix, Some(info));
        self.refresh().await
    }

    /// Resumes the route `prefix`: whether it was paused.
    pub(crate) async fn resume(&self, prefix: &str) -> Result<bool, String> {
        let was = self.read().await?.contains_key(&pause_key(prefix));
        match &self.place {
            Place::File(path) => {
                let mut all = self.read().await?;
                all.remove(&pause_key(prefix));
                self.write_file(path, &all).await?;
            }
            Place::Store(store) => {
                let forgot = tokio::time::timeout(TIMEOUT, store.forget(&store_key(prefix)))
                    .await
                    .map_err(|_| "the store did not answer".to_owned())?
                    .map_err(|e| e.to_string())?;
                // Another instance's pause of the route is being written:
                // nothing was removed, and the route stays paused.
                if matches!(forgot, Forgotten::InFlight) {
                    self.refresh().await?;
                    return Err(
                        "another pause or resume of this route ran at once: try again".into(),
                    );
                }
            }
        }
        self.pauses.set(prefix, None);
        self.refresh().await?;
        Ok(was)
    }
}

/// Wakes the entries parked under a prefix that is no longer paused, every
/// half second, for as long as the process runs: a route resumed here or on
/// another instance, a pause removed while this one was down, a prefix no
/// longer in the route table (at start, whatever is parked and not paused).
/// A wake is one change of the queue, so two instances waking one prefix at
/// once put each entry back once.
pub(crate) fn spawn_waker<Q: Park>(pauses: Pauses, queue: Q) {
    tokio::spawn(async move {
        let mut failing = false;
        loop {
            match tokio::time::timeout(TIMEOUT, wake_resumed(&pauses, &queue)).await {
                Ok(Ok(())) => failing = false,
                Ok(Err(e)) if !failing => {
                    failing = true;
                    warn!(error = %crate::redact::redact_text(&e.to_string()), "cannot wake the parked entries of resumed routes; tried again");
                }
                Err(_) if !failing => {
                    failing = true;
                    warn!("the queue did not answer while waking the parked entries of resumed routes; tried again");
                }
                _ => {}
            }
            tokio::time::sleep(POLL).await;
        }
    });
}

/// Wakes every parked prefix that is not paused now; nothing before the
/// paused routes were first read (any of them may be paused).
async fn wake_resumed<Q: Park>(pauses: &Pauses, queue: &Q) -> Result<(), QueueError> {
    if !pauses.is_read() {
        return Ok(());
    }
    for prefix in queue.parked().await? {
        if pauses.get(&prefix).is_none() {
            let n = queue.wake(&prefix).await?;
            if n > 0 {
                info!(route = %prefix, woken = n, "a resumed route's parked entries are due again");
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower_idempotency::store::{Either, MemoryStore};

    /// A resume that meets another instance's pause of the route being
    /// written (its key claimed, not completed yet) removes nothing: it
    /// fails, rather than answering as if it resumed a route that ends up
    /// paused.
    #[tokio::test]
    async fn a_resume_meeting_a_pause_in_flight_fails() {
        let store: GatewayStore = Either::Left(MemoryStore::new());
        let keeper = PauseKeeper::new(&store, false, PathBuf::new(), vec!["/wx".into()]);
        let key = store_key("/wx");
        let fp = Fingerprint::of(b"pause");
        let other = OwnerToken::new();
        let claim = store.claim(&key, fp, other, TIMEOUT).await.unwrap();
        assert!(matches!(claim, Claim::Acquired(_)));
        let resumed = keeper.resume("/wx").await;
        assert!(
            resumed.as_ref().is_err_and(|e| e.contains("try again")),
            "{resumed:?}"
        );
        // The other instance's pause completes: the route is paused.
        let info = PauseInfo::new(1, "ops", "deploy");
        let body = Bytes::from(serde_json::to_vec(&info).unwrap());
        let record = Arc::new(CompletedRecord::new(
            fp,
            StoredResponse::new(StatusCode::OK, HeaderMap::new(), body),
        ));
        store.complete(&key, other, record, KEPT).await.unwrap();
        keeper.refresh().await.unwrap();
        assert!(keeper.pauses().is_paused("/wx"));
        assert_eq!(keeper.resume("/wx").await, Ok(true));
        assert!(!keeper.pauses().is_paused("/wx"));
    }
}
