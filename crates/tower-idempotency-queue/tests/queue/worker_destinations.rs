//! A notification for several destinations (`Queue::ingest_each`): the
//! worker delivers each destination's entry exactly once, on its own lane,
//! so a destination that is down never delays or repeats another's.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use test_support::common::temp::TempDir;
use tower::service_fn;
use tower_idempotency::Fingerprint;
use tower_idempotency_queue::{Ingested, Message, Pace, Queue, RedbQueue, Worker};

use crate::Down;

/// Calls per (destination, notification key), and whether the ledger is up.
#[derive(Clone, Default)]
struct Upstreams {
    calls: Arc<Mutex<HashMap<(String, String), usize>>>,
    ledger_up: Arc<AtomicBool>,
}

impl Upstreams {
    fn calls(&self, destination: &str) -> Vec<usize> {
        let calls = self.calls.lock().unwrap();
        let mut got: Vec<(String, usize)> = calls
            .iter()
            .filter(|((d, _), _)| d == destination)
            .map(|((_, k), n)| (k.clone(), *n))
            .collect();
        got.sort();
        got.into_iter().map(|(_, n)| n).collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_destination_is_delivered_once_and_a_down_one_never_holds_the_other() {
    const N: usize = 5;
    let dir = TempDir::new("queue-destinations");
    let queue = RedbQueue::open(dir.file()).unwrap();
    for n in 0..N {
        let key = format!("evt_{n}");
        let m = Message::new(&key, Fingerprint::of(key.as_bytes()), "{}");
        let got = queue.ingest_each(m, ["orders", "ledger"]).await.unwrap();
        assert!(matches!(got, Ingested::Queued(_)), "{got:?}");
    }
    let upstreams = Upstreams::default();
    let seen = upstreams.clone();
    let service = service_fn(move |m: Message| {
        let seen = seen.clone();
        async move {
            let destination = m.destination.clone().expect("an entry for a destination");
            let up = destination == "orders" || seen.ledger_up.load(Ordering::SeqCst);
            if up {
                let key = (destination, m.notification_key().to_owned());
                *seen.calls.lock().unwrap().entry(key).or_default() += 1;
                Ok(())
            } else {
                Err(Down)
            }
        }
    });
    let worker = Worker::new(queue.clone(), service)
        .poll_interval(Duration::from_millis(20))
        .max_attempts(1000)
        .lane("orders", Pace::new().concurrency(2))
        .lane(
            "ledger",
            Pace::new()
                .concurrency(1)
                .retry_schedule([Duration::from_millis(300)]),
        )
        .lanes(|m: &Message| m.destination.as_deref().map(Arc::from));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(worker.run(async {
        let _ = stopped.await;
    }));

    // The orders get every notification promptly, while the ledger fails.
    let start = Instant::now();
    while upstreams.calls("orders").len() < N {
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "the orders waited for the ledger: {:?}",
            upstreams.calls("orders")
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(upstreams.calls("ledger").is_empty());
    // The orders' entries acknowledged (just after their calls): the
    // ledger's are left.
    let start = Instant::now();
    while queue.stats().await.unwrap().depth != N as u64 {
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "depth {:?}, not the ledger's {N}",
            queue.stats().await.unwrap().depth
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // The ledger back: each of its entries once; the orders never again.
    upstreams.ledger_up.store(true, Ordering::SeqCst);
    let start = Instant::now();
    while queue.stats().await.unwrap().depth > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the ledger never caught up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(upstreams.calls("orders"), vec![1; N]);
    assert_eq!(upstreams.calls("ledger"), vec![1; N]);
    stop.send(()).unwrap();
    run.await.unwrap();
}
