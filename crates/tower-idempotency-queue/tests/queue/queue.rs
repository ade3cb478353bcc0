//! Durable queues: ingest deduplicated by key, delivery exactly once through
//! the consumer, order per group, dead letters replayed once, and a process
//! killed with `kill -9` between acknowledgement and delivery.

use test_support::support_nats;
use test_support::support_rabbitmq;
use test_support::support_redis;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tower::service_fn;
use tower::ServiceBuilder;
use tower_idempotency::consumer::{Consumer, ConsumerLayer};
use tower_idempotency::store::{MemoryStore, OwnerToken};
use tower_idempotency::Fingerprint;
use tower_idempotency_queue::{
    AmqpQueue, Ingested, JetStreamQueue, MemoryQueue, Message, Queue, RedbQueue, RedisStreamsQueue,
    SharedPacing, Worker,
};
use tower_idempotency_redis::RedisStore;

use crate::Down;

use temp::TempDir;
/// A fresh directory under the system temp dir, removed on drop.
use test_support::common::temp;

fn notification(i: usize) -> Message {
    let body = format!(r#"{{"id":"EV-{i}","event_type":"TRANSACTION.SUCCESS","amount":{i}}}"#);
    let mut m = Message::new(
        format!("wechatpay-v3:/notify:EV-{i}"),
        Fingerprint::of(format!("TRANSACTION.SUCCESS {i}").as_bytes()),
        body,
    );
    m.uri = http::Uri::from_static("/notify/wechat");
    m.headers.insert(
        "wechatpay-serial",
        http::HeaderValue::from_static("5157F09EFDC096DE15EBE81A47057A72"),
    );
    m
}

/// Counts runs per key; fails while `down` is set.
#[derive(Clone, Default)]
struct Upstream {
    down: Arc<AtomicBool>,
    runs: Arc<Mutex<HashMap<String, usize>>>,
    order: Arc<Mutex<Vec<String>>>,
}

impl Upstream {
    fn handler(
        &self,
    ) -> impl tower::Service<
        Message,
        Response = (),
        Error = Down,
        Future = impl std::future::Future<Output = Result<(), Down>> + Send + use<>,
    > + Clone
           + use<> {
        let this = self.clone();
        service_fn(move |m: Message| {
            let this = this.clone();
            async move {
                if this.down.load(Ordering::SeqCst) {
                    return Err(Down);
                }
                *this.runs.lock().unwrap().entry(m.key.clone()).or_default() += 1;
                this.order.lock().unwrap().push(m.key.clone());
                Ok(())
            }
        })
    }

    fn runs(&self) -> HashMap<String, usize> {
        self.runs.lock().unwrap().clone()
    }
}

fn message_key(m: &Message) -> Option<(String, Fingerprint)> {
    Some((m.key.clone(), m.fingerprint))
}

/// Runs worker rounds until the queue is empty (bounded).
async fn drain<Q: Queue, S>(worker: &mut Worker<Q, S>)
where
    S: tower::Service<Message>,
    S::Error: tower_idempotency::consumer::Failure,
{
    for _ in 0..2000 {
        if worker.queue().stats().await.unwrap().depth == 0 {
            return;
        }
        if worker.run_once().await.unwrap().fetched == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    panic!(
        "queue not drained: {:?}",
        worker.queue().stats().await.unwrap()
    );
}

mod cases {
    use super::*;

    /// Ingests `notification(i)` for every `i` at once; how many were queued
    /// (the others must be duplicates of a queued one).
    async fn ingest_at_once<Q: Queue>(queue: &Q, ids: impl Iterator<Item = usize>) -> usize {
        let tasks: Vec<_> = ids
            .map(|i| {
                let queue = queue.clone();
                tokio::spawn(async move { queue.ingest(notification(i)).await.unwrap() })
            })
            .collect();
        let mut queued = 0;
        for t in tasks {
            match t.await.unwrap() {
                Ingested::Queued(_) => queued += 1,
                Ingested::Duplicate => {}
                Ingested::Mismatch => panic!("same payload seen as a mismatch"),
                other => panic!("unexpected ingest answer: {other:?}"),
            }
        }
        queued
    }

    pub(super) async fn storm_while_upstream_down_delivers_each_once<Q: Queue>(queue: Q) {
        let upstream = Upstream::default();
        upstream.down.store(true, Ordering::SeqCst);
        // 200 notifications x 7 copies, all at once; every copy is
        // acknowledged, queued or as a duplicate of a queued one.
        let queued = ingest_at_once(&queue, (0..200 * 7).map(|n| n % 200)).await;
        assert_eq!(queued, 200);
        assert_eq!(queue.stats().await.unwrap().depth, 200);
        let svc = ServiceBuilder::new()
            .layer(ConsumerLayer::new(
                Consumer::new(MemoryStore::new()),
                message_key,
            ))
            .service(upstream.handler());
        let mut worker = Worker::new(queue.clone(), svc)
            .batch(64)
            .backoff(Duration::from_millis(5), Duration::from_millis(40));
        // The upstream is down: attempts fail, nothing runs, nothing is lost.
        for _ in 0..5 {
            worker.run_once().await.unwrap();
        }
        assert!(upstream.runs().is_empty());
        assert_eq!(queue.stats().await.unwrap().depth, 200);
        assert_eq!(queue.stats().await.unwrap().dead, 0);
        upstream.down.store(false, Ordering::SeqCst);
        drain(&mut worker).await;
        let runs = upstream.runs();
        assert_eq!(runs.len(), 200);
        assert!(runs.values().all(|&n| n == 1), "{runs:?}");
        // Late copies after delivery are still duplicates.
        assert_eq!(
            queue.ingest(notification(7)).await.unwrap(),
            Ingested::Duplicate
        );
        assert_eq!(queue.stats().await.unwrap().depth, 0);
    }

    pub(super) async fn an_order_group_is_delivered_in_order<Q: Queue>(queue: Q) {
        for i in 0..4 {
            queue.ingest(notification(i).order("tx-1")).await.unwrap();
        }
        queue.ingest(notification(10)).await.unwrap();
        let upstream = Upstream::default();
        let failed_once = Arc::new(AtomicBool::new(false));
        let inner = upstream.handler();
        let flaky = service_fn(move |m: Message| {
            // The first event fails once: the later ones of its group wait.
            let fail = m.key.ends_with("EV-0") && !failed_once.swap(true, Ordering::SeqCst);
            let mut inner = inner.clone();
            async move {
                if fail {
                    return Err(Down);
                }
                tower::Service::call(&mut inner, m).await
            }
        });
        let mut worker = Worker::new(queue.clone(), flaky)
            .backoff(Duration::from_millis(20), Duration::from_millis(20));
        drain(&mut worker).await;
        let order = upstream.order.lock().unwrap().clone();
        let group: Vec<_> = order
            .iter()
            .filter(|k| !k.ends_with("EV-10"))
            .cloned()
            .collect();
        let want: Vec<_> = (0..4).map(|i| notification(i).key).collect();
        assert_eq!(group, want);
        assert_eq!(order.len(), 5);
    }

    pub(super) async fn dead_letters_are_kept_and_replayed_once<Q: Queue>(queue: Q) {
        for i in 0..3 {
            queue.ingest(notification(i)).await.unwrap();
        }
        let upstream = Upstream::default();
        upstream.down.store(true, Ordering::SeqCst);
        let svc = ServiceBuilder::new()
            .layer(ConsumerLayer::new(
                Consumer::new(MemoryStore::new()),
                message_key,
            ))
            .service(upstream.handler());
        let mut worker = Worker::new(queue.clone(), svc)
            .max_attempts(3)
            .backoff(Duration::from_millis(1), Duration::from_millis(5));
        drain(&mut worker).await;
        let dead = queue.dead_letters(100).await.unwrap();
        assert_eq!(dead.len(), 3);
        assert!(
            dead.iter()
                .all(|d| d.attempts == 3 && d.error.contains("upstream down")),
            "{dead:?}"
        );
        assert_eq!(dead[0].message.body, notification(0).body);
        assert_eq!(dead[0].message.headers, notification(0).headers);
        assert_eq!(queue.stats().await.unwrap().dead, 3);
        // A copy arriving while it is dead is a duplicate, not a new entry.
        assert_eq!(
            queue.ingest(notification(1)).await.unwrap(),
            Ingested::Duplicate
        );
        upstream.down.store(false, Ordering::SeqCst);
        // Replay one, twice: queued once.
        assert!(queue.replay(&dead[0].id).await.unwrap());
        assert!(!queue.replay(&dead[0].id).await.unwrap());
        // Replay the rest; a second replay-all finds nothing.
        assert_eq!(queue.replay_all().await.unwrap(), 2);
        assert_eq!(queue.replay_all().await.unwrap(), 0);
        assert_eq!(queue.stats().await.unwrap().depth, 3);
        drain(&mut worker).await;
        let runs = upstream.runs();
        assert_eq!(runs.len(), 3);
        assert!(runs.values().all(|&n| n == 1), "{runs:?}");
        assert!(queue.dead_letters(100).await.unwrap().is_empty());
    }
}

macro_rules! worker_cases {
    ($name:ident, $setup:expr; $($case:ident,)*) => {
        mod $name {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $case() {
                    let Some((queue, _guard)) = ($setup) else {
                        return;
                    };
                    cases::$case(queue).await;
                }
            )*
        }
    };
}

worker_cases!(memory_queue, Some((MemoryQueue::new(), ()));
    storm_while_upstream_down_delivers_each_once,
    an_order_group_is_delivered_in_order,
    dead_letters_are_kept_and_replayed_once,
);
worker_cases!(redb_queue, {
    let dir = TempDir::new("queue-case");
    Some((RedbQueue::open(dir.file()).unwrap(), dir))
};
    storm_while_upstream_down_delivers_each_once,
    an_order_group_is_delivered_in_order,
    dead_letters_are_kept_and_replayed_once,
);
// Order groups are not enforced on Redis Streams yet (see its docs).
worker_cases!(redis_streams_queue, redis_queue().await;
    storm_while_upstream_down_delivers_each_once,
    dead_letters_are_kept_and_replayed_once,
);
// Order groups are not enforced on RabbitMQ either (see its docs).
worker_cases!(amqp_queue, amqp_queue().await;
    storm_while_upstream_down_delivers_each_once,
    dead_letters_are_kept_and_replayed_once,
);

/// The environment variable that turns this test binary into a child
/// process for the `kill -9` tests.
const CHILD: &str = "TOWER_IDEMPOTENCY_QUEUE_CHILD";

/// Not a test: the body of the child process that the `kill -9` tests
/// start (this binary again, with `CHILD` set). It does its part, says so on
/// stdout, and waits to be killed.
#[test]
fn child_process() {
    let Ok(mode) = std::env::var(CHILD) else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async move {
        let args: Vec<String> = mode.split('|').map(str::to_owned).collect();
        match args[1].as_str() {
            "redb" => child_run(RedbQueue::open(&args[2]).unwrap(), &args).await,
            name if name.starts_with("amqp-") => {
                let queue = AmqpQueue::open(&args[2], name, MemoryStore::new())
                    .await
                    .unwrap();
                child_run(queue, &args).await
            }
            "jetstream" => {
                let queue = JetStreamQueue::builder(&args[3])
                    .lease(Duration::from_secs(1))
                    .connect(&args[2])
                    .await
                    .unwrap();
                let mut rest = args.clone();
                rest.remove(3);
                child_run(queue, &rest).await
            }
            _ => {
                let queue = RedisStreamsQueue::standalone(args[2].as_str(), &args[1])
                    .await
                    .unwrap();
                child_run(queue, &args).await
            }
        }
        use std::io::Write;
        std::io::stdout().flush().unwrap();
        std::future::pending::<()>().await;
    });
}

/// `args`: mode, queue, location, [redis url, scope, runs file].
async fn child_run<Q: Queue>(queue: Q, args: &[String]) {
    match args[0].as_str() {
        // Acknowledges 50 notifications (ingest returned), then dies.
        "ingest" => {
            for i in 0..50 {
                queue.ingest(notification(i)).await.unwrap();
            }
            println!("ingested");
        }
        // Runs the handler for every entry, then dies before acknowledging.
        "handle" => {
            let store = RedisStore::standalone(args[3].as_str()).await.unwrap();
            let consumer = Consumer::new(store).scope(args[4].clone());
            let runs = args[5].clone();
            let mut handled = 0;
            while handled < 20 {
                for d in queue.fetch(100, Duration::from_secs(1)).await.unwrap() {
                    let runs = runs.clone();
                    let key = d.message.key.clone();
                    consumer
                        .once(&d.message.key, d.message.fingerprint, async move {
                            use std::io::Write;
                            let mut f = std::fs::OpenOptions::new()
                                .append(true)
                                .create(true)
                                .open(&runs)
                                .unwrap();
                            writeln!(f, "{key}").unwrap();
                            f.sync_all().unwrap();
                            Ok::<_, Down>(())
                        })
                        .await
                        .unwrap();
                    handled += 1;
                }
            }
            println!("handled");
        }
        other => panic!("unknown child mode {other}"),
    }
}

/// Starts the child, waits for its `ready` line, and kills it with SIGKILL.
fn run_child_and_kill(mode: String, ready: &str) {
    use std::io::BufRead;
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([&child_test(), "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, mode)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut seen = false;
    for line in std::io::BufReader::new(stdout).lines() {
        let line = line.unwrap();
        if line.contains(ready) {
            seen = true;
            break;
        }
    }
    // `Child::kill` sends SIGKILL on Unix: no destructor, no flush runs.
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert!(seen, "child exited before `{ready}`: {status:?}");
}

/// A queue the child opens too: its spec for the child, and an opener.
struct Spec {
    child: String,
    _dir: TempDir,
}

async fn redb_spec(tag: &str) -> (Spec, RedbQueue) {
    let dir = TempDir::new(&format!("queue-{tag}"));
    let spec = format!("redb|{}", dir.file().display());
    let queue = RedbQueue::open(dir.file()).unwrap();
    (
        Spec {
            child: spec,
            _dir: dir,
        },
        queue,
    )
}

async fn redis_spec(tag: &str, url: &str) -> (Spec, RedisStreamsQueue) {
    let name = format!("{tag}-{:x}", OwnerToken::new().as_u128());
    let queue = RedisStreamsQueue::standalone(url, &name).await.unwrap();
    let spec = format!("{name}|{url}");
    (
        Spec {
            child: spec,
            _dir: TempDir::new(&format!("queue-{tag}")),
        },
        queue,
    )
}

async fn killed_after_ack<Q: Queue>(
    spec: Spec,
    queue: Q,
    reopen: impl std::future::Future<Output = Q>,
) {
    drop(queue);
    let mode = format!("ingest|{}", spec.child);
    tokio::task::spawn_blocking(move || run_child_and_kill(mode, "ingested"))
        .await
        .unwrap();
    let queue = reopen.await;
    assert_eq!(queue.stats().await.unwrap().depth, 50);
    let upstream = Upstream::default();
    let svc = ServiceBuilder::new()
        .layer(ConsumerLayer::new(
            Consumer::new(MemoryStore::new()),
            message_key,
        ))
        .service(upstream.handler());
    let mut worker = Worker::new(queue.clone(), svc);
    drain(&mut worker).await;
    let runs = upstream.runs();
    assert_eq!(runs.len(), 50);
    assert!(runs.values().all(|&n| n == 1), "{runs:?}");
}

async fn killed_after_handler<Q: Queue>(
    spec: Spec,
    queue: Q,
    redis_url: &str,
    reopen: impl std::future::Future<Output = Q>,
) {
    for i in 0..20 {
        queue.ingest(notification(i)).await.unwrap();
    }
    drop(queue);
    let runs_file = spec._dir.path().join("runs.txt");
    let scope = format!("kill-{:x}", OwnerToken::new().as_u128());
    let mode = format!(
        "handle|{}|{redis_url}|{scope}|{}",
        spec.child,
        runs_file.display()
    );
    tokio::task::spawn_blocking(move || run_child_and_kill(mode, "handled"))
        .await
        .unwrap();
    let child_runs = std::fs::read_to_string(&runs_file).unwrap();
    assert_eq!(child_runs.lines().count(), 20);
    // The 20 entries were never acknowledged: they are delivered again once
    // their 1 s lease runs out; the consumer finds each key done, and the
    // handler does not run again.
    let queue = reopen.await;
    assert_eq!(queue.stats().await.unwrap().depth, 20);
    let store = RedisStore::standalone(redis_url).await.unwrap();
    let upstream = Upstream::default();
    let svc = ServiceBuilder::new()
        .layer(ConsumerLayer::new(
            Consumer::new(store).scope(scope),
            message_key,
        ))
        .service(upstream.handler());
    // The same lease as the child's: Redis reclaims an entry once it has
    // been idle for the reclaiming worker's lease.
    let mut worker = Worker::new(queue.clone(), svc).lease(Duration::from_secs(1));
    drain(&mut worker).await;
    assert!(upstream.runs().is_empty(), "{:?}", upstream.runs());
    assert_eq!(queue.stats().await.unwrap().depth, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redb_killed_after_ack_before_delivery_delivers_once_after_restart() {
    let (spec, queue) = redb_spec("kill").await;
    let path = spec._dir.file();
    killed_after_ack(spec, queue, async move { RedbQueue::open(&path).unwrap() }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redb_killed_after_the_handler_ran_before_ack_does_not_run_it_again() {
    let Some(server) = support_redis::shared_standalone() else {
        return;
    };
    let (spec, queue) = redb_spec("kill-handled").await;
    let path = spec._dir.file();
    killed_after_handler(spec, queue, &server.url(), async move {
        RedbQueue::open(&path).unwrap()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_after_ack_before_delivery_delivers_once_after_restart() {
    let Some(server) = support_redis::shared_standalone() else {
        return;
    };
    let (spec, queue) = redis_spec("kill", &server.url()).await;
    let name = spec.child.split('|').next().unwrap().to_owned();
    let url = server.url();
    killed_after_ack(spec, queue, async move {
        RedisStreamsQueue::standalone(url.as_str(), &name)
            .await
            .unwrap()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_redelivered_entry_does_not_run_the_handler_twice() {
    let Some(server) = support_redis::shared_standalone() else {
        return;
    };
    let (spec, queue) = redis_spec("kill-handled", &server.url()).await;
    let name = spec.child.split('|').next().unwrap().to_owned();
    let url = server.url();
    killed_after_handler(spec, queue, &server.url(), async move {
        RedisStreamsQueue::standalone(url.as_str(), &name)
            .await
            .unwrap()
    })
    .await;
}

async fn amqp_spec(tag: &str, url: &str) -> (Spec, AmqpQueue<MemoryStore>) {
    let name = format!("amqp-{tag}-{:x}", OwnerToken::new().as_u128());
    let queue = AmqpQueue::open(url, &name, MemoryStore::new())
        .await
        .unwrap();
    let spec = format!("{name}|{url}");
    (
        Spec {
            child: spec,
            _dir: TempDir::new(&format!("queue-{tag}")),
        },
        queue,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_killed_after_ack_before_delivery_delivers_once_after_restart() {
    let Some(broker) = support_rabbitmq::shared_rabbitmq() else {
        return;
    };
    let (spec, queue) = amqp_spec("kill", &broker.url()).await;
    let name = spec.child.split('|').next().unwrap().to_owned();
    let url = broker.url();
    killed_after_ack(spec, queue, async move {
        AmqpQueue::open(&url, &name, MemoryStore::new())
            .await
            .unwrap()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_redelivered_entry_does_not_run_the_handler_twice() {
    let Some(broker) = support_rabbitmq::shared_rabbitmq() else {
        return;
    };
    let Some(server) = support_redis::shared_standalone() else {
        return;
    };
    let (spec, queue) = amqp_spec("kill-handled", &broker.url()).await;
    let name = spec.child.split('|').next().unwrap().to_owned();
    let url = broker.url();
    killed_after_handler(spec, queue, &server.url(), async move {
        AmqpQueue::open(&url, &name, MemoryStore::new())
            .await
            .unwrap()
    })
    .await;
}

/// A queue of its own on the broker shared by this binary, its key
/// records in a memory store.
pub(super) async fn amqp_queue(
) -> Option<(AmqpQueue<MemoryStore>, Arc<support_rabbitmq::RabbitServer>)> {
    let broker = support_rabbitmq::shared_rabbitmq()?;
    let name = format!("case-{:x}", OwnerToken::new().as_u128());
    let queue = AmqpQueue::open(&broker.url(), &name, MemoryStore::new())
        .await
        .unwrap();
    Some((queue, broker))
}

pub(super) async fn redis_queue() -> Option<(RedisStreamsQueue, Arc<support_redis::RedisServer>)> {
    let server = support_redis::shared_standalone()?;
    let name = format!("case-{:x}", OwnerToken::new().as_u128());
    let queue = RedisStreamsQueue::standalone(server.url().as_str(), &name)
        .await
        .unwrap();
    Some((queue, server))
}

#[test]
fn queue_metrics_count_attempts_and_report_depth_age_and_dead_letters() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        rt.block_on(async {
            let queue = MemoryQueue::new();
            for i in 0..3 {
                queue.ingest(notification(i)).await.unwrap();
            }
            // EV-2 always fails; the others fail once, then succeed.
            let failed = Arc::new(Mutex::new(std::collections::HashSet::new()));
            let svc = service_fn(move |m: Message| {
                let first = failed.lock().unwrap().insert(m.key.clone());
                async move {
                    if first || m.key.ends_with("EV-2") {
                        Err(Down)
                    } else {
                        Ok(())
                    }
                }
            });
            let mut worker = Worker::new(queue.clone(), svc)
                .name("wechat")
                .max_attempts(2)
                .backoff(Duration::from_millis(1), Duration::from_millis(1));
            drain(&mut worker).await;
        })
    });
    let mut attempts: HashMap<String, u64> = HashMap::new();
    let mut gauges: HashMap<String, f64> = HashMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let key = key.key();
        let labels: HashMap<_, _> = key
            .labels()
            .map(|l| (l.key().to_owned(), l.value().to_owned()))
            .collect();
        assert_eq!(labels["queue"], "wechat");
        match value {
            DebugValue::Counter(n) if key.name() == "idempotency_queue_attempts_total" => {
                *attempts.entry(labels["result"].clone()).or_default() += n;
            }
            DebugValue::Gauge(v) => {
                gauges.insert(key.name().to_owned(), v.into_inner());
            }
            _ => {}
        }
    }
    assert_eq!(attempts.get("delivered"), Some(&2), "{attempts:?}");
    assert_eq!(attempts.get("retried"), Some(&3), "{attempts:?}");
    assert_eq!(attempts.get("dead_lettered"), Some(&1), "{attempts:?}");
    assert_eq!(
        gauges.get("idempotency_queue_depth"),
        Some(&0.0),
        "{gauges:?}"
    );
    assert_eq!(
        gauges.get("idempotency_queue_dead_letters"),
        Some(&1.0),
        "{gauges:?}"
    );
    assert_eq!(
        gauges.get("idempotency_queue_oldest_seconds"),
        Some(&0.0),
        "{gauges:?}"
    );
}

/// The embedded queue's clock never runs backwards: entries scheduled
/// while the wall clock was an hour ahead (a step back since) are not
/// delayed by that hour. The step is simulated by writing the queue's own
/// clock an hour ahead, as the run before the step left it, with a lease
/// that ends a moment after that.
#[tokio::test]
async fn a_wall_clock_step_back_does_not_delay_leased_entries() {
    const STATE: redb::TableDefinition<'_, u64, &[u8]> = redb::TableDefinition::new("state");
    const META: redb::TableDefinition<'_, &str, u64> = redb::TableDefinition::new("meta");
    let dir = TempDir::new("clock-step");
    let path = dir.path().join("queue.redb");
    {
        let queue = RedbQueue::open(&path).unwrap();
        let fp = Fingerprint::of(b"x");
        queue
            .ingest(Message::new("stepped", fp, "x"))
            .await
            .unwrap();
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let ahead = now + 3_600_000;
    {
        let db = redb::Database::create(&path).unwrap();
        let txn = db.begin_write().unwrap();
        {
            use redb::ReadableTable;
            let mut state = txn.open_table(STATE).unwrap();
            let (id, mut s) = {
                let (k, v) = state.first().unwrap().unwrap();
                (k.value(), v.value().to_vec())
            };
            // Leased an hour ahead, for 300 ms.
            s[..4].copy_from_slice(&1u32.to_le_bytes());
            s[4..12].copy_from_slice(&(ahead + 300).to_le_bytes());
            s[12..20].copy_from_slice(&7u64.to_le_bytes());
            state.insert(id, s.as_slice()).unwrap();
            txn.open_table(META)
                .unwrap()
                .insert("clock", ahead)
                .unwrap();
        }
        txn.commit().unwrap();
    }
    let queue = RedbQueue::open(&path).unwrap();
    let mut got = Vec::new();
    for _ in 0..50 {
        got = queue.fetch(10, Duration::from_secs(30)).await.unwrap();
        if !got.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(got.len(), 1, "the lease ran out 300 ms after the step");
    assert_eq!(got[0].attempt, 2);
}

/// A reserve larger than any disk: ingests are refused with an unwritable
/// error and nothing is stored; fetches and settlements still work, and
/// lowering the reserve stores again.
#[tokio::test]
async fn the_redb_queue_refuses_ingests_under_its_reserve_and_says_so() {
    let dir = TempDir::new("queue-reserve");
    let queue = RedbQueue::open(dir.file()).unwrap();
    queue.ingest(notification(1)).await.unwrap();
    let stats = queue.stats().await.unwrap();
    assert_eq!((stats.writable, stats.write_errors), (Some(true), 0));
    let queue = queue.reserve(u64::MAX);
    let e = queue.ingest(notification(2)).await.unwrap_err();
    assert!(e.is_unwritable(), "{e}");
    assert!(e.to_string().contains("reserve"), "{e}");
    assert!(!queue.writable());
    let stats = queue.stats().await.unwrap();
    assert_eq!((stats.depth, stats.writable), (1, Some(false)));
    // What is queued is still delivered and settled.
    let batch = queue.fetch(8, Duration::from_secs(30)).await.unwrap();
    assert_eq!(batch.len(), 1);
    assert!(queue.ack(&batch[0]).await.unwrap());
    let queue = queue.reserve(0);
    assert!(queue.writable());
    let got = queue.ingest(notification(2)).await.unwrap();
    assert!(matches!(got, Ingested::Queued(_)), "{got:?}");
    // In memory, a queue can always write.
    let stats = MemoryQueue::new().stats().await.unwrap();
    assert_eq!((stats.writable, stats.write_errors), (Some(true), 0));
}

/// The breaker two instances share on a Redis Streams queue: one's votes
/// open it for the other, the half-open probes are counted across both and
/// leased (an instance that died mid-probe holds its place only until the
/// lease runs out), a fresh probe failing opens it again, one delivered
/// closes it for both, and a minority failing never opens it.
#[tokio::test]
async fn redis_shared_breaker_judges_for_every_instance_and_leases_its_probes() {
    use tower_idempotency_queue::{BreakerRule, BreakerState};
    let Some(server) = support_redis::shared_standalone() else {
        eprintln!("skipped: no redis-server");
        return;
    };
    let name = format!("breaker-{:x}", OwnerToken::new().as_u128());
    let open = || RedisStreamsQueue::standalone(server.url(), &name);
    let (a, b) = (open().await.unwrap(), open().await.unwrap());
    let cooldown = Duration::from_millis(300);
    let rule = BreakerRule::new(2, cooldown, 3);
    let lease = Duration::from_millis(400);
    let lane = "/wx";
    assert_eq!(
        a.breaker_state(lane).await.unwrap(),
        Some(BreakerState::Closed)
    );
    let first = a.breaker_vote(lane, 1, false, rule).await.unwrap();
    assert_eq!(
        first,
        Some(BreakerState::Closed),
        "one failure of two needed"
    );
    let opened = a.breaker_vote(lane, 2, false, rule).await.unwrap();
    assert!(matches!(opened, Some(BreakerState::Open(_))), "{opened:?}");
    // The other instance sees it open, and its votes change nothing.
    assert!(matches!(
        b.breaker_state(lane).await.unwrap(),
        Some(BreakerState::Open(_))
    ));
    let voted = b.breaker_vote(lane, 3, true, rule).await.unwrap();
    assert!(matches!(voted, Some(BreakerState::Open(_))), "{voted:?}");
    assert!(matches!(
        b.take_probe(lane, rule, lease).await.unwrap(),
        Some(BreakerState::Open(_))
    ));
    tokio::time::sleep(cooldown + Duration::from_millis(50)).await;
    assert_eq!(
        b.breaker_state(lane).await.unwrap(),
        Some(BreakerState::HalfOpen)
    );
    // Three probes across both instances, then none.
    let mut probes = Vec::new();
    for q in [&a, &a, &b] {
        match q.take_probe(lane, rule, lease).await.unwrap() {
            Some(BreakerState::Probe(id)) => probes.push(id),
            other => panic!("no probe: {other:?}"),
        }
    }
    for q in [&a, &b] {
        let out = q.take_probe(lane, rule, lease).await.unwrap();
        assert_eq!(out, Some(BreakerState::ProbesOut));
    }
    // One that says nothing gives its place back.
    let given = b
        .settle_probe(lane, probes[2], None, true, rule)
        .await
        .unwrap();
    assert_eq!(given, Some(BreakerState::HalfOpen));
    let Some(BreakerState::Probe(_)) = b.take_probe(lane, rule, lease).await.unwrap() else {
        panic!("the place given back was not taken");
    };
    // `a` dies with its two probes, `b` with its one: their leases run out,
    // and the probes go to whoever asks next.
    tokio::time::sleep(lease + Duration::from_millis(50)).await;
    let late = a
        .settle_probe(lane, probes[0], Some(false), true, rule)
        .await
        .unwrap();
    assert_eq!(
        late,
        Some(BreakerState::HalfOpen),
        "a probe past its lease settles nothing"
    );
    let Some(BreakerState::Probe(fresh)) = b.take_probe(lane, rule, lease).await.unwrap() else {
        panic!("the expired probes' places were not given to another");
    };
    // A probe that had not failed before fails: open again.
    let again = b
        .settle_probe(lane, fresh, Some(false), true, rule)
        .await
        .unwrap();
    assert!(matches!(again, Some(BreakerState::Open(_))), "{again:?}");
    tokio::time::sleep(cooldown + Duration::from_millis(50)).await;
    let Some(BreakerState::Probe(ok)) = a.take_probe(lane, rule, lease).await.unwrap() else {
        panic!("no probe after the second cooldown");
    };
    let closed = a
        .settle_probe(lane, ok, Some(true), true, rule)
        .await
        .unwrap();
    assert_eq!(closed, Some(BreakerState::Closed));
    assert_eq!(
        b.breaker_state(lane).await.unwrap(),
        Some(BreakerState::Closed)
    );
    // Closed afresh: a minority failing, however often, never opens it.
    for e in 10..30u64 {
        b.breaker_vote(lane, e, true, rule).await.unwrap();
    }
    for _ in 0..5 {
        for e in 10..15u64 {
            let got = a.breaker_vote(lane, e, false, rule).await.unwrap();
            assert_eq!(got, Some(BreakerState::Closed), "5 failed of 20");
        }
    }
    // Another lane's breaker is its own.
    assert_eq!(
        a.breaker_state("/other").await.unwrap(),
        Some(BreakerState::Closed)
    );
}

// Order groups are not enforced on JetStream either (see its docs).
worker_cases!(jetstream_queue, jetstream_queue().await;
    storm_while_upstream_down_delivers_each_once,
    dead_letters_are_kept_and_replayed_once,
);

/// A queue of its own on the binary's shared `nats-server -js`.
async fn jetstream_queue() -> Option<(JetStreamQueue, Arc<support_nats::NatsServer>)> {
    let server = support_nats::shared()?;
    let name = format!("case-{:x}", OwnerToken::new().as_u128());
    let queue = JetStreamQueue::connect(&server.url(), &name).await.unwrap();
    Some((queue, server))
}

async fn jetstream_spec(tag: &str, url: &str) -> (Spec, JetStreamQueue, String) {
    let name = format!("{tag}-{:x}", OwnerToken::new().as_u128());
    let queue = jetstream_open(url, &name).await;
    let spec = format!("jetstream|{url}|{name}");
    (
        Spec {
            child: spec,
            _dir: TempDir::new(&format!("queue-{tag}")),
        },
        queue,
        name,
    )
}

/// The lease of the child's: the consumer's ack wait is one setting.
pub(super) async fn jetstream_open(url: &str, name: &str) -> JetStreamQueue {
    JetStreamQueue::builder(name)
        .lease(Duration::from_secs(1))
        .connect(url)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_killed_after_ack_before_delivery_delivers_once_after_restart() {
    let Some(server) = support_nats::shared() else {
        return;
    };
    let (spec, queue, name) = jetstream_spec("kill", &server.url()).await;
    let url = server.url();
    killed_after_ack(
        spec,
        queue,
        async move { jetstream_open(&url, &name).await },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_redelivered_entry_does_not_run_the_handler_twice() {
    let Some(server) = support_nats::shared() else {
        return;
    };
    let Some(redis) = support_redis::shared_standalone() else {
        return;
    };
    let (spec, queue, name) = jetstream_spec("kill-handled", &server.url()).await;
    let url = server.url();
    killed_after_handler(spec, queue, &redis.url(), async move {
        jetstream_open(&url, &name).await
    })
    .await;
}

/// A delivery held past the consumer's ack wait without renewal, its
/// message handed to another worker meanwhile: every settlement of the
/// first holder reports the lease lost (`false`), as on redb and Redis
/// Streams, and changes nothing (no ack, nak, term, dead letter or copy of
/// an entry another worker holds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_late_settlements_report_the_lost_lease() {
    let Some(server) = support_nats::shared() else {
        return;
    };
    let name = format!("late-{:x}", OwnerToken::new().as_u128());
    let first = jetstream_open(&server.url(), &name).await;
    let second = jetstream_open(&server.url(), &name).await;
    for i in 0..5 {
        first.ingest(notification(i)).await.unwrap();
    }
    let lease = Duration::from_secs(1);
    let mut held = Vec::new();
    while held.len() < 5 {
        held.extend(first.fetch(5 - held.len(), lease).await.unwrap());
    }
    // Past the ack wait, unrenewed: JetStream hands every entry out again.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut again = Vec::new();
    for _ in 0..100 {
        again.extend(second.fetch(5, lease).await.unwrap());
        if again.len() >= 5 {
            break;
        }
    }
    assert_eq!(again.len(), 5, "redelivered to the second worker");
    assert!(again.iter().all(|d| d.attempt == 2), "a second attempt");
    let renewed = first.renew(&held[0], lease).await.unwrap();
    assert!(!renewed, "renew (in progress) after the lease was lost");
    let acked = first.ack(&held[1]).await.unwrap();
    assert!(!acked, "ack after the lease was lost");
    let retried = first.retry(&held[2], lease, "late").await.unwrap();
    assert!(!retried, "retry (nak) after the lease was lost");
    let buried = first.dead_letter(&held[3], "late").await.unwrap();
    assert!(!buried, "dead letter (term) after the lease was lost");
    let postponed = first.postpone(&held[4], lease, "late").await.unwrap();
    assert!(!postponed, "postpone after the lease was lost");
    // The second worker's settlements hold; nothing was added or buried.
    for d in &again {
        assert!(second.ack(d).await.unwrap(), "the holder's ack");
    }
    let stats = second.stats().await.unwrap();
    assert_eq!((stats.depth, stats.dead), (0, 0), "{stats:?}");
    // The second holder's ack stands: every key was delivered once.
    for i in 0..5 {
        assert!(second.forget(&notification(i).key).await.unwrap());
    }
}

/// A replay racing the delivery of the entry it put back: whichever
/// settles first, the key's marker ends as delivered (the replay's
/// "queued" is never written over the delivery), so `forget` is not
/// refused for a key nothing holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn jetstream_a_replay_racing_its_delivery_leaves_the_key_delivered() {
    let Some(server) = support_nats::shared() else {
        return;
    };
    let name = format!("replay-race-{:x}", OwnerToken::new().as_u128());
    let queue = jetstream_open(&server.url(), &name).await;
    let n = 24;
    for i in 0..n {
        queue.ingest(notification(i)).await.unwrap();
    }
    let mut buried = 0;
    while buried < n {
        for d in queue.fetch(n, Duration::from_secs(1)).await.unwrap() {
            assert!(queue.dead_letter(&d, "down").await.unwrap());
            buried += 1;
        }
    }
    // A worker on another connection takes every entry the moment it is
    // stored, and acknowledges it.
    let worker = jetstream_open(&server.url(), &name).await;
    let stop = Arc::new(AtomicBool::new(false));
    let taker = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut acked = 0;
            while !stop.load(Ordering::SeqCst) {
                for d in worker.fetch(8, Duration::from_secs(1)).await.unwrap() {
                    assert!(worker.ack(&d).await.unwrap());
                    acked += 1;
                }
            }
            acked
        })
    };
    let letters = queue.dead_letters(n).await.unwrap();
    assert_eq!(letters.len(), n);
    for letter in &letters {
        assert!(queue.replay(&letter.id).await.unwrap());
    }
    for _ in 0..500 {
        if queue.stats().await.unwrap().depth == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.store(true, Ordering::SeqCst);
    assert_eq!(
        taker.await.unwrap(),
        n,
        "each replayed entry delivered once"
    );
    for i in 0..n {
        let key = notification(i).key;
        let forgot = queue.forget(&key).await;
        assert!(
            matches!(forgot, Ok(true)),
            "key {i}: delivered, yet forget says {forgot:?}"
        );
    }
}

/// A memory store that stops between a `forget` and the next call, once
/// armed: a copy ingested meanwhile arrives in the middle of a record
/// rewritten as several store calls.
#[derive(Clone, Default)]
struct Stalled {
    inner: MemoryStore,
    gate: Arc<Gate>,
}

#[derive(Default)]
struct Gate {
    armed: AtomicBool,
    reached: tokio::sync::Notify,
    open: tokio::sync::Notify,
}

impl tower_idempotency::store::Store for Stalled {
    async fn claim(
        &self,
        key: &str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<tower_idempotency::store::Claim, tower_idempotency::store::StoreError> {
        self.inner.claim(key, fingerprint, token, lease).await
    }

    async fn complete(
        &self,
        key: &str,
        token: OwnerToken,
        record: Arc<tower_idempotency::store::CompletedRecord>,
        window: Duration,
    ) -> Result<bool, tower_idempotency::store::StoreError> {
        self.inner.complete(key, token, record, window).await
    }

    async fn renew(
        &self,
        key: &str,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<bool, tower_idempotency::store::StoreError> {
        self.inner.renew(key, token, lease).await
    }

    async fn release(
        &self,
        key: &str,
        token: OwnerToken,
    ) -> Result<bool, tower_idempotency::store::StoreError> {
        self.inner.release(key, token).await
    }

    async fn replace(
        &self,
        key: &str,
        record: Arc<tower_idempotency::store::CompletedRecord>,
        window: Duration,
    ) -> Result<bool, tower_idempotency::store::StoreError> {
        self.inner.replace(key, record, window).await
    }

    async fn forget(
        &self,
        key: &str,
    ) -> Result<tower_idempotency::store::Forgotten, tower_idempotency::store::StoreError> {
        let forgot = self.inner.forget(key).await;
        if self.gate.armed.swap(false, Ordering::SeqCst) {
            self.gate.reached.notify_one();
            self.gate.open.notified().await;
        }
        forgot
    }
}

#[derive(Clone, Copy, Debug)]
enum StateChange {
    Delivered,
    DeadLettered,
    Replayed,
}

/// A copy of a key arriving while its record changes state (delivered,
/// dead-lettered, replayed) is a duplicate: the record never lets go of
/// the key in between.
async fn amqp_copy_racing_a_state_change_is_a_duplicate(change: StateChange) {
    let Some(broker) = support_rabbitmq::shared_rabbitmq() else {
        return;
    };
    let store = Stalled::default();
    let name = format!("race-{:x}", OwnerToken::new().as_u128());
    let queue = AmqpQueue::open(&broker.url(), &name, store.clone())
        .await
        .unwrap();
    assert!(matches!(
        queue.ingest(notification(1)).await.unwrap(),
        Ingested::Queued(_)
    ));
    let delivery = queue
        .fetch(1, Duration::from_secs(30))
        .await
        .unwrap()
        .pop()
        .expect("the entry is due");
    if let StateChange::Replayed = change {
        assert!(queue.dead_letter(&delivery, "refused").await.unwrap());
    }
    store.gate.armed.store(true, Ordering::SeqCst);
    let changing = {
        let queue = queue.clone();
        tokio::spawn(async move {
            match change {
                StateChange::Delivered => queue.ack(&delivery).await.unwrap(),
                StateChange::DeadLettered => queue.dead_letter(&delivery, "refused").await.unwrap(),
                StateChange::Replayed => queue.replay_all().await.unwrap() == 1,
            }
        })
    };
    // The copy arrives in the middle of the state change's store calls
    // (or right after it, when the change is one call).
    let mut changing = std::pin::pin!(changing);
    let done = tokio::select! {
        _ = store.gate.reached.notified() => None,
        done = &mut changing => Some(done.unwrap()),
    };
    let copy = queue.ingest(notification(1)).await.unwrap();
    store.gate.open.notify_one();
    let done = match done {
        Some(done) => done,
        None => changing.await.unwrap(),
    };
    assert!(done, "{change:?}: the state change happened");
    assert_eq!(
        copy,
        Ingested::Duplicate,
        "{change:?}: a copy arriving while the record changed was queued again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn amqp_a_copy_racing_the_delivered_record_is_a_duplicate() {
    amqp_copy_racing_a_state_change_is_a_duplicate(StateChange::Delivered).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn amqp_a_copy_racing_the_dead_letter_record_is_a_duplicate() {
    amqp_copy_racing_a_state_change_is_a_duplicate(StateChange::DeadLettered).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn amqp_a_copy_racing_the_replayed_record_is_a_duplicate() {
    amqp_copy_racing_a_state_change_is_a_duplicate(StateChange::Replayed).await;
}

/// 500 notifications ingested at once by two serving threads, each its own
/// current-thread runtime (as the gateway runs them) and busy (32 tasks
/// that compute for a millisecond between yields, as in a storm): every one
/// is queued. Callers on a live connection must not queue up behind one
/// lock, each handing it to the next through the other thread's busy
/// scheduler, until the last have waited past the bound on one exchange
/// and get "still connecting" (as 8 of 500 copies did through the gateway).
#[test]
fn amqp_ingests_at_once_on_two_busy_serving_threads_are_all_queued() {
    // Kept until the end: what the queue started on it lives there.
    let setup = tokio::runtime::Runtime::new().unwrap();
    let opened = setup.block_on(amqp_queue());
    let Some((queue, _broker)) = opened else {
        return;
    };
    let start = Arc::new(std::sync::Barrier::new(2));
    let threads: Vec<_> = (0..2)
        .map(|t| {
            let (queue, start) = (queue.clone(), start.clone());
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async move {
                    let stop = Arc::new(AtomicBool::new(false));
                    start.wait();
                    let busy: Vec<_> = (0..32)
                        .map(|_| {
                            let stop = stop.clone();
                            tokio::spawn(async move {
                                while !stop.load(Ordering::Relaxed) {
                                    let until =
                                        std::time::Instant::now() + Duration::from_millis(1);
                                    while std::time::Instant::now() < until {
                                        std::hint::spin_loop();
                                    }
                                    tokio::task::yield_now().await;
                                }
                            })
                        })
                        .collect();
                    let ingests: Vec<_> = (0..250)
                        .map(|i| {
                            let queue = queue.clone();
                            tokio::spawn(
                                async move { queue.ingest(notification(t * 250 + i)).await },
                            )
                        })
                        .collect();
                    let mut failed = Vec::new();
                    for ingest in ingests {
                        match ingest.await.unwrap() {
                            Ok(Ingested::Queued(_)) => {}
                            other => failed.push(format!("{other:?}")),
                        }
                    }
                    stop.store(true, Ordering::Relaxed);
                    for task in busy {
                        task.await.unwrap();
                    }
                    failed
                })
            })
        })
        .collect();
    let failed: Vec<String> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    assert!(
        failed.is_empty(),
        "{} of 500 ingests not queued, the first: {}",
        failed.len(),
        failed[0]
    );
}

/// The full name of this file's `child_process` test, as the test binary
/// takes it (`--exact`): its module path without the binary's name.
fn child_test() -> String {
    let module = module_path!().split_once("::").map_or("", |(_, m)| m);
    format!("{module}::child_process")
}

/// Redis Streams: entries parked by two instances under one prefix are
/// woken by both at once, each put back once (one wake finds them all, the
/// other none); they count in the depth while parked, and after the wake
/// each is fetched once, its parked attempt not counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_parked_entries_woken_from_two_instances_come_back_once() {
    use tower_idempotency_queue::Park;
    let Some((_, server)) = redis_queue().await else {
        return;
    };
    // Two instances on one queue.
    let name = format!("case-{:x}", OwnerToken::new().as_u128());
    let url = server.url();
    let a = RedisStreamsQueue::standalone(url.as_str(), &name)
        .await
        .unwrap();
    let b = RedisStreamsQueue::standalone(url.as_str(), &name)
        .await
        .unwrap();
    const N: usize = 60;
    for i in 0..N {
        let key = format!("park-{i}");
        let m = Message::new(&key, Fingerprint::of(key.as_bytes()), "{}");
        assert!(matches!(a.ingest(m).await.unwrap(), Ingested::Queued(_)));
    }
    let lease = Duration::from_secs(30);
    let (mut parked, mut fetched) = (0, 0);
    while fetched < N {
        for q in [&a, &b] {
            for d in q.fetch(10, lease).await.unwrap() {
                fetched += 1;
                parked += usize::from(q.park(&d, "/wx").await.unwrap() == Some(true));
            }
        }
    }
    assert_eq!(parked, N);
    assert_eq!(a.stats().await.unwrap().depth, N as u64);
    assert_eq!(b.parked().await.unwrap(), ["/wx"]);
    assert!(a.fetch(100, lease).await.unwrap().is_empty());
    let (wa, wb) = tokio::join!(a.wake("/wx"), b.wake("/wx"));
    assert_eq!(wa.unwrap() + wb.unwrap(), N as u64, "woken twice or lost");
    assert!(a.parked().await.unwrap().is_empty());
    let mut keys = std::collections::HashSet::new();
    for _ in 0..20 {
        for q in [&a, &b] {
            for d in q.fetch(100, lease).await.unwrap() {
                assert_eq!(d.attempt, 1, "the parked attempt counted");
                assert!(
                    keys.insert(d.message.key.clone()),
                    "twice: {}",
                    d.message.key
                );
                assert!(q.ack(&d).await.unwrap());
            }
        }
        if keys.len() == N {
            break;
        }
    }
    assert_eq!(keys.len(), N);
    assert_eq!(a.stats().await.unwrap().depth, 0);
}

/// Redis Streams: a large parked backlog is woken in bounded steps, each
/// entry once and in the order it was queued, and Redis answers other
/// clients while it is woken (another client sees the stream grow part of
/// the way, not all at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_parked_backlog_is_woken_in_steps_in_order() {
    use tower_idempotency_queue::Park;
    let Some((_, server)) = redis_queue().await else {
        return;
    };
    let name = format!("case-{:x}", OwnerToken::new().as_u128());
    let queue = RedisStreamsQueue::standalone(server.url().as_str(), &name)
        .await
        .unwrap();
    const N: usize = 4000;
    let body = "x".repeat(1500);
    for i in 0..N {
        let key = format!("backlog-{i:05}");
        let m = Message::new(&key, Fingerprint::of(key.as_bytes()), body.clone());
        assert!(matches!(
            queue.ingest(m).await.unwrap(),
            Ingested::Queued(_)
        ));
    }
    let lease = Duration::from_secs(30);
    let mut parked = 0;
    while parked < N {
        let taken = queue.fetch(200, lease).await.unwrap();
        assert!(!taken.is_empty());
        for d in taken {
            assert_eq!(queue.park(&d, "/wx").await.unwrap(), Some(true));
            parked += 1;
        }
    }
    // Another client watches the stream's length while the backlog wakes.
    let stream = format!("{{{name}}}:s");
    let client = redis::Client::open(server.url().as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let watcher = {
        let done = done.clone();
        tokio::spawn(async move {
            let mut seen = Vec::new();
            while !done.load(Ordering::SeqCst) {
                let len: usize = redis::cmd("XLEN")
                    .arg(&stream)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                seen.push(len);
            }
            seen
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let woken = queue.wake("/wx").await.unwrap();
    done.store(true, Ordering::SeqCst);
    let seen = watcher.await.unwrap();
    assert_eq!(woken, N as u64);
    assert!(
        seen.iter().any(|&len| len > 0 && len < N),
        "woken in one step: the watcher saw only {:?}",
        seen.iter().collect::<std::collections::BTreeSet<_>>()
    );
    assert!(queue.parked().await.unwrap().is_empty());
    assert_eq!(queue.wake("/wx").await.unwrap(), 0, "woken twice");
    let mut keys = Vec::new();
    while keys.len() < N {
        let taken = queue.fetch(500, lease).await.unwrap();
        assert!(!taken.is_empty(), "lost: {} of {N} came back", keys.len());
        for d in taken {
            assert_eq!(d.attempt, 1, "the parked attempt counted");
            keys.push(d.message.key.clone());
            assert!(queue.ack(&d).await.unwrap());
        }
    }
    let want: Vec<String> = (0..N).map(|i| format!("backlog-{i:05}")).collect();
    assert_eq!(keys, want, "out of order or twice");
    assert_eq!(queue.stats().await.unwrap().depth, 0);
}

/// Redis Streams: entries parked by an earlier version (in the prefix's
/// hash, with no order kept) are still woken, each once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_entries_parked_by_an_earlier_version_are_woken() {
    use tower_idempotency_queue::Park;
    let Some((_, server)) = redis_queue().await else {
        return;
    };
    let name = format!("case-{:x}", OwnerToken::new().as_u128());
    let queue = RedisStreamsQueue::standalone(server.url().as_str(), &name)
        .await
        .unwrap();
    for i in 0..5 {
        let key = format!("old-{i}");
        let m = Message::new(&key, Fingerprint::of(key.as_bytes()), "{}");
        queue.ingest(m).await.unwrap();
    }
    let lease = Duration::from_secs(30);
    for d in queue.fetch(10, lease).await.unwrap() {
        assert_eq!(queue.park(&d, "/old").await.unwrap(), Some(true));
    }
    // As an earlier version left them: no order.
    let client = redis::Client::open(server.url().as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("DEL")
        .arg(format!("{{{name}}}:parko:/old"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(queue.wake("/old").await.unwrap(), 5);
    assert!(queue.parked().await.unwrap().is_empty());
    assert_eq!(queue.wake("/old").await.unwrap(), 0, "woken twice");
    let keys: Vec<String> = (queue.fetch(10, lease).await.unwrap().iter())
        .map(|d| d.message.key.clone())
        .collect();
    let want: Vec<String> = (0..5).map(|i| format!("old-{i}")).collect();
    assert_eq!(keys, want);
}

/// Redis Streams, sealed: a copy of a delivered entry written back into
/// the stream once the queue's max age has passed reaches no upstream: it
/// is dead-lettered as `expired`. Replayed, it is sealed afresh and
/// delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_sealed_copy_written_back_late_is_expired_and_a_replay_delivers_it() {
    use tower_idempotency_queue::{QueueKey, Sealed};
    let Some((_, server)) = redis_queue().await else {
        return;
    };
    let name = format!("case-{:x}", OwnerToken::new().as_u128());
    let inner = RedisStreamsQueue::standalone(server.url().as_str(), &name)
        .await
        .unwrap();
    let key = QueueKey::new(&[9; 32]).unwrap();
    let queue = Sealed::new(inner, key, "q").max_age(Duration::from_secs(1));
    assert!(matches!(
        queue.ingest(notification(0)).await.unwrap(),
        Ingested::Queued(_)
    ));
    // What anyone who can read the stream sees of the entry: its bytes.
    let client = redis::Client::open(server.url().as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let stream = format!("{{{name}}}:s");
    let rows: Vec<(String, HashMap<String, Vec<u8>>)> = redis::cmd("XRANGE")
        .arg(&stream)
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .unwrap();
    let sealed = rows[0].1["m"].clone();
    let upstream = Upstream::default();
    let mut worker = Worker::new(queue.clone(), upstream.handler())
        .max_attempts(3)
        .backoff(Duration::from_millis(1), Duration::from_millis(5));
    drain(&mut worker).await;
    let key = notification(0).key;
    assert_eq!(upstream.runs().get(&key), Some(&1));
    // Past the max age, the copy is written back.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let _: String = redis::cmd("XADD")
        .arg(&stream)
        .arg("*")
        .arg("m")
        .arg(sealed)
        .arg("a")
        .arg("0")
        .arg("t")
        .arg("0")
        .query_async(&mut conn)
        .await
        .unwrap();
    drain(&mut worker).await;
    assert_eq!(
        upstream.runs().get(&key),
        Some(&1),
        "an old copy written back was delivered again"
    );
    let dead = queue.dead_letters(10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].error, tower_idempotency_queue::EXPIRED);
    // An operator's replay seals it afresh: delivered.
    assert!(queue.replay(&dead[0].id).await.unwrap());
    drain(&mut worker).await;
    assert_eq!(upstream.runs().get(&key), Some(&2));
    assert!(queue.dead_letters(10).await.unwrap().is_empty());
}
