//! Group commit for the embedded queue: one thread runs every change to the
//! queue (ingest, fetch, acknowledgement, retry, dead letter, replay), and
//! every change waiting when a commit starts shares its transaction and its
//! fsync. Each caller hears back only once that commit is durable, so what
//! it was told is true after a crash, and concurrent callers cost one disk
//! flush per group instead of one each.

use super::records::{self, err};
use super::reopen::{poisoned, Db};
use super::room::is_full;
use crate::{QueueError, QueueErrorKind};
use redb::{CommitError, Database, StorageError, WriteTransaction};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Changes per group commit, at most.
const GROUP_MAX: usize = 512;

/// The first wait before a file whose write failed is reopened; doubled
/// after each failure in a row, up to [`REOPEN_MAX`].
const REOPEN_FIRST: Duration = Duration::from_millis(100);
const REOPEN_MAX: Duration = Duration::from_secs(5);

/// A write failing this long after the previous failure starts the backoff
/// from [`REOPEN_FIRST`] again.
const CALM: Duration = Duration::from_secs(60);

/// The longest a settlement waits for a closed file before it fails.
const HOLD_MAX: Duration = Duration::from_secs(60);

/// What a change does, for what it waits when the disk is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// Stores a new entry: refused while the disk is short of room (see
    /// `Room`), and at once while the file is closed after a failed write.
    Ingest,
    /// Leases due entries: fails at once while the file is closed (the
    /// worker polls again).
    Fetch,
    /// Every other change (settling a delivery, a replay): waits for the
    /// file to be reopened, up to [`HOLD_MAX`].
    Settle,
}

/// One change waiting for the group commit.
trait Pending: Send {
    /// Runs the change in `txn`, keeping its result for [`reply`](Self::reply).
    /// May run again in a fresh transaction if its group's commit failed.
    fn run(&mut self, txn: &WriteTransaction) -> Result<(), QueueError>;

    /// Answers the caller: the kept result once `committed` is `Ok`, the
    /// error otherwise.
    fn reply(self: Box<Self>, committed: Result<(), QueueError>);

    fn kind(&self) -> Kind;

    /// When the change first waited for a closed file (now, the first time).
    fn held(&mut self) -> Instant;
}

struct Call<T, F> {
    change: F,
    out: Option<T>,
    reply: oneshot::Sender<Result<T, QueueError>>,
    kind: Kind,
    held: Option<Instant>,
}

impl<T, F> Pending for Call<T, F>
where
    T: Send,
    F: FnMut(&WriteTransaction) -> Result<T, QueueError> + Send,
{
    fn run(&mut self, txn: &WriteTransaction) -> Result<(), QueueError> {
        self.out = Some((self.change)(txn)?);
        Ok(())
    }

    fn reply(self: Box<Self>, committed: Result<(), QueueError>) {
        let this = *self;
        let result = committed.and_then(|()| {
            this.out
                .ok_or_else(|| records::fail(QueueErrorKind::Other, "change not run"))
        });
        // The caller may have gone (cancelled): the change stays committed.
        let _ = this.reply.send(result);
    }

    fn kind(&self) -> Kind {
        self.kind
    }

    fn held(&mut self) -> Instant {
        *self.held.get_or_insert_with(Instant::now)
    }
}

type Job = Box<dyn Pending>;

/// The thread that commits changes in groups. Dropped with the last clone of
/// the queue; the drop lets it commit what was already sent, then waits for
/// it, so the file is closed when the queue is.
#[derive(Debug)]
pub(super) struct Committer {
    tx: Option<mpsc::Sender<Job>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Committer {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Committer {
    /// Starts the thread over `db`.
    pub(super) fn start(db: Arc<Db>) -> Result<Self, QueueError> {
        let (tx, rx) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name("queue-commit".into())
            .spawn(move || serve(&db, &rx))
            .map_err(err)?;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    /// Runs `change` in the next group commit; returns its result once that
    /// commit is durable. `change` may run twice (the second time in a fresh
    /// transaction, the first one rolled back), so it must not keep state
    /// of its own between runs.
    pub(super) async fn run<T, F>(&self, kind: Kind, change: F) -> Result<T, QueueError>
    where
        T: Send + 'static,
        F: FnMut(&WriteTransaction) -> Result<T, QueueError> + Send + 'static,
    {
        let (reply, rx) = oneshot::channel();
        let tx = self
            .tx
            .as_ref()
            .ok_or_else(|| records::fail(QueueErrorKind::Unavailable, "closed"))?;
        tx.send(Box::new(Call {
            change,
            out: None,
            reply,
            kind,
            held: None,
        }))
        .map_err(|_| records::fail(QueueErrorKind::Unavailable, "commit thread stopped"))?;
        rx.await
            .map_err(|_| records::fail(QueueErrorKind::Unavailable, "commit thread stopped"))?
    }
}

/// Commits the changes sent on `rx` in groups until every sender is gone.
/// After a write failed on the storage, the file is closed and reopened
/// with a backoff; meanwhile ingests and fetches fail at once (their
/// callers hear an unwritable error instead of waiting for the disk), and
/// settlements wait for a reopen that lets them commit, up to [`HOLD_MAX`]:
/// a delivery that ended while the disk was full is settled once space is
/// freed, instead of waiting out its lease.
fn serve(db: &Db, rx: &mpsc::Receiver<Job>) {
    let mut closed: Option<Closed> = None;
    let mut backoff = Backoff::default();
    loop {
        let first = match &closed {
            None => match rx.recv() {
                Ok(job) => Some(job),
                Err(_) => break,
            },
            Some(c) => match rx.recv_timeout(c.until.saturating_duration_since(Instant::now())) {
                Ok(job) => Some(job),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => break,
            },
        };
        if let Some(mut c) = closed.take_if(|c| Instant::now() >= c.until) {
            let reopened = db.reopen();
            db.health.reopened(&reopened);
            closed =
                match reopened {
                    Ok(()) => commit_group(db, std::mem::take(&mut c.held)).err().map(
                        |(failure, left)| {
                            let mut c = backoff.closed(db, &failure);
                            c.hold(left, &failure.error);
                            c
                        },
                    ),
                    Err(e) => {
                        let held = std::mem::take(&mut c.held);
                        c.until = Instant::now() + backoff.again();
                        c.hold(held, &e);
                        Some(c)
                    }
                };
        }
        let Some(first) = first else { continue };
        let mut jobs = vec![first];
        while jobs.len() < GROUP_MAX {
            match rx.try_recv() {
                Ok(job) => jobs.push(job),
                Err(_) => break,
            }
        }
        if let Some(c) = &mut closed {
            let e = QueueError::unwritable(
                "embedded queue: a write failed on its disk; new entries are refused until its file is reopened",
            );
            c.hold(jobs, &e);
            continue;
        }
        if let Err((failure, left)) = commit_group(db, jobs) {
            let mut c = backoff.closed(db, &failure);
            c.hold(left, &failure.error);
            closed = Some(c);
        }
    }
    if let Some(c) = closed {
        fail(
            c.held,
            &records::fail(QueueErrorKind::Unavailable, "closed"),
        );
    }
}

/// A file closed after a failed write: when it is reopened next, and the
/// changes waiting for it.
struct Closed {
    until: Instant,
    held: Vec<Job>,
}

impl Closed {
    /// Keeps the settlements of `jobs` for the reopen; the others, and
    /// settlements that waited [`HOLD_MAX`] already, fail with `e`.
    fn hold(&mut self, jobs: Vec<Job>, e: &QueueError) {
        for mut job in jobs {
            if job.kind() != Kind::Settle || job.held().elapsed() >= HOLD_MAX {
                job.reply(Err(e.clone()));
            } else {
                self.held.push(job);
            }
        }
    }
}

/// The wait before the next reopen.
struct Backoff {
    next: Duration,
    last_failure: Option<Instant>,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            next: REOPEN_FIRST,
            last_failure: None,
        }
    }
}

impl Backoff {
    /// A write failed: the file is closed until the next reopen.
    fn closed(&mut self, db: &Db, failure: &Failure) -> Closed {
        db.health.failed(&failure.error, failure.full);
        self.next = match self.last_failure {
            Some(at) if at.elapsed() < CALM => (self.next * 2).min(REOPEN_MAX),
            _ => REOPEN_FIRST,
        };
        self.last_failure = Some(Instant::now());
        Closed {
            until: Instant::now() + self.next,
            held: Vec::new(),
        }
    }

    /// The reopen failed: the wait before the next one.
    fn again(&mut self) -> Duration {
        self.next = (self.next * 2).min(REOPEN_MAX);
        self.next
    }
}

fn fail(jobs: Vec<Job>, e: &QueueError) {
    for job in jobs {
        job.reply(Err(e.clone()));
    }
}

/// Why a commit failed; `full`: for want of space.
struct Failure {
    error: QueueError,
    full: bool,
}

impl From<QueueError> for Failure {
    fn from(error: QueueError) -> Self {
        Self { error, full: false }
    }
}

/// Runs `jobs` in one transaction and commits it. If that fails and the
/// group had more than one change, each runs again alone, so that one bad
/// entry does not fail the changes that arrived with it. Ingests are
/// refused first while the disk is short of room. `Err` when a write failed
/// on the storage: the database refuses every transaction until it is
/// reopened, and the changes not answered yet are handed back.
fn commit_group(db: &Db, mut jobs: Vec<Job>) -> Result<(), (Failure, Vec<Job>)> {
    if jobs.is_empty() {
        return Ok(());
    }
    let database = match db.get() {
        Ok(database) => database,
        Err(e) => {
            fail(jobs, &e);
            return Ok(());
        }
    };
    let mut ingests = jobs.iter().any(|j| j.kind() == Kind::Ingest);
    if ingests && let Err(e) = db.health.room.check() {
        db.health.refused(&e);
        let (refused, others): (Vec<Job>, Vec<Job>) =
            jobs.into_iter().partition(|j| j.kind() == Kind::Ingest);
        fail(refused, &e);
        (jobs, ingests) = (others, false);
    }
    let failed = match commit(&database, &mut jobs) {
        Ok(()) => {
            db.health.committed();
            if ingests {
                db.health.room.stored();
            }
            for job in jobs {
                job.reply(Ok(()));
            }
            return Ok(());
        }
        Err(failure) if poisoned(&database) => failure,
        Err(failure) if jobs.len() == 1 => {
            fail(jobs, &failure.error);
            return Ok(());
        }
        Err(_) => {
            let mut left = jobs.into_iter();
            loop {
                let Some(mut job) = left.next() else {
                    return Ok(());
                };
                match commit(&database, std::slice::from_mut(&mut job)) {
                    Ok(()) => job.reply(Ok(())),
                    Err(failure) if poisoned(&database) => {
                        jobs = std::iter::once(job).chain(left).collect();
                        break failure;
                    }
                    Err(failure) => job.reply(Err(failure.error)),
                }
            }
        }
    };
    let failure = Failure {
        error: QueueError::unwritable(failed.error.to_string()).with_source(failed.error),
        full: failed.full,
    };
    Err((failure, jobs))
}

fn commit(db: &Database, jobs: &mut [Job]) -> Result<(), Failure> {
    let txn = db.begin_write().map_err(err)?;
    for job in jobs.iter_mut() {
        if let Err(e) = job.run(&txn) {
            // Rolls back every change of the group.
            let _ = txn.abort();
            return Err(e.into());
        }
    }
    // The pages are written here: a full disk shows as this commit's error.
    txn.commit().map_err(|e| Failure {
        full: matches!(&e, CommitError::Storage(StorageError::Io(io)) if is_full(io)),
        error: err(e),
    })
}
