//! Redis in front of PostgreSQL (`TieredStore`): a Redis restarted without
//! persistence after a storm replays every notification from the database
//! and runs none again; Redis alone runs them all again.

use test_support::support_redis;
use test_support::support_sql;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use support_redis::{redis_available, RedisServer};
use support_sql::shared_postgres;
use tower::{service_fn, ServiceBuilder, ServiceExt};
use tower_idempotency::dedup::DedupLayer;
use tower_idempotency::key::{Field, FingerprintSpec, KeyLayer, KeySpec};
use tower_idempotency::store::{OwnerToken, Store, TieredStore};
use tower_idempotency_redis::RedisStore;
use tower_idempotency_sqlx::SqlStore;

const KEYS: usize = 20;
const COPIES: usize = 3;

/// Every key `COPIES` times, all at once, through key + dedup layers over
/// `store`; returns how many answers were replays.
async fn storm<St: Store>(store: &St, prefix: &str, runs: &Arc<AtomicUsize>) -> usize {
    let counter = runs.clone();
    let svc = ServiceBuilder::new()
        .layer(KeyLayer::new(KeySpec::new(
            [Field::header(http::HeaderName::from_static(
                "idempotency-key",
            ))],
            FingerprintSpec::Request,
        )))
        .layer(DedupLayer::new(store.clone()))
        .service(service_fn(move |_req: Request<Full<Bytes>>| {
            let n = counter.fetch_add(1, Ordering::SeqCst);
            async move {
                Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from(format!(
                    "paid {n}"
                )))))
            }
        }));
    let calls = (0..KEYS * COPIES).map(|i| {
        let svc = svc.clone();
        let key = format!("{prefix}-{}", i % KEYS);
        tokio::spawn(async move {
            let req = Request::post("/notify")
                .header("idempotency-key", key)
                .body(Full::new(Bytes::from_static(b"{}")))
                .unwrap();
            let res = svc.oneshot(req).await.unwrap();
            assert_eq!(res.status(), StatusCode::OK);
            let replayed = res.headers().contains_key("idempotent-replayed");
            res.into_body().collect().await.unwrap();
            replayed
        })
    });
    let mut replayed = 0;
    for call in calls.collect::<Vec<_>>() {
        replayed += usize::from(call.await.unwrap());
    }
    replayed
}

/// Storm, restart Redis without persistence, storm again: how many runs.
async fn runs_across_a_redis_data_loss(tiered: bool) -> Option<(usize, usize)> {
    if !redis_available() {
        return None;
    }
    let pg = shared_postgres()?;
    let mut redis = RedisServer::start();
    let front = RedisStore::standalone(redis.url())
        .await
        .unwrap()
        .local_max_bytes(0); // no local tier: every repeat asks Redis
    let back = SqlStore::connect(pg.url()).await.unwrap();
    let prefix = format!("EV-{:x}", OwnerToken::new().as_u128());
    let runs = Arc::new(AtomicUsize::new(0));
    // The restarted server is empty; wait until the store has reconnected
    // to it (a call in between fails: a 503, not what this test is about).
    let probe = front.clone();
    let restart = |redis: &mut RedisServer| {
        redis.stop_without_saving();
        redis.restart();
    };
    let reconnected = || async {
        for _ in 0..100 {
            if probe.take_token("probe", OwnerToken::new()).await.is_ok() {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        panic!("the store did not reconnect to the restarted Redis");
    };
    let (first, second) = if tiered {
        let store = TieredStore::new(front, back);
        storm(&store, &prefix, &runs).await;
        restart(&mut redis);
        reconnected().await;
        (
            runs.load(Ordering::SeqCst),
            storm(&store, &prefix, &runs).await,
        )
    } else {
        storm(&front, &prefix, &runs).await;
        restart(&mut redis);
        reconnected().await;
        (
            runs.load(Ordering::SeqCst),
            storm(&front, &prefix, &runs).await,
        )
    };
    assert_eq!(first, KEYS, "one run per key before the restart");
    Some((runs.load(Ordering::SeqCst), second))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tiered_a_redis_restarted_without_persistence_runs_nothing_again() {
    let Some((runs, replayed)) = runs_across_a_redis_data_loss(true).await else {
        return;
    };
    assert_eq!(runs, KEYS, "the database answered what Redis lost");
    assert_eq!(
        replayed,
        KEYS * COPIES,
        "every copy after the restart replayed"
    );
}

/// The control: Redis alone forgets, and every key runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_alone_runs_everything_again_after_losing_its_data() {
    let Some((runs, _)) = runs_across_a_redis_data_loss(false).await else {
        return;
    };
    assert_eq!(runs, 2 * KEYS);
}

/// `forget` deletes in both tiers or answers an error: a Redis that does
/// not answer (paused) must not be taken for "nothing there", or it keeps
/// replaying the record that the API said was deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiered_forget_with_the_front_down_is_an_error() {
    if !redis_available() {
        return;
    }
    let Some(pg) = shared_postgres() else {
        return;
    };
    let redis = RedisServer::start();
    let front = RedisStore::standalone(redis.url()).await.unwrap();
    let back = SqlStore::connect(pg.url()).await.unwrap();
    let store = TieredStore::new(front, back);
    let key = format!("EV-forget-{:x}", OwnerToken::new().as_u128());
    let owner = OwnerToken::new();
    let fp = tower_idempotency::Fingerprint::of(b"f");
    store
        .claim(&key, fp, owner, std::time::Duration::from_secs(30))
        .await
        .unwrap();
    let record = Arc::new(tower_idempotency::store::CompletedRecord::new(
        fp,
        tower_idempotency::store::StoredResponse::new(
            StatusCode::OK,
            http::HeaderMap::new(),
            Bytes::from_static(b"paid"),
        ),
    ));
    let window = std::time::Duration::from_secs(3600);
    assert!(store.complete(&key, owner, record, window).await.unwrap());
    let reply = support_redis::raw_command(redis.port(), "CLIENT PAUSE 1500 ALL").unwrap();
    assert!(reply.starts_with("+OK"), "{reply}");
    let forgot = store.forget(&key).await;
    assert!(
        forgot.is_err(),
        "forget answered {forgot:?} while Redis, which keeps the record, did not answer"
    );
    // Once Redis answers again, forget deletes it there too.
    tokio::time::sleep(std::time::Duration::from_millis(1600)).await;
    let again = store.forget(&key).await.unwrap();
    assert_eq!(again, tower_idempotency::store::Forgotten::Deleted);
    let next = store
        .claim(
            &key,
            fp,
            OwnerToken::new(),
            std::time::Duration::from_secs(30),
        )
        .await
        .unwrap();
    assert!(
        matches!(next, tower_idempotency::store::Claim::Acquired(_)),
        "{next:?}"
    );
}
