//! The embedded queue's group commit: acknowledgements that share a commit
//! are each durable once acknowledged (after a drop, after `kill -9`), and
//! fetches claiming batches, alone or concurrently, keep the order of each
//! order group.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tower::service_fn;
use tower_idempotency::Fingerprint;
use tower_idempotency_queue::{Delivery, MemoryQueue, Message, Queue, RedbQueue, Worker};

/// Entries queued, then acknowledged (the even ones) or left (the odd ones).
const N: usize = 400;
/// Acknowledgements sent at once, per wave.
const WAVE: usize = 40;
/// Acknowledged entries seen before the queue is dropped or killed.
const SEEN_BEFORE_CRASH: usize = 60;
/// The lease of the entries fetched before the crash.
const LEASE: Duration = Duration::from_secs(1);

use temp::TempDir;
/// A fresh directory under the system temp dir, removed on drop.
use test_support::common::temp;

fn event(key: &str) -> Message {
    Message::new(
        key,
        Fingerprint::of(key.as_bytes()),
        format!("{{\"id\":\"{key}\"}}"),
    )
}

/// Queues `N` entries and fetches them all (leased for `LEASE`).
async fn queue_and_fetch<Q: Queue>(queue: &Q) -> Vec<Delivery> {
    for i in 0..N {
        queue.ingest(event(&format!("k-{i}"))).await.unwrap();
    }
    let fetched = queue.fetch(N, LEASE).await.unwrap();
    assert_eq!(fetched.len(), N);
    fetched
}

/// Acknowledges the even entries, `WAVE` at a time, every 100 ms; calls
/// `acked` with each key once its `ack` returned `true`.
fn ack_evens<Q: Queue>(
    queue: &Q,
    fetched: Vec<Delivery>,
    acked: impl Fn(&str) + Clone + Send + 'static,
) -> Vec<tokio::task::JoinHandle<()>> {
    fetched
        .into_iter()
        .filter(|d| d.message.key[2..].parse::<usize>().unwrap() % 2 == 0)
        .enumerate()
        .map(|(n, d)| {
            let (queue, acked) = (queue.clone(), acked.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(100 * (n / WAVE) as u64)).await;
                if queue.ack(&d).await.unwrap() {
                    acked(&d.message.key);
                }
            })
        })
        .collect()
}

/// After the crash: no acknowledged entry comes back, every entry never
/// acknowledged does, and nothing else is left.
async fn check_after_crash(queue: RedbQueue, acked: HashSet<String>) {
    assert!(acked.len() >= SEEN_BEFORE_CRASH, "{}", acked.len());
    // Let the leases of the fetch before the crash run out.
    tokio::time::sleep(LEASE + Duration::from_millis(500)).await;
    let again: HashSet<String> = queue
        .fetch(2 * N, LEASE)
        .await
        .unwrap()
        .into_iter()
        .map(|d| d.message.key)
        .collect();
    let back: Vec<_> = acked.intersection(&again).collect();
    assert!(
        back.is_empty(),
        "acknowledged, then delivered again: {back:?}"
    );
    let lost: Vec<_> = (1..N)
        .step_by(2)
        .map(|i| format!("k-{i}"))
        .filter(|k| !again.contains(k))
        .collect();
    assert!(lost.is_empty(), "never acknowledged, yet gone: {lost:?}");
    // What else is gone had its acknowledgement committed (its caller may
    // not have heard back before the crash).
    assert!(again
        .iter()
        .all(|k| k[2..].parse::<usize>().unwrap() % 2 == 1 || !acked.contains(k)));
    assert_eq!(queue.stats().await.unwrap().depth, again.len() as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_acks_are_durable_after_the_queue_is_dropped_mid_way() {
    let dir = TempDir::new("group-drop");
    let queue = RedbQueue::open(dir.file()).unwrap();
    let fetched = queue_and_fetch(&queue).await;
    let acked = Arc::new(Mutex::new(HashSet::new()));
    let (seen, mut more) = tokio::sync::mpsc::unbounded_channel::<()>();
    let record = acked.clone();
    let tasks = ack_evens(&queue, fetched, move |key| {
        record.lock().unwrap().insert(key.to_owned());
        let _ = seen.send(());
    });
    for _ in 0..SEEN_BEFORE_CRASH {
        more.recv().await.unwrap();
    }
    // No shutdown: the acknowledgements still waiting are cancelled, those
    // sent are committed or not, and the queue is dropped.
    for t in &tasks {
        t.abort();
    }
    for t in tasks {
        let _ = t.await;
    }
    drop(queue);
    let acked = acked.lock().unwrap().clone();
    assert!(acked.len() < N / 2, "every ack finished before the drop");
    check_after_crash(RedbQueue::open(dir.file()).unwrap(), acked).await;
}

/// The environment variable that turns this test binary into the child
/// process of the `kill -9` test.
const CHILD: &str = "TOWER_IDEMPOTENCY_GROUP_COMMIT_CHILD";

/// Not a test: the child of the `kill -9` test (this binary again, with
/// `CHILD` set to the queue file). Queues and fetches `N` entries, then
/// acknowledges the even ones and prints `acked KEY` after each, until
/// killed.
#[test]
fn child_process() {
    let Ok(path) = std::env::var(CHILD) else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async move {
        let queue = RedbQueue::open(&path).unwrap();
        let fetched = queue_and_fetch(&queue).await;
        let tasks = ack_evens(&queue, fetched, |key| println!("acked {key}"));
        for t in tasks {
            t.await.unwrap();
        }
        println!("all acked");
        std::future::pending::<()>().await;
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_acks_are_durable_after_kill_9() {
    use std::io::BufRead;
    let dir = TempDir::new("group-kill");
    let path = dir.file();
    let acked = tokio::task::spawn_blocking(move || {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([&child_test(), "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD, &path)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut acked = HashSet::new();
        for line in std::io::BufReader::new(stdout).lines() {
            let line = line.unwrap();
            if let Some(key) = line.strip_prefix("acked ") {
                acked.insert(key.to_owned());
                if acked.len() >= SEEN_BEFORE_CRASH {
                    break;
                }
            }
        }
        // `Child::kill` sends SIGKILL on Unix: no destructor, no flush runs.
        child.kill().unwrap();
        child.wait().unwrap();
        acked
    })
    .await
    .unwrap();
    check_after_crash(RedbQueue::open(dir.file()).unwrap(), acked).await;
}

/// Groups `g0..g9` of 5 events each, queued interleaved (the first event of
/// every group, then the second...), and 10 events of no group.
async fn queue_groups<Q: Queue>(queue: &Q) {
    for e in 0..5 {
        for g in 0..10 {
            let m = event(&format!("g{g}-e{e}")).order(format!("g{g}"));
            queue.ingest(m).await.unwrap();
        }
    }
    for i in 0..10 {
        queue.ingest(event(&format!("free-{i}"))).await.unwrap();
    }
}

async fn batch_claim_hands_out_one_event_per_group_in_order<Q: Queue>(queue: Q) {
    queue_groups(&queue).await;
    let lease = Duration::from_secs(60);
    let mut delivered: Vec<String> = Vec::new();
    for round in 0..5 {
        // Two claims at once may share a commit: together they hand out one
        // event per group, the next one in its order.
        let (a, b) = tokio::join!(queue.fetch(64, lease), queue.fetch(64, lease));
        let batch: Vec<Delivery> = a.unwrap().into_iter().chain(b.unwrap()).collect();
        let keys: Vec<&str> = batch.iter().map(|d| d.message.key.as_str()).collect();
        let grouped: Vec<&str> = keys
            .iter()
            .copied()
            .filter(|k| k.starts_with('g'))
            .collect();
        let mut want: Vec<String> = (0..10).map(|g| format!("g{g}-e{round}")).collect();
        let mut got: Vec<String> = grouped.iter().map(|k| k.to_string()).collect();
        want.sort();
        got.sort();
        assert_eq!(got, want, "round {round}: {keys:?}");
        let free = keys.len() - grouped.len();
        assert_eq!(free, if round == 0 { 10 } else { 0 }, "{keys:?}");
        // Nothing more is due until these are settled.
        assert!(queue.fetch(64, lease).await.unwrap().is_empty());
        // Acknowledged all at once (one commit).
        let acks = batch.iter().map(|d| queue.ack(d));
        let kept = futures_util::future::join_all(acks).await;
        assert!(kept.into_iter().all(|k| k.unwrap()));
        delivered.extend(batch.into_iter().map(|d| d.message.key));
    }
    assert!(queue.fetch(64, lease).await.unwrap().is_empty());
    assert_eq!(queue.stats().await.unwrap().depth, 0);
    assert_eq!(delivered.len(), 60);
}

async fn concurrent_workers_keep_each_group_in_order<Q: Queue>(queue: Q) {
    queue_groups(&queue).await;
    let order = Arc::new(Mutex::new(Vec::new()));
    let in_flight = Arc::new(Mutex::new(HashSet::new()));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let workers: Vec<_> = (0..3)
        .map(|w| {
            let (order, in_flight) = (order.clone(), in_flight.clone());
            let handler = service_fn(move |m: Message| {
                let (order, in_flight) = (order.clone(), in_flight.clone());
                async move {
                    assert!(
                        in_flight.lock().unwrap().insert(m.key.clone()),
                        "{} delivered twice at once",
                        m.key
                    );
                    tokio::time::sleep(Duration::from_millis((m.key.len() % 3) as u64)).await;
                    order.lock().unwrap().push(m.key.clone());
                    in_flight.lock().unwrap().remove(&m.key);
                    Ok::<_, std::convert::Infallible>(())
                }
            });
            let worker = Worker::new(queue.clone(), handler)
                .name(format!("w{w}"))
                .batch(8)
                .poll_interval(Duration::from_millis(5));
            let mut stopped = stopped.clone();
            tokio::spawn(worker.run(async move {
                let _ = stopped.wait_for(|s| *s).await;
            }))
        })
        .collect();
    for _ in 0..3000 {
        if queue.stats().await.unwrap().depth == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.send(true).unwrap();
    for w in workers {
        w.await.unwrap();
    }
    assert_eq!(queue.stats().await.unwrap().depth, 0);
    let order = order.lock().unwrap().clone();
    assert_eq!(order.len(), 60, "{order:?}");
    let mut per_group: HashMap<String, Vec<String>> = HashMap::new();
    for key in order.iter().filter(|k| k.starts_with('g')) {
        let group = key.split('-').next().unwrap().to_owned();
        per_group.entry(group).or_default().push(key.clone());
    }
    for (group, keys) in per_group {
        let want: Vec<String> = (0..5).map(|e| format!("{group}-e{e}")).collect();
        assert_eq!(keys, want);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redb_batch_claim_hands_out_one_event_per_group_in_order() {
    let dir = TempDir::new("group-order");
    batch_claim_hands_out_one_event_per_group_in_order(RedbQueue::open(dir.file()).unwrap()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_batch_claim_hands_out_one_event_per_group_in_order() {
    batch_claim_hands_out_one_event_per_group_in_order(MemoryQueue::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redb_concurrent_workers_keep_each_group_in_order() {
    let dir = TempDir::new("group-workers");
    concurrent_workers_keep_each_group_in_order(RedbQueue::open(dir.file()).unwrap()).await;
}

/// The full name of this file's `child_process` test, as the test binary
/// takes it (`--exact`): its module path without the binary's name.
fn child_test() -> String {
    let module = module_path!().split_once("::").map_or("", |(_, m)| m);
    format!("{module}::child_process")
}
