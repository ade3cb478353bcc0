//! Waiting duplicates on one instance share one poller per key, and every
//! poller of a store is looked at by one statement per interval, however
//! many keys and waiters there are; expired rows are swept in bounded
//! batches.

#[cfg(feature = "mysql")]
use super::mysql;
#[cfg(feature = "postgres")]
use super::postgres;
#[cfg(feature = "sqlite")]
use super::sqlite;
use super::{Pool, SqlStore, IN_FLIGHT};
use sqlx::Row as _;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tower_idempotency_core::store::{Pollers, Watch};

/// This instance's pollers: per key, the owner its waiters wait on.
pub(super) type KeyPollers = Pollers<Vec<u8>, [u8; 16]>;

/// Keys per polling statement.
const POLL_CHUNK: usize = 500;

impl SqlStore {
    /// The owner on this instance completed or released `key`: wake this
    /// instance's waiters now.
    pub(super) fn wake_local_waiters(&self, key: &[u8]) {
        self.pollers.wake(key);
    }

    /// A watch shared by every waiter of this instance on `key` while it is
    /// held by `owner`.
    pub(super) fn watch(&self, key: Vec<u8>, owner: [u8; 16]) -> Watch {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Watch::poll(self.poll_interval);
        };
        // A replaced poller watched an older owner: dropped here (unless the
        // loop's round holds it, which then finds its owner gone), its
        // sender wakes its waiters.
        self.pollers.watch(key, owner, |_| {
            #[cfg(feature = "postgres")]
            match self.pool {
                Pool::Postgres(ref pool) => {
                    self.listener.get_or_init(|| {
                        let stop = CancellationToken::new();
                        runtime.spawn(listen(pool.clone(), self.pollers.clone(), stop.clone()));
                        stop.drop_guard()
                    });
                }
                #[cfg(any(feature = "mysql", feature = "sqlite"))]
                _ => {}
            }
            // Started and stopped under the pollers' lock: a poller is never
            // left without the loop.
            if !self.polling.swap(true, Ordering::AcqRel) {
                runtime.spawn(poll(
                    self.pool.clone(),
                    self.pollers.clone(),
                    self.polling.clone(),
                    self.poll_interval,
                ));
            }
        })
    }
}

/// Every `every`, one look (one statement per [`POLL_CHUNK`] keys) at every
/// key this instance's waiters watch; wakes the waiters of a key that is no
/// longer in flight under the owner they wait for. Ends when no key is
/// watched.
async fn poll(pool: Pool, pollers: KeyPollers, polling: Arc<AtomicBool>, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        // Idle pollers stop here, and wake their waiters.
        let watched = pollers.active(|| polling.store(false, Ordering::Release));
        if watched.is_empty() {
            return;
        }
        let mut live: HashMap<Vec<u8>, [u8; 16]> = HashMap::new();
        let mut failed = false;
        for chunk in watched.chunks(POLL_CHUNK) {
            let keys: Vec<&[u8]> = chunk.iter().map(|p| &p.key()[..]).collect();
            match peek_many(&pool, &keys).await {
                Ok(found) => live.extend(found),
                // The waiters claim again and see for themselves.
                Err(_) => failed = true,
            }
        }
        for poller in watched {
            let still = !failed && live.get(poller.key()) == Some(poller.owner());
            if !still {
                pollers.stop(&poller);
            }
        }
    }
}

/// The keys of `keys` that are in flight and live, with their owners.
async fn peek_many(pool: &Pool, keys: &[&[u8]]) -> sqlx::Result<HashMap<Vec<u8>, [u8; 16]>> {
    fn owner_of(state: i32, remaining: i64, owner: Option<Vec<u8>>) -> Option<[u8; 16]> {
        if state != IN_FLIGHT || remaining <= 0 {
            return None;
        }
        owner.and_then(|o| <[u8; 16]>::try_from(o).ok())
    }
    let mut found = HashMap::new();
    macro_rules! collect {
        ($rows:expr) => {
            for r in $rows {
                let key: Vec<u8> = r.try_get(0)?;
                if let Some(owner) = owner_of(r.try_get(1)?, r.try_get(3)?, r.try_get(2)?) {
                    found.insert(key, owner);
                }
            }
        };
    }
    match *pool {
        #[cfg(feature = "postgres")]
        Pool::Postgres(ref p) => {
            let rows = sqlx::query(postgres::PEEK_MANY)
                .bind(keys)
                .fetch_all(p)
                .await?;
            collect!(rows);
        }
        #[cfg(feature = "mysql")]
        Pool::MySql(ref p) => {
            let sql = in_list(mysql::PEEK_MANY, keys.len(), |_| "?".to_owned());
            let mut q = sqlx::query(&sql);
            for k in keys {
                q = q.bind(*k);
            }
            collect!(q.fetch_all(p).await?);
        }
        #[cfg(feature = "sqlite")]
        Pool::Sqlite(ref p) => {
            let sql = in_list(sqlite::PEEK_MANY, keys.len(), |i| format!("?{}", i + 1));
            let mut q = sqlx::query(&sql);
            for k in keys {
                q = q.bind(*k);
            }
            collect!(q.fetch_all(p).await?);
        }
    }
    Ok(found)
}

#[cfg(any(feature = "mysql", feature = "sqlite"))]
/// `head` followed by `(p1, p2, …)`, `n` placeholders.
fn in_list(head: &str, n: usize, placeholder: impl Fn(usize) -> String) -> String {
    let list: Vec<String> = (0..n).map(placeholder).collect();
    format!("{head} ({})", list.join(", "))
}

#[cfg(feature = "postgres")]
/// PostgreSQL: wakes this instance's waiters on a key as soon as a
/// `NOTIFY` says its record completed or its claim was released (by any
/// instance). The pollers stay, for leases that run out and for missed
/// notifications (a notification sent while the connection was down is lost).
async fn listen(pool: sqlx::PgPool, pollers: KeyPollers, stop: CancellationToken) {
    let work = async {
        loop {
            let mut listener = match sqlx::postgres::PgListener::connect_with(&pool).await {
                Ok(l) => l,
                Err(_) => {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
            if listener.listen(postgres::CHANNEL).await.is_err() {
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
            // `recv` reconnects by itself; an error ends this connection.
            while let Ok(n) = listener.recv().await {
                let Some(key) = unhex(n.payload()) else {
                    continue;
                };
                pollers.wake(&key);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::select! {
        () = stop.cancelled() => {}
        () = work => {}
    }
}

#[cfg(feature = "postgres")]
fn unhex(s: &str) -> Option<Vec<u8>> {
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let s = s.as_bytes();
    if !s.len().is_multiple_of(2) {
        return None;
    }
    s.chunks(2)
        .map(|p| Some(digit(p[0])? << 4 | digit(p[1])?))
        .collect()
}

/// Deletes every expired row, `batch` at a time.
pub(super) async fn sweep_all(pool: &Pool, batch: u32) -> sqlx::Result<u64> {
    let mut total = 0;
    loop {
        let n = match *pool {
            #[cfg(feature = "postgres")]
            Pool::Postgres(ref p) => sqlx::query(postgres::SWEEP)
                .bind(i64::from(batch))
                .execute(p)
                .await?
                .rows_affected(),
            #[cfg(feature = "mysql")]
            Pool::MySql(ref p) => sqlx::query(mysql::SWEEP)
                .bind(i64::from(batch))
                .execute(p)
                .await?
                .rows_affected(),
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(ref p) => sqlx::query(sqlite::SWEEP)
                .bind(i64::from(batch))
                .execute(p)
                .await?
                .rows_affected(),
        };
        total += n;
        if n < u64::from(batch) {
            break;
        }
        // Let other writers in between two batches.
        tokio::task::yield_now().await;
    }
    // Objects' positions, the same way.
    loop {
        let n = super::positions::sweep(pool, batch).await?;
        total += n;
        if n < u64::from(batch) {
            return Ok(total);
        }
        tokio::task::yield_now().await;
    }
}

/// The background sweep: every `every`, until `stop` fires.
pub(super) async fn sweep_loop(pool: Pool, every: Duration, batch: u32, stop: CancellationToken) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
        // A failure is retried at the next round; rows past their time are
        // treated as absent meanwhile.
        tokio::select! {
            () = stop.cancelled() => return,
            _ = sweep_all(&pool, batch) => {}
        }
    }
}
