//! Client tokens (an "anti-resubmit token" a form carries): issue one,
//! consume it once, on every store.

use test_support::common;
use test_support::support_redis;

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
    Future = impl Send + use<St>,
> + Clone
       + use<St> {
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

/// A used token within the window: the same body gets the replay, another
/// body 422 and a copy that cannot wait 409, both speaking of the token.
async fn a_used_token_with_another_body_gets_422_about_the_token<St: Store>(store: St) {
    let runs = Counter::default();
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::new_in(Preset::client_token(), store.clone()).wait(Duration::ZERO))
        .service(orders(runs.clone(), false));
    let token = issue(&IssueToken::new(store.clone()), "alice").await;
    let first = svc.clone().oneshot(submit("/orders", "alice", &token));
    let first = tokio::spawn(async move { read(first.await.unwrap()).await });
    tokio::time::sleep(Duration::from_millis(30)).await;
    // While the first runs (the handler takes 100 ms), a copy cannot wait.
    let copy = read(
        svc.clone()
            .oneshot(submit("/orders", "alice", &token))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(copy.status, 409);
    assert!(
        copy.text()
            .contains("idempotency token is still in progress"),
        "{}",
        copy.text()
    );
    assert_eq!(first.await.unwrap().status, 201);
    let same = read(
        svc.clone()
            .oneshot(submit("/orders", "alice", &token))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((same.status, same.replayed()), (201, true));
    let other = request(
        "/orders",
        &[
            ("idempotency-token", token.as_str()),
            ("authorization", "Bearer alice"),
            ("content-type", "application/json"),
        ],
        r#"{"sku":"coffee"}"#,
    );
    let other = read(svc.clone().oneshot(other).await.unwrap()).await;
    assert_eq!(other.status, 422);
    assert!(
        other.text().contains("idempotency token already used"),
        "{}",
        other.text()
    );
    assert!(!other.text().contains("key"), "{}", other.text());
    assert_eq!(runs.get(), 1);
}

macro_rules! token_tests {
    ($store:ident: $make:expr) => {
        token_tests!(@cases $store: $make;
            three_simultaneous_submits_create_one_order,
            strict_mode_answers_copies_409,
            other_principals_unknown_and_expired_tokens_are_refused,
            tokens_cannot_be_replayed_across_routes,
            a_failed_submit_gives_the_token_back,
            tokens_are_distinct,
            a_used_token_with_another_body_gets_422_about_the_token
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

token_tests!(redis: match support_redis::shared_standalone() {
    Some(server) => {
        let store = tower_idempotency_redis::RedisStore::standalone(server.url())
            .await
            .unwrap();
        Some((store, server))
    }
    None => None,
});

token_tests!(redis_cluster: match support_redis::shared_cluster() {
    Some(cluster) => {
        let store = tower_idempotency_redis::RedisStore::cluster(cluster.urls())
            .await
            .unwrap();
        Some((store, cluster))
    }
    None => None,
});

/// A submit for a route whose layer sets its own principal (a tenant
/// header) and prefix.
fn tenant_submit(tenant: &str, token: &str) -> Request<Full<Bytes>> {
    request(
        "/orders",
        &[
            ("idempotency-token", token),
            ("x-tenant-id", tenant),
            ("content-type", "application/json"),
        ],
        r#"{"sku":"tea"}"#,
    )
}

async fn issue_for_tenant<St: Store>(issuer: &IssueToken<St>, tenant: &str) -> String {
    let req = Request::get("/orders/token")
        .header("x-tenant-id", tenant)
        .body(())
        .unwrap();
    let a = read(issuer.clone().oneshot(req).await.unwrap()).await;
    assert_eq!(a.status, 200);
    let v: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
    v["token"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn an_issuer_for_the_layer_shares_its_store_principal_and_prefix() {
    let tenant = |parts: &http::request::Parts| {
        parts
            .headers
            .get("x-tenant-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let layer = IdempotencyLayer::client_token()
        .principal(tenant)
        .prefix("shop");
    let runs = Counter::default();
    let svc = ServiceBuilder::new()
        .layer(layer.clone())
        .service(orders(runs.clone(), false));
    let issuer = IssueToken::for_layer(&layer);
    let token = issue_for_tenant(&issuer, "t1").await;
    let a = read(
        svc.clone()
            .oneshot(tenant_submit("t1", &token))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(a.status, 201, "{}", a.text());
    let token = issue_for_tenant(&issuer, "t1").await;
    let a = read(
        svc.clone()
            .oneshot(tenant_submit("t2", &token))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(a.status, 400, "another tenant's token: {}", a.text());
    // An issuer built by hand with the defaults disagrees with the route:
    // its tokens are unknown there.
    for issuer in [
        IssueToken::new(layer.store().clone()).principal(tenant),
        IssueToken::new(layer.store().clone()).prefix("shop"),
    ] {
        let token = issue_for_tenant(&issuer, "t1").await;
        let a = read(
            svc.clone()
                .oneshot(tenant_submit("t1", &token))
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(a.status, 400, "{}", a.text());
    }
    assert_eq!(runs.get(), 1);
}

#[test]
#[cfg(debug_assertions)]
#[should_panic(expected = "does not consume tokens")]
fn an_issuer_for_a_layer_that_takes_no_tokens_is_a_mistake() {
    let _ = IssueToken::for_layer(&IdempotencyLayer::idempotency_key());
}

/// A store that cannot keep tokens.
#[derive(Clone)]
struct NoTokens;

impl common::faults::Faults for NoTokens {
    fn before(
        &self,
        op: common::faults::Op,
        _key: &str,
    ) -> impl std::future::Future<Output = Result<(), tower_idempotency::store::StoreError>> + Send
    {
        let fail = op == common::faults::Op::PutToken;
        async move {
            match fail {
                true => Err(common::faults::backend_error("tokens down")),
                false => Ok(()),
            }
        }
    }
}

#[tokio::test]
async fn the_issuers_503_is_plain_text_like_the_other_refusals() {
    let issuer = IssueToken::new(common::faults::FaultStore::new(NoTokens));
    let req = Request::get("/orders/token").body(()).unwrap();
    let a = read(issuer.oneshot(req).await.unwrap()).await;
    assert_eq!(a.status, 503);
    assert_eq!(a.headers["retry-after"], "1");
    assert_eq!(a.headers["content-type"], "text/plain; charset=utf-8");
    assert!(a.text().contains("retry later"), "{}", a.text());
}
