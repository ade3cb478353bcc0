//! The order layer in axum, behind the Stripe preset's layers, on the
//! memory store, Redis and PostgreSQL: an object's events reach the handler one at
//! a time and only forward; stale ones are answered with the channel's
//! success and replayed to their copies.

use axum::extract::State;
use axum::routing::post;
use axum::Extension;
use axum::Router;
use bytes::Bytes;
use http::StatusCode;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use test_support::common::{self, all_at_once, client, Answer};
use test_support::support_redis;
use tower::ServiceBuilder;
use tower_idempotency::order::{Order, OrderLayer, OrderedEvent};
use tower_idempotency::store::{MemoryStore, OwnerToken, Store};
use tower_idempotency::IdempotencyLayer;

const RECEIVED: &str = r#"{"received":true}"#;

/// What the handler saw, and how it behaves.
#[derive(Clone, Default)]
struct Shop {
    /// `(object, created, type)` of every event the handler ran, in order.
    seen: Arc<Mutex<Vec<(String, i64, String)>>>,
    /// Handler calls running now, and the most at once.
    running: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
    /// The fencing token of each placed event the handler ran, in order.
    fences: Arc<Mutex<Vec<u64>>>,
    /// Fail the next this many calls.
    fail: Arc<AtomicUsize>,
    /// How long a call takes.
    delay: Duration,
}

impl Shop {
    fn seen(&self, object: &str) -> Vec<(i64, String)> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(o, ..)| o == object)
            .map(|(_, c, t)| (*c, t.clone()))
            .collect()
    }
}

async fn on_event(
    State(shop): State<Shop>,
    event: Option<Extension<OrderedEvent>>,
    body: Bytes,
) -> StatusCode {
    if let Some(Extension(event)) = event {
        shop.fences.lock().unwrap().push(event.fence);
    }
    let now = shop.running.fetch_add(1, Ordering::SeqCst) + 1;
    shop.most.fetch_max(now, Ordering::SeqCst);
    tokio::time::sleep(shop.delay).await;
    let event: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let failed = shop
        .fail
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok();
    if !failed {
        shop.seen.lock().unwrap().push((
            event["data"]["object"]["id"]
                .as_str()
                .unwrap_or("")
                .to_owned(),
            event["created"].as_i64().unwrap_or(0),
            event["type"].as_str().unwrap().to_owned(),
        ));
    }
    shop.running.fetch_sub(1, Ordering::SeqCst);
    if failed {
        StatusCode::INTERNAL_SERVER_ERROR
    } else {
        StatusCode::OK
    }
}

async fn start<St: Store>(store: St, shop: Shop) -> SocketAddr {
    let app = Router::new()
        .route(
            "/stripe",
            post(on_event).layer(
                ServiceBuilder::new()
                    .layer(IdempotencyLayer::stripe().with_store(store.clone()))
                    .layer(OrderLayer::new(Order::stripe(), store)),
            ),
        )
        .with_state(shop);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// A Stripe event of `kind` about payment intent `object`, created at
/// `created`; its id names all three.
fn event(object: &str, kind: &str, created: i64) -> Bytes {
    Bytes::from(format!(
        r#"{{"id":"evt_{object}_{kind}_{created}","object":"event","api_version":"2025-09-30.clover",
        "created":{created},"type":"{kind}","livemode":false,"pending_webhooks":1,
        "data":{{"object":{{"id":"{object}","object":"payment_intent","amount":2000,"currency":"usd"}}}}}}"#
    ))
}

async fn send(addr: SocketAddr, body: Bytes) -> Answer {
    common::post(
        &client(),
        addr,
        "/stripe",
        &[("content-type", "application/json")],
        body,
    )
    .await
}

fn header<'a>(a: &'a Answer, name: &str) -> Option<&'a str> {
    a.headers.get(name).and_then(|v| v.to_str().ok())
}

/// A payment intent id no other test (or earlier run on the same server)
/// uses.
fn fresh(case: &str) -> String {
    format!("pi_{case}_{:x}", OwnerToken::new().as_u128())
}

const LIFE: [(&str, i64); 3] = [
    ("payment_intent.created", 1_700_000_000),
    ("payment_intent.processing", 1_700_000_001),
    ("payment_intent.succeeded", 1_700_000_002),
];

/// Each of the six orders of three events of one payment intent: every
/// answer is Stripe's success; the handler sees exactly the events that
/// were ahead of all before them, in increasing order; the others are
/// answered as stale.
async fn every_order_of_three_events<St: Store>(store: St) {
    let shop = Shop::default();
    let addr = start(store, shop.clone()).await;
    for order in [
        [0, 1, 2],
        [0, 2, 1],
        [1, 0, 2],
        [1, 2, 0],
        [2, 0, 1],
        [2, 1, 0],
    ] {
        let object = fresh("three");
        let mut top = None;
        let mut expected = Vec::new();
        for i in order {
            let (kind, created) = LIFE[i];
            let a = send(addr, event(&object, kind, created)).await;
            assert_eq!(
                (a.status, a.text()),
                (200, RECEIVED.to_owned()),
                "{order:?}"
            );
            let stale = top.is_some_and(|t| t >= i);
            assert_eq!(
                header(&a, "idempotent-stale"),
                stale.then_some("true"),
                "{order:?}: event {i}"
            );
            if !stale {
                top = Some(i);
                expected.push((created, kind.to_owned()));
            }
        }
        assert_eq!(shop.seen(&object), expected, "{order:?}");
    }
}

/// 24 distinct events of one payment intent at the same instant: the
/// handler runs one at a time, sees strictly increasing positions, and
/// sees the newest; every event is answered with Stripe's success.
async fn many_events_of_one_object_at_once<St: Store>(store: St) {
    let shop = Shop {
        delay: Duration::from_millis(5),
        ..Shop::default()
    };
    let addr = start(store, shop.clone()).await;
    let object = fresh("storm");
    const N: usize = 24;
    let answers = all_at_once(N, |i| {
        let body = event(
            &object,
            "payment_intent.processing",
            1_700_000_000 + i as i64,
        );
        async move { send(addr, body).await }
    })
    .await;
    for a in &answers {
        assert_eq!((a.status, a.text()), (200, RECEIVED.to_owned()));
    }
    let seen = shop.seen(&object);
    assert!(
        seen.windows(2).all(|w| w[0].0 < w[1].0),
        "not increasing: {seen:?}"
    );
    assert_eq!(seen.last().unwrap().0, 1_700_000_000 + N as i64 - 1);
    assert_eq!(shop.most.load(Ordering::SeqCst), 1, "one at a time");
    // Each event ran under a claim of the object with a larger fence.
    let fences = shop.fences.lock().unwrap().clone();
    assert_eq!(fences.len(), seen.len());
    assert!(fences.windows(2).all(|w| w[0] < w[1]), "{fences:?}");
    let stale = answers
        .iter()
        .filter(|a| header(a, "idempotent-stale") == Some("true"))
        .count();
    assert_eq!(stale + seen.len(), N);
}

/// A stale event's copy replays the stale answer (the handler is not
/// called); a failed event moves nothing, so an older one still reaches
/// the handler after it.
async fn stale_copies_replay_and_failures_move_nothing<St: Store>(store: St) {
    let shop = Shop::default();
    let addr = start(store, shop.clone()).await;
    let object = fresh("stale");
    let succeeded = event(&object, "payment_intent.succeeded", 1_700_000_002);
    let processing = event(&object, "payment_intent.processing", 1_700_000_001);
    let created = event(&object, "payment_intent.created", 1_700_000_000);

    // The success fails once: nothing moves, and the older event is ahead.
    shop.fail.store(1, Ordering::SeqCst);
    let a = send(addr, succeeded.clone()).await;
    assert_eq!(a.status, 500);
    let a = send(addr, processing.clone()).await;
    assert_eq!((a.status, header(&a, "idempotent-stale")), (200, None));
    // Stripe retries the success: it runs and moves the intent.
    let a = send(addr, succeeded.clone()).await;
    assert_eq!((a.status, header(&a, "idempotent-stale")), (200, None));
    // The creation arrives late: stale, and its copy replays that answer.
    let first = send(addr, created.clone()).await;
    assert_eq!(first.text(), RECEIVED);
    assert_eq!(header(&first, "idempotent-stale"), Some("true"));
    assert_eq!(header(&first, "idempotent-replayed"), None);
    let copy = send(addr, created.clone()).await;
    assert_eq!((copy.status, copy.text()), (200, RECEIVED.to_owned()));
    assert_eq!(header(&copy, "idempotent-stale"), Some("true"));
    assert_eq!(header(&copy, "idempotent-replayed"), Some("true"));
    // Another event at the intent's very position (its own id, the same
    // second and type) is stale too.
    let twin = Bytes::from(
        String::from_utf8(succeeded.to_vec())
            .unwrap()
            .replace("evt_", "evt2_"),
    );
    let a = send(addr, twin).await;
    assert_eq!((a.status, a.text()), (200, RECEIVED.to_owned()));
    assert_eq!(header(&a, "idempotent-stale"), Some("true"));
    assert_eq!(header(&a, "idempotent-replayed"), None);
    assert_eq!(
        shop.seen(&object),
        [
            (1_700_000_001, "payment_intent.processing".to_owned()),
            (1_700_000_002, "payment_intent.succeeded".to_owned()),
        ]
    );
}

/// An event the order cannot place (a customer's, a charge's update) is
/// forwarded as if there were no order, however many arrive.
async fn unplaced_events_are_forwarded<St: Store>(store: St) {
    let shop = Shop::default();
    let addr = start(store, shop.clone()).await;
    let object = fresh("unplaced");
    for (kind, created) in [
        ("customer.created", 1_700_000_005),
        ("charge.updated", 1_700_000_001),
        ("customer.updated", 1_700_000_000),
    ] {
        let a = send(addr, event(&object, kind, created)).await;
        assert_eq!((a.status, a.text()), (200, RECEIVED.to_owned()));
        assert_eq!(header(&a, "idempotent-stale"), None);
    }
    assert_eq!(shop.seen(&object).len(), 3);
    // Unplaced: no claim of an object, no fence.
    assert!(shop.fences.lock().unwrap().is_empty());
    // A body the order cannot read at all still reaches the key layer's
    // verdict (no key: refused before the order).
    let a = send(addr, Bytes::from_static(b"{}")).await;
    assert_ne!(a.status, 200);
}

/// Alipay: a trade's late `TRADE_SUCCESS` after its `TRADE_FINISHED` is
/// stale; a refund's notification (its `out_biz_no`) is an object of its
/// own, never stale because of the trade, and moves nothing of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alipay_refunds_are_never_stale_because_of_the_trade() {
    let store = MemoryStore::new();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    let app = Router::new().route(
        "/alipay",
        post(move |body: String| {
            let log = log.clone();
            async move {
                log.lock().unwrap().push(body);
                "ok"
            }
        })
        .layer(
            ServiceBuilder::new()
                .layer(IdempotencyLayer::alipay().with_store(store.clone()))
                .layer(OrderLayer::new(Order::alipay(), store)),
        ),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let trade = fresh("alipay");
    let form = |notify: &str, status: &str, refund: &str| {
        format!("notify_id={notify}&out_trade_no={trade}&trade_status={status}&total_amount=0.10{refund}")
    };
    let send = |body: String| async move {
        common::post(
            &client(),
            addr,
            "/alipay",
            &[("content-type", "application/x-www-form-urlencoded")],
            body,
        )
        .await
    };
    let finished = send(form("n1", "TRADE_FINISHED", "")).await;
    let late = send(form("n2", "TRADE_SUCCESS", "")).await;
    let refund = send(form(
        "n3",
        "TRADE_SUCCESS",
        "&out_biz_no=R1&refund_fee=0.05",
    ))
    .await;
    let closed = send(form("n4", "TRADE_CLOSED", "&out_biz_no=R2&refund_fee=0.10")).await;
    for a in [&finished, &late, &refund, &closed] {
        assert_eq!((a.status, a.text()), (200, "success".to_owned()));
    }
    assert_eq!(header(&late, "idempotent-stale"), Some("true"));
    for a in [&finished, &refund, &closed] {
        assert_eq!(header(a, "idempotent-stale"), None);
    }
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert!(seen.iter().all(|b| !b.contains("notify_id=n2")));
}

macro_rules! order_tests {
    ($name:ident: $setup:expr) => {
        mod $name {
            use super::*;

            async fn setup() -> Option<(impl Store, impl Sized)> {
                $setup
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn every_order_of_three_events() {
                let Some((store, _guard)) = setup().await else {
                    return;
                };
                super::every_order_of_three_events(store).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn many_events_of_one_object_at_once() {
                let Some((store, _guard)) = setup().await else {
                    return;
                };
                super::many_events_of_one_object_at_once(store).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn stale_copies_replay_and_failures_move_nothing() {
                let Some((store, _guard)) = setup().await else {
                    return;
                };
                super::stale_copies_replay_and_failures_move_nothing(store).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn unplaced_events_are_forwarded() {
                let Some((store, _guard)) = setup().await else {
                    return;
                };
                super::unplaced_events_are_forwarded(store).await;
            }
        }
    };
}

order_tests!(order_memory: Some((MemoryStore::new(), ())));

order_tests!(order_postgres: match test_support::support_sql::shared_postgres() {
    Some(server) => {
        let store = tower_idempotency_sqlx::SqlStore::connect(server.url())
            .await
            .unwrap();
        Some((store, server))
    }
    None => None,
});

order_tests!(order_redis: match support_redis::shared_standalone() {
    Some(server) => {
        let store = tower_idempotency_redis::RedisStore::standalone(server.url())
            .await
            .unwrap();
        Some((store, server))
    }
    None => None,
});

/// With the `metrics` feature every event is counted by order and result.
#[cfg(feature = "metrics")]
#[test]
fn events_are_counted_by_order_and_result() {
    use http_body_util::Full;
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    use std::collections::HashMap;
    use tower::{service_fn, ServiceExt};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        rt.block_on(async {
            let store = MemoryStore::new();
            let svc = ServiceBuilder::new()
                .layer(IdempotencyLayer::stripe().with_store(store.clone()))
                .layer(OrderLayer::new(Order::stripe(), store))
                .service(service_fn(|req: http::Request<Full<Bytes>>| async move {
                    let fail = req.headers().contains_key("x-fail");
                    let mut res = http::Response::new(Full::new(Bytes::new()));
                    if fail {
                        *res.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                    }
                    Ok::<_, std::convert::Infallible>(res)
                }));
            let object = fresh("metrics");
            for (kind, created, fail) in [
                ("payment_intent.created", 1_700_000_000, false),
                ("payment_intent.succeeded", 1_700_000_002, true),
                ("payment_intent.succeeded", 1_700_000_003, false),
                ("payment_intent.processing", 1_700_000_001, false),
                ("customer.created", 1_700_000_004, false),
            ] {
                let headers: &[(&str, &str)] = if fail { &[("x-fail", "1")] } else { &[] };
                svc.clone()
                    .oneshot(common::request(
                        "/stripe",
                        headers,
                        event(&object, kind, created),
                    ))
                    .await
                    .unwrap();
            }
        })
    });
    let mut counts: HashMap<String, u64> = HashMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let key = key.key();
        if let ("idempotency_order_events_total", DebugValue::Counter(n)) = (key.name(), value) {
            let labels: HashMap<_, _> = key
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            assert_eq!(labels["order"], "stripe");
            *counts.entry(labels["result"].clone()).or_default() += n;
        }
    }
    let want: HashMap<String, u64> = [
        ("advanced", 2),
        ("failed", 1),
        ("stale", 1),
        ("unplaced", 1),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    assert_eq!(counts, want);
}
