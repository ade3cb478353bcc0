//! Group commit for the embedded queue: one thread runs every change to the
//! queue (ingest, fetch, acknowledgement, retry, dead letter, replay), and
//! every change waiting when a commit starts shares its transaction and its
//! fsync. Each caller hears back only once that commit is durable, so what
//! it was told is true after a crash, and concurrent callers cost one disk
//! flush per group instead of one each.

use super::records::err;
use super::QueueError;
use redb::{Database, WriteTransaction};
use std::sync::mpsc;
use std::sync::Arc;
use tokio::sync::oneshot;

/// Changes per group commit, at most.
const GROUP_MAX: usize = 512;

/// One change waiting for the group commit.
trait Pending: Send {
    /// Runs the change in `txn`, keeping its result for [`reply`](Self::reply).
    /// May run again in a fresh transaction if its group's commit failed.
    fn run(&mut self, txn: &WriteTransaction) -> Result<(), QueueError>;

    /// Answers the caller: the kept result once `committed` is `Ok`, the
    /// error otherwise.
    fn reply(self: Box<Self>, committed: Result<(), QueueError>);
}

struct Call<T, F> {
    change: F,
    out: Option<T>,
    reply: oneshot::Sender<Result<T, QueueError>>,
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
        let result = committed.and_then(|()| this.out.ok_or_else(|| err("change not run")));
        // The caller may have gone (cancelled): the change stays committed.
        let _ = this.reply.send(result);
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
    pub(super) fn start(db: Arc<Database>) -> Result<Self, QueueError> {
        let (tx, rx) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name("queue-commit".into())
            .spawn(move || {
                while let Ok(first) = rx.recv() {
                    let mut jobs = vec![first];
                    while jobs.len() < GROUP_MAX {
                        match rx.try_recv() {
                            Ok(job) => jobs.push(job),
                            Err(_) => break,
                        }
                    }
                    commit_group(&db, jobs);
                }
            })
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
    pub(super) async fn run<T, F>(&self, change: F) -> Result<T, QueueError>
    where
        T: Send + 'static,
        F: FnMut(&WriteTransaction) -> Result<T, QueueError> + Send + 'static,
    {
        let (reply, rx) = oneshot::channel();
        let tx = self.tx.as_ref().ok_or_else(|| err("closed"))?;
        tx.send(Box::new(Call {
            change,
            out: None,
            reply,
        }))
        .map_err(|_| err("commit thread stopped"))?;
        rx.await.map_err(|_| err("commit thread stopped"))?
    }
}

/// Runs `jobs` in one transaction and commits it. If that fails and the
/// group had more than one change, each runs again alone, so that one bad
/// entry does not fail the changes that arrived with it.
fn commit_group(db: &Database, mut jobs: Vec<Job>) {
    let together = commit(db, &mut jobs);
    if together.is_ok() || jobs.len() == 1 {
        for job in jobs {
            job.reply(together.clone());
        }
        return;
    }
    for mut job in jobs {
        let alone = commit(db, std::slice::from_mut(&mut job));
        job.reply(alone);
    }
}

fn commit(db: &Database, jobs: &mut [Job]) -> Result<(), QueueError> {
    let txn = db.begin_write().map_err(err)?;
    for job in jobs.iter_mut() {
        if let Err(e) = job.run(&txn) {
            // Rolls back every change of the group.
            let _ = txn.abort();
            return Err(e);
        }
    }
    txn.commit().map_err(err)
}
