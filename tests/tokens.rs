//! Client tokens: issue one, consume it once (issue: the seed's V3
//! "anti-resubmit token"), on every store.

mod common;
#[cfg(feature = "redis")]
mod support_redis;

use bytes::Bytes;
use common::{all_at_once, read, request, Counter};
use http::{Request, Response};
use http_body_util::Full;
use std::convert::Infallible;
use std::time::Duration;
use tower::{service_fn, Service, ServiceBuilder, ServiceExt};
use tower_idempotency::store::{MemoryStore, Store};
use tower_idempotency::token::IssueToken;
use tower_idempotency::{IdempotencyLayer, Preset};

async fn issue<St: Store>(issuer: &IssueToken<St>, user: &str) -> String {
    let req = Request::get("/orders/token")
        .header("authorization", format!("Bearer {user}"))
        .body(())
        .unwrap();
    let a = read(issuer.clone().oneshot(req).await.unwrap()).await;
    assert_eq!(a.status, 200);
    assert_eq!(a.headers["content-type"], "application/json");
    let v: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
    assert_eq!(v["expires_in"], 300);
    let token = v["token"].as_str().unwrap().to_owned();
    assert_eq!(token.len(), 32, "128 bits in hex");
    assert!(token.bytes().all(|b| b.is_ascii_hexdigit()));
    token
}

type Handler =
    tower::util::BoxCloneService<Request<Full<Bytes>>, Response<Full<Bytes>>, Infallible>;

/// A handler that "creates an order" per run, slowly, failing its first run
/// when `fail_first` is set.
fn orders(runs: Counter, fail_first: bool) -> Handler {
    tower::util::BoxCloneService::new(service_fn(move |_req: Request<Full<Bytes>>| {
        let runs = runs.clone();
        async move {
            let n = runs.bump();
            tokio::time::sleep(Duration::from_millis(100)).await;
            let mut res = Response::new(Full::new(Bytes::from(format!(r#"{{"order_id":{n}}}"#))));
            if fail_first && n == 1 {
                *res.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
            } else {
                *res.status_mut() = http::StatusCode::CREATED;
            }
            Ok(res)
        }
    }))
}

fn submit(path: &str, user: &str, token: &str) -> Request<Full<Bytes>> {
    request(
        path,
        &[
            ("idempotency-token", token),
            ("authorization", &format!("Bearer {user}")),
            ("content-type", "application/json"),
        ],
        r#"{"sku":"tea"}"#,
    )
}

fn guarded<St: Store>(
    store: &St,
    runs: &Counter,
    strict: bool,
    fail_first: bool,
) -> impl Service<
    Request<Full<Bytes>>,
    Response = Response<tower_idempotency::ResponseBody<Full<Bytes>>>,
    Error = Infallible,
    Future = impl Send,
> + Clone {
    ServiceBuilder::new()
        .layer(IdempotencyLayer::new_in(Preset::client_token(), store.clone()).strict(strict))
        .service(orders(runs.clone(), fail_first))
}

async fn three_simultaneous_submits_create_one_order<St: Store>(store: St) {
    let issuer = IssueToken::new(store.clone());
    let runs = Counter::default();
    let svc = guarded(&store, &runs, false, false);
    let token = issue(&issuer, "alice").await;
    let answers = all_at_once(3, |_| {
        let (svc, token) = (svc.clone(), token.clone());
        async move {
            read(
                svc.oneshot(submit("/orders", "alice", &token))
                    .await
                    .unwrap(),
            )
            .await
        }
    })
    .await;
    assert_eq!(runs.get(), 1);
    for a in &answers {
        assert_eq!(a.status, 201);
        assert_eq!(a.body, answers[0].body);
    }
    assert_eq!(answers.iter().filter(|a| a.replayed()).count(), 2);
    // A later copy is replayed too.
    let later = read(
        svc.clone()
            .oneshot(submit("/orders", "alice", &token))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((later.status, later.replayed()), (201, true));
    assert_eq!(runs.get(), 1);
}

async fn strict_mode_answers_copies_409<St: Store>(store: St) {
    let issuer = IssueToken::new(store.clone());
    let runs = Counter::default();
    let svc = guarded(&store, &runs, true, false);
    let token = issue(&issuer, "alice").await;
    let answers = all_at_once(3, |_| {
        let (svc, token) = (svc.clone(), token.clone());
        async move {
            read(
                svc.oneshot(submit("/orders", "alice", &token))
                    .await
                    .unwrap(),
            )
            .await
        }
    })
    .await;
    let mut statuses: Vec<u16> = answers.iter().map(|a| a.status).collect();
    statuses.sort();
    assert_eq!(statuses, [201, 409, 409]);
    assert!(answers
        .iter()
        .any(|a| a.text().contains("duplicate submission")));
    let later = read(
        svc.clone()
            .oneshot(submit("/orders", "alice", &token))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(later.status, 409);
    assert_eq!(runs.get(), 1);
}

async fn other_principals_unknown_and_expired_tokens_are_refused<St: Store>(store: St) {
    let runs = Counter::default();
    let svc = guarded(&store, &runs, false, false);
    // Bob cannot use Alice's token, and trying does not burn it.
    let token = issue(&IssueToken::new(store.clone()), "alice").await;
    let a = read(
        svc.clone()
            .oneshot(submit("/orders", "bob", &token))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(a.status, 400);
    assert!(
        a.text().contains("unknown, expired or already used"),
        "{}",
        a.text()
    );
    let a = read(
        svc.clone()
            .oneshot(submit("/orders", "alice", &token))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(a.status, 201);
    // A guessed token.
    let a = read(
        svc.clone()
            .oneshot(submit(
                "/orders",
                "alice",
                "0123456789abcdef0123456789abcdef",
            ))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(a.status, 400);
    // An expired token.
    let short = IssueToken::new(store.clone()).ttl(Duration::from_millis(100));
    let token = issue_with_ttl(&short, "alice").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let a = read(
        svc.clone()
            .oneshot(submit("/orders", "alice", &token))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(a.status, 400);
    // No token at all.
    let req = request("/orders", &[("authorization", "Bearer alice")], "{}");
    let a = read(svc.clone().oneshot(req).await.unwrap()).await;
    assert_eq!(a.status, 400);
    assert!(a.text().contains("Idempotency-Token"), "{}", a.text());
    assert_eq!(runs.get(), 1, "the handler ran only for the genuine submit");
}

async fn issue_with_ttl<St: Store>(issuer: &IssueToken<St>, user: &str) -> String {
    let req = Request::post("/t")
        .header("authorization", format!("Bearer {user}"))
        .body(())
        .unwrap();
    let a = read(issuer.clone().oneshot(req).await.unwrap()).await;
    let v: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
    v["token"].as_str().unwrap().to_owned()
}

async fn tokens_cannot_be_replayed_across_routes<St: Store>(store: St) {
    let runs = Counter::default();
    let svc = guarded(&store, &runs, false, false);
    let token = issue(&IssueToken::new(store.clone()), "alice").await;
    let a = read(
        svc.clone()
            .oneshot(submit("/orders", "alice", &token))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(a.status, 201);
    let a = read(
        svc.clone()
            .oneshot(submit("/payments", "alice", &token))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(a.status, 400);
    assert_eq!(runs.get(), 1);
}

async fn a_failed_submit_gives_the_token_back<St: Store>(store: St) {
    let runs = Counter::default();
    let svc = guarded(&store, &runs, false, true);
    let token = issue(&IssueToken::new(store.clone()), "alice").await;
    let a = read(
        svc.clone()
            .oneshot(submit("/orders", "alice", &token))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(a.status, 503);
    let a = read(
        svc.clone()
            .oneshot(submit("/orders", "alice", &token))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((a.status, a.text().as_str()), (201, r#"{"order_id":2}"#));
    assert_eq!(runs.get(), 2);
}

async fn tokens_are_distinct<St: Store>(store: St) {
    let issuer = IssueToken::new(store);
    let mut seen = std::collections::HashSet::new();
    for _ in 0..200 {
        assert!(seen.insert(issue(&issuer, "alice").await));
    }
}

macro_rules! token_tests {
    ($store:ident: $make:expr) => {
        token_tests!(@cases $store: $make;
            three_simultaneous_submits_create_one_order,
            strict_mode_answers_copies_409,
            other_principals_unknown_and_expired_tokens_are_refused,
            tokens_cannot_be_replayed_across_routes,
            a_failed_submit_gives_the_token_back,
            tokens_are_distinct
        );
    };
    (@cases $store:ident: $make:expr; $($case:ident),*) => {
        mod $store {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let Some((store, _guard)) = ($make) else {
                        return;
                    };
                    super::$case(store).await;
                }
            )*
        }
    };
}

token_tests!(memory: Some((MemoryStore::new(), ())));

#[cfg(feature = "redis")]
token_tests!(redis: match support_redis::shared_standalone() {
    Some(server) => {
        let store = tower_idempotency::store::RedisStore::standalone(server.url())
            .await
            .unwrap();
        Some((store, server))
    }
    None => None,
});

#[cfg(feature = "redis")]
token_tests!(redis_cluster: match support_redis::shared_cluster() {
    Some(cluster) => {
        let store = tower_idempotency::store::RedisStore::cluster(cluster.urls())
            .await
            .unwrap();
        Some((store, cluster))
    }
    None => None,
});
