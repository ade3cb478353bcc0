//! Ingest and delivery numbers of the durable queues: how many
//! notifications per second are acknowledged (ingest returned, so the entry
//! is durable), how many per second are delivered, and how many bytes one
//! queued notification takes.
//!
//! ```text
//! cargo run --release --example queue_bench -- [--n 2000] [--concurrency 64] [--rounds 1] [--redis URL] [--amqp URL] [--nats URL]
//! ```
//!
//! Every backend given runs in one invocation, in `--rounds` interleaved
//! rounds (round `r` starts with the `r`-th backend, so none always runs
//! first or last on a busy machine); each round uses a fresh queue. At the
//! end, a table of each backend's median over the rounds and its ratio to
//! the embedded queue measured in the same rounds.
//!
//! Each notification is the WeChat Pay v3 payment notification of
//! `tests/fixtures` (382 bytes) under its own id, with the five headers
//! WeChat Pay sends (a 344-character signature among them). The embedded
//! queue (`RedbQueue`) is measured in a fresh file under the system temp
//! directory: one ingest at a time (each its own fsynced commit), then
//! `--concurrency` at once (group commits). Bytes per notification are the
//! growth of the allocated pages (`RedbQueue::allocated_bytes`) over the
//! first `--n` ingests, divided by `--n`. With `--redis`, the same for
//! `RedisStreamsQueue`, whose bytes are the growth of Redis' `used_memory`.
//! With `--nats`, the same for `JetStreamQueue` (a JetStream server with
//! file storage), whose bytes are the growth of its entries' stream and key
//! markers' bucket (the streams' `bytes`). With `--amqp`, the same for
//! `AmqpQueue` on that RabbitMQ (its key records in a memory store; bytes
//! are not measured).

use std::sync::Arc;
use std::time::Instant;
use tower::service_fn;
use tower_idempotency::store::{MemoryStore, OwnerToken};
use tower_idempotency::Fingerprint;
use tower_idempotency_queue::{
    AmqpQueue, JetStreamQueue, Message, Queue, RedbQueue, RedisStreamsQueue, Worker,
};

const BODY: &str =
    include_str!("../../crates/tower-idempotency/tests/fixtures/wechatpay_v3_notify_official_doc_transaction_success.json");

fn notification(run: &str, i: usize) -> Message {
    let id = format!("EV-{run}-{i}");
    let body = BODY.replacen("EV-2018022511223320873", &id, 1);
    let mut m = Message::new(
        format!("wechatpay-v3:/notify/wechat:{id}"),
        Fingerprint::of(format!("TRANSACTION.SUCCESS transaction {id}").as_bytes()),
        body,
    );
    m.uri = http::Uri::from_static("/notify/wechat");
    let h = &mut m.headers;
    h.insert("content-type", "application/json".parse().unwrap());
    h.insert(
        "wechatpay-serial",
        "5157F09EFDC096DE15EBE81A47057A7232F1B8E1".parse().unwrap(),
    );
    h.insert("wechatpay-timestamp", "1700000000".parse().unwrap());
    h.insert("wechatpay-nonce", "fdasflkja484w".parse().unwrap());
    h.insert("wechatpay-signature", "A".repeat(344).parse().unwrap());
    m
}

struct Args {
    n: usize,
    concurrency: usize,
    rounds: usize,
    redis: Option<String>,
    amqp: Option<String>,
    nats: Option<String>,
}

fn args() -> Args {
    let mut a = Args {
        n: 2000,
        concurrency: 64,
        rounds: 1,
        redis: None,
        amqp: None,
        nats: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .unwrap_or_else(|| usage(&format!("{flag} needs a value")))
        };
        match flag.as_str() {
            "--n" => {
                a.n = value()
                    .parse()
                    .unwrap_or_else(|_| usage("--n takes a number"))
            }
            "--concurrency" => {
                a.concurrency = value()
                    .parse()
                    .unwrap_or_else(|_| usage("--concurrency takes a number"))
            }
            "--rounds" => {
                a.rounds = value()
                    .parse()
                    .unwrap_or_else(|_| usage("--rounds takes a number"))
            }
            "--redis" => a.redis = Some(value()),
            "--amqp" => a.amqp = Some(value()),
            "--nats" => a.nats = Some(value()),
            other => usage(&format!("unknown flag {other}")),
        }
    }
    a
}

fn usage(msg: &str) -> ! {
    eprintln!("queue_bench: {msg}\nusage: queue_bench [--n N] [--concurrency C] [--rounds R] [--redis URL] [--amqp URL] [--nats URL]");
    std::process::exit(2)
}

async fn ingest_all<Q: Queue>(queue: &Q, run: &str, n: usize, concurrency: usize) -> f64 {
    let start = Instant::now();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let tasks: Vec<_> = (0..concurrency.max(1))
        .map(|_| {
            let (queue, next, run) = (queue.clone(), next.clone(), run.to_owned());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= n {
                        return;
                    }
                    queue.ingest(notification(&run, i)).await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    n as f64 / start.elapsed().as_secs_f64()
}

async fn deliver_all<Q: Queue>(queue: &Q) -> (usize, f64) {
    let mut worker = Worker::new(
        queue.clone(),
        service_fn(|_m: Message| async { Ok::<_, std::convert::Infallible>(()) }),
    )
    .batch(256);
    let start = Instant::now();
    let mut delivered = 0;
    loop {
        let round = worker.run_once().await.unwrap();
        if round.fetched == 0 {
            break;
        }
        delivered += round.delivered;
    }
    (delivered, delivered as f64 / start.elapsed().as_secs_f64())
}

/// One backend's numbers in one round.
#[derive(Clone, Copy, Default)]
struct Numbers {
    seq: f64,
    conc: f64,
    bytes: Option<f64>,
    delivered: usize,
    rate: f64,
}

async fn bench<Q: Queue, F: std::future::Future<Output = Option<u64>>>(
    label: &str,
    queue: Q,
    a: &Args,
    size: impl Fn() -> F,
) -> Numbers {
    let run = format!("{:x}", OwnerToken::new().as_u128());
    let before = size().await;
    let seq = ingest_all(&queue, &format!("{run}-s"), a.n, 1).await;
    let bytes = match (before, size().await) {
        (Some(b), Some(after)) => Some(after.saturating_sub(b) as f64 / a.n as f64),
        _ => None,
    };
    let conc = ingest_all(&queue, &format!("{run}-c"), a.n, a.concurrency).await;
    let (delivered, rate) = deliver_all(&queue).await;
    let per = bytes.map_or_else(|| "n/a".to_owned(), |b| format!("{b:.0}"));
    println!(
        "{label}: ingest {seq:.0}/s one at a time, {conc:.0}/s at concurrency {}; \
         {per} bytes per queued notification; delivered {delivered} at {rate:.0}/s",
        a.concurrency,
    );
    Numbers {
        seq,
        conc,
        bytes,
        delivered,
        rate,
    }
}

const BACKENDS: [&str; 4] = ["redb", "redis-streams", "jetstream", "rabbitmq"];

/// One round of backend `which` on a fresh queue; `None` when not asked for.
async fn round(which: &str, a: &Args) -> Option<Numbers> {
    let name = format!("bench-{:x}", OwnerToken::new().as_u128());
    Some(match which {
        "redb" => {
            let dir =
                std::env::temp_dir().join(format!("queue-bench-{}-{name}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("queue.redb");
            let queue = RedbQueue::open(&path).unwrap();
            let file = path.clone();
            let got = bench("redb", queue, a, move || {
                std::future::ready(std::fs::metadata(&file).map(|m| m.len()).ok())
            })
            .await;
            let _ = std::fs::remove_dir_all(&dir);
            got
        }
        "redis-streams" => {
            let url = a.redis.as_ref()?;
            let queue = RedisStreamsQueue::standalone(url.as_str(), &name)
                .await
                .unwrap();
            let client = redis::Client::open(url.as_str()).unwrap();
            let used = move || {
                let mut c = client.get_connection().unwrap();
                let info: String = redis::cmd("INFO").arg("memory").query(&mut c).unwrap();
                std::future::ready(
                    info.lines()
                        .find_map(|l| l.strip_prefix("used_memory:"))
                        .and_then(|v| v.trim().parse().ok()),
                )
            };
            bench("redis-streams", queue, a, used).await
        }
        "jetstream" => {
            let url = a.nats.as_ref()?;
            let queue = JetStreamQueue::connect(url, &name).await.unwrap();
            let js = async_nats::jetstream::new(async_nats::connect(url.as_str()).await.unwrap());
            let streams = [format!("IDEM_{name}"), format!("KV_IDEM_{name}_KEYS")];
            let bytes = move || {
                let (js, streams) = (js.clone(), streams.clone());
                async move {
                    let mut total = 0;
                    for s in &streams {
                        let mut stream = js.get_stream(s).await.unwrap();
                        total += stream.info().await.unwrap().state.bytes;
                    }
                    Some(total)
                }
            };
            bench("jetstream", queue, a, bytes).await
        }
        _ => {
            let url = a.amqp.as_ref()?;
            let queue = AmqpQueue::open(url, &name, MemoryStore::new())
                .await
                .unwrap();
            bench("rabbitmq", queue, a, || std::future::ready(None)).await
        }
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|x, y| x.total_cmp(y));
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

#[tokio::main]
async fn main() {
    let a = args();
    let mut got: Vec<(&str, Vec<Numbers>)> = BACKENDS.iter().map(|b| (*b, Vec::new())).collect();
    for r in 0..a.rounds.max(1) {
        println!("round {}:", r + 1);
        for i in 0..BACKENDS.len() {
            let which = BACKENDS[(i + r) % BACKENDS.len()];
            if let Some(n) = round(which, &a).await {
                got.iter_mut().find(|(b, _)| *b == which).unwrap().1.push(n);
            }
        }
    }
    let med = |ns: &[Numbers], f: fn(&Numbers) -> f64| median(ns.iter().map(f).collect());
    let base = got[0].1.clone();
    let (bseq, bconc, brate) = (
        med(&base, |n| n.seq),
        med(&base, |n| n.conc),
        med(&base, |n| n.rate),
    );
    println!(
        "\nmedians of {} round(s), --n {} --concurrency {}; (×) = ratio to redb in the same rounds",
        a.rounds.max(1),
        a.n,
        a.concurrency
    );
    println!("| queue | ingest, one at a time | ingest, {} concurrent | bytes per queued notification | delivery (no-op handler) |", a.concurrency);
    println!("|---|---|---|---|---|");
    for (label, ns) in &got {
        if ns.is_empty() {
            continue;
        }
        let (seq, conc, rate) = (med(ns, |n| n.seq), med(ns, |n| n.conc), med(ns, |n| n.rate));
        let bytes: Vec<f64> = ns.iter().filter_map(|n| n.bytes).collect();
        let bytes = if bytes.is_empty() {
            "not measured".to_owned()
        } else {
            format!("{:.0}", median(bytes))
        };
        let delivered: usize = ns.iter().map(|n| n.delivered).sum();
        println!(
            "| {label} | {seq:.0} /s ({:.2}×) | {conc:.0} /s ({:.2}×) | {bytes} | {rate:.0} /s ({:.2}×; {delivered} delivered) |",
            seq / bseq,
            conc / bconc,
            rate / brate,
        );
    }
}
