//! The scope of stored keys: route, principal, bounds, escaping and malformed
//! key headers, through a plain tower stack and through an axum router.

use test_support::common;

use axum::routing::post;
use bytes::Bytes;
use common::{read, request, Counter};
use http::request::Parts;
use http::{HeaderValue, Request, Response};
use http_body_util::Full;
use std::convert::Infallible;
use tower::{service_fn, ServiceBuilder, ServiceExt};
use tower_idempotency::key::{
    AuthorizationHash, CookiePrincipal, ExtensionPrincipal, ExtractKey, Field, FingerprintSpec,
    HeaderPrincipal, KeySpec, Principal, MAX_STORED_KEY_LEN,
};
use tower_idempotency::{IdempotencyKey, IdempotencyLayer, Preset};

/// A handler that counts its runs and answers with the stored key it saw.
fn handler(
    count: Counter,
) -> impl tower::Service<
    Request<Full<Bytes>>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future = impl Send,
> + Clone {
    service_fn(move |req: Request<Full<Bytes>>| {
        let count = count.clone();
        async move {
            count.bump();
            let key = req
                .extensions()
                .get::<IdempotencyKey>()
                .map(|k| k.as_str().to_owned())
                .unwrap_or_default();
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(key))))
        }
    })
}

/// Every path in `paths`, with one Idempotency-Key and one body, through one
/// plain tower stack: how many times the handler ran.
async fn runs_through_stack(paths: &[&str]) -> usize {
    let count = Counter::default();
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key())
        .service(handler(count.clone()));
    for path in paths {
        let res = svc
            .clone()
            .oneshot(request(path, &[("idempotency-key", "k-1")], "order 7"))
            .await
            .unwrap();
        let answer = read(res).await;
        assert_eq!(answer.status, 200, "{path}: {}", answer.text());
    }
    count.get()
}

#[tokio::test]
async fn spellings_of_one_path_share_one_record_in_a_tower_stack() {
    for spellings in [
        &["/orders", "/orders/"][..],
        &["/orders/1", "/orders/%31", "/orders/%31/"],
        &[
            "/orders",
            "//orders",
            "/orders//",
            "/./orders",
            "/shop/../orders",
        ],
        &["/orders/a-b", "/orders/a%2Db", "/orders/%61-b"],
    ] {
        assert_eq!(
            runs_through_stack(spellings).await,
            1,
            "one key over {spellings:?} must run once"
        );
    }
}

#[tokio::test]
async fn other_paths_stay_other_scopes() {
    // A reserved character that is escaped means something else: not merged.
    assert_eq!(
        runs_through_stack(&["/orders/a%2Fb", "/orders/a/b"]).await,
        2
    );
    assert_eq!(runs_through_stack(&["/orders", "/payments"]).await, 2);
    assert_eq!(runs_through_stack(&["/orders/1", "/orders/2"]).await, 2);
}

#[tokio::test]
async fn axum_routes_are_scoped_by_their_matched_path() {
    let count = Counter::default();
    let layer = IdempotencyLayer::idempotency_key();
    let h = {
        let count = count.clone();
        move |body: String| {
            let count = count.clone();
            async move {
                count.bump();
                format!("created {body}")
            }
        }
    };
    let app: axum::Router = axum::Router::new()
        .route("/orders", post(h.clone()))
        .route("/orders/", post(h.clone()))
        .route("/items/{id}", post(h))
        .layer(layer);
    let mut answers = Vec::new();
    for (path, key) in [
        ("/orders", "a"),
        ("/orders/", "a"),
        ("/items/1", "b"),
        ("/items/%31", "b"),
    ] {
        let req = Request::post(path)
            .header("idempotency-key", key)
            .body(axum::body::Body::from("x"))
            .unwrap();
        answers.push(read(app.clone().oneshot(req).await.unwrap()).await);
    }
    for a in &answers {
        assert_eq!(a.status, 200, "{}", a.text());
    }
    assert_eq!(count.get(), 2, "one run per key, whatever the spelling");
    assert!(answers[1].replayed() && answers[3].replayed());
}

#[cfg(feature = "axum")]
#[tokio::test]
async fn the_matched_path_is_the_route_part_of_the_key() {
    let app: axum::Router = axum::Router::new()
        .route(
            "/items/{id}",
            post(|key: IdempotencyKey| async move { key.as_str().to_owned() }),
        )
        .layer(IdempotencyLayer::idempotency_key());
    let req = Request::post("/items/42")
        .header("idempotency-key", "k")
        .body(axum::body::Body::from("x"))
        .unwrap();
    let answer = read(app.oneshot(req).await.unwrap()).await;
    assert_eq!(answer.text(), "idem:idempotency-key:/items/{id}::k");
}

/// What a bearer-token auth middleware leaves behind: the user it resolved.
#[derive(Clone, Debug)]
struct UserId(u64);

impl std::fmt::Display for UserId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "user-{}", self.0)
    }
}

/// Plays the auth middleware: both tokens below belong to user 7, `other` to 8.
fn authenticate(mut req: Request<Full<Bytes>>) -> Request<Full<Bytes>> {
    let user = match req.headers().get("authorization").map(|v| v.as_bytes()) {
        Some(b"Bearer old") | Some(b"Bearer refreshed") => 7,
        _ => 8,
    };
    req.extensions_mut().insert(UserId(user));
    req
}

async fn runs_with_tokens(layer: IdempotencyLayer, tokens: &[&str]) -> usize {
    let count = Counter::default();
    let svc = ServiceBuilder::new()
        .map_request(authenticate)
        .layer(layer)
        .service(handler(count.clone()));
    for token in tokens {
        let auth = format!("Bearer {token}");
        let req = request(
            "/orders",
            &[("idempotency-key", "k"), ("authorization", &auth)],
            "order",
        );
        let answer = read(svc.clone().oneshot(req).await.unwrap()).await;
        assert_eq!(answer.status, 200, "{}", answer.text());
    }
    count.get()
}

#[tokio::test]
async fn a_principal_from_the_auth_middleware_survives_a_token_refresh() {
    // A fresh layer (and store) per run.
    let layer =
        || IdempotencyLayer::idempotency_key().principal(ExtensionPrincipal::<UserId>::new());
    assert_eq!(runs_with_tokens(layer(), &["old", "refreshed"]).await, 1);
    assert_eq!(runs_with_tokens(layer(), &["old", "other"]).await, 2);
    // A mapping function instead of Display.
    let layer = IdempotencyLayer::idempotency_key()
        .principal(ExtensionPrincipal::map(|u: &UserId| u.0.to_string()));
    assert_eq!(runs_with_tokens(layer, &["old", "refreshed"]).await, 1);
}

#[tokio::test]
async fn the_default_authorization_hash_changes_with_the_token() {
    // The documented pitfall of the default: a refreshed token is a new scope.
    let layer = IdempotencyLayer::idempotency_key();
    assert_eq!(runs_with_tokens(layer, &["old", "refreshed"]).await, 2);
}

#[tokio::test]
async fn stored_keys_are_bounded_whatever_the_route_and_principal() {
    let count = Counter::default();
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key().principal(|p: &Parts| {
            p.headers
                .get("x-tenant")
                .map(|v| v.to_str().unwrap().to_owned())
        }))
        .service(handler(count.clone()));
    let long = "t".repeat(20_000);
    let mut seen = Vec::new();
    for (route, tenant) in [
        (format!("/{long}a"), format!("{long}a")),
        (format!("/{long}b"), format!("{long}a")),
        (format!("/{long}a"), format!("{long}b")),
    ] {
        let key = ":".repeat(256);
        let req = request(
            &route,
            &[("idempotency-key", &key), ("x-tenant", &tenant)],
            "x",
        );
        let answer = read(svc.clone().oneshot(req).await.unwrap()).await;
        assert_eq!(answer.status, 200, "{}", answer.text());
        assert!(
            answer.body.len() <= MAX_STORED_KEY_LEN,
            "stored key of {} bytes",
            answer.body.len()
        );
        seen.push(answer.body);
    }
    assert_eq!(
        count.get(),
        3,
        "long parts are hashed, not cut: no collision"
    );
    assert!(seen[0] != seen[1] && seen[0] != seen[2] && seen[1] != seen[2]);
}

#[tokio::test]
async fn a_non_ascii_key_header_is_malformed_not_missing() {
    let count = Counter::default();
    for (layer, header) in [
        (IdempotencyLayer::standard_webhooks(), "webhook-id"),
        (IdempotencyLayer::client_token(), "idempotency-token"),
        (IdempotencyLayer::idempotency_key(), "idempotency-key"),
        // Optional keys too: a key was given, so running unguarded is wrong.
        (
            IdempotencyLayer::idempotency_key().required(false),
            "idempotency-key",
        ),
    ] {
        let svc = ServiceBuilder::new()
            .layer(layer)
            .service(handler(count.clone()));
        let mut req = request("/hook", &[], "{}");
        req.headers_mut()
            .insert(header, HeaderValue::from_bytes("clé-1".as_bytes()).unwrap());
        let answer = read(svc.oneshot(req).await.unwrap()).await;
        let text = answer.text().to_lowercase();
        assert_eq!(answer.status, 400, "{header}: {text}");
        assert!(
            text.contains("malformed") && text.contains("visible ascii") && text.contains(header),
            "{header}: {text}"
        );
    }
    assert_eq!(count.get(), 0);
}

#[test]
fn composite_key_parts_never_run_together() {
    let spec = KeySpec::new(
        [
            Field::header("x-a".parse().unwrap()),
            Field::header("x-b".parse().unwrap()),
        ],
        FingerprintSpec::None,
    );
    let key_of = |a: &str, b: &str| {
        let req = Request::post("/")
            .header("x-a", a)
            .header("x-b", b)
            .body(())
            .unwrap();
        let (parts, _) = req.into_parts();
        spec.extract(&parts, &Bytes::new()).unwrap().unwrap().key
    };
    assert_ne!(key_of("a:b", "c"), key_of("a", "b:c"));
    assert_ne!(key_of("a%3Ab", "c"), key_of("a:b", "c"));
    // Plain parts read as before.
    assert_eq!(key_of("psp1", "AUTHORISATION"), "psp1:AUTHORISATION");
}

#[test]
fn adyen_keys_keep_their_form() {
    let body = br#"{"notificationItems":[{"NotificationRequestItem":{"pspReference":"P1","eventCode":"AUTHORISATION","success":"true","amount":{"value":1,"currency":"EUR"}}}]}"#;
    let (parts, _) = Request::post("/").body(()).unwrap().into_parts();
    let got = Preset::adyen()
        .extractor()
        .extract(&parts, &Bytes::from_static(body))
        .unwrap()
        .unwrap();
    assert_eq!(got.key, "P1:AUTHORISATION:true");
}

/// Requests (`path`, headers) with one key and one body through one stack:
/// how many times the handler ran, and the last answer.
async fn runs(
    layer: IdempotencyLayer,
    requests: &[(&str, &[(&str, &str)])],
) -> (usize, common::Answer) {
    let count = Counter::default();
    let svc = ServiceBuilder::new()
        .layer(layer)
        .service(handler(count.clone()));
    let mut last = None;
    for (path, headers) in requests {
        let mut h = headers.to_vec();
        if !h.iter().any(|(k, _)| *k == "idempotency-key") {
            h.push(("idempotency-key", "k"));
        }
        last = Some(
            read(
                svc.clone()
                    .oneshot(request(path, &h, "order"))
                    .await
                    .unwrap(),
            )
            .await,
        );
    }
    (count.get(), last.expect("one request at least"))
}

#[test]
fn header_principals_are_named_in_any_case_and_checked() {
    let p = HeaderPrincipal::new("X-Tenant-Id").unwrap();
    assert_eq!(p.name().as_str(), "x-tenant-id");
    for bad in ["", "x tenant", "x:tenant", "tenant\n"] {
        let e = HeaderPrincipal::new(bad).unwrap_err();
        assert!(
            e.to_string().contains("not a valid header name"),
            "{bad:?}: {e}"
        );
    }
    assert!(CookiePrincipal::new("sid").is_ok());
    for bad in ["", "s id", "s;id", "s=id", "\"sid\""] {
        assert!(CookiePrincipal::new(bad).is_err(), "{bad:?}");
    }
}

#[tokio::test]
async fn a_header_principal_replaces_the_authorization_hash_unless_combined() {
    let alice: &[(&str, &str)] = &[("x-tenant", "acme"), ("authorization", "Bearer alice")];
    let bob: &[(&str, &str)] = &[("x-tenant", "acme"), ("authorization", "Bearer bob")];
    let tenant = || HeaderPrincipal::new("x-tenant").unwrap();
    // Replaced: two users of one tenant share one scope.
    let layer = IdempotencyLayer::idempotency_key().principal(tenant());
    let (n, last) = runs(layer, &[("/orders", alice), ("/orders", bob)]).await;
    assert_eq!(n, 1);
    assert!(last.replayed());
    // Combined: the tenant and the user.
    let layer = IdempotencyLayer::idempotency_key().principal(tenant().and(AuthorizationHash));
    let (n, last) = runs(layer, &[("/orders", alice), ("/orders", bob)]).await;
    assert_eq!(n, 2);
    assert!(!last.replayed());
    let key = String::from_utf8(last.body.to_vec()).unwrap();
    assert!(
        key.contains(":acme%3A"),
        "tenant, then the user's hash: {key}"
    );
    // Another tenant, same user: another scope as well.
    let layer = IdempotencyLayer::idempotency_key().principal(tenant().and(AuthorizationHash));
    let other: &[(&str, &str)] = &[("x-tenant", "zeta"), ("authorization", "Bearer alice")];
    assert_eq!(
        runs(layer, &[("/orders", alice), ("/orders", other)])
            .await
            .0,
        2
    );
}

#[tokio::test]
async fn a_cookie_principal_scopes_sessions_and_falls_back_to_authorization() {
    let layer = || {
        IdempotencyLayer::idempotency_key()
            .principal(CookiePrincipal::new("sid").unwrap().or(AuthorizationHash))
    };
    let a: &[(&str, &str)] = &[("cookie", "theme=dark; sid=s-1")];
    let a_again: &[(&str, &str)] = &[("cookie", "sid=s-1"), ("authorization", "Bearer x")];
    let b: &[(&str, &str)] = &[("cookie", "sid=s-2")];
    assert_eq!(runs(layer(), &[("/o", a), ("/o", a_again)]).await.0, 1);
    assert_eq!(runs(layer(), &[("/o", a), ("/o", b)]).await.0, 2);
    // No cookie: the Authorization hash scopes it.
    let bearer: &[(&str, &str)] = &[("authorization", "Bearer x")];
    let bearer2: &[(&str, &str)] = &[("authorization", "Bearer y")];
    assert_eq!(runs(layer(), &[("/o", bearer), ("/o", bearer)]).await.0, 1);
    assert_eq!(runs(layer(), &[("/o", bearer), ("/o", bearer2)]).await.0, 2);
    // Neither: the route's scope, shared by every such request.
    assert_eq!(runs(layer(), &[("/o", &[]), ("/o", &[])]).await.0, 1);
}

#[tokio::test]
async fn client_fingerprints_cover_the_query_and_refusals_are_problem_details() {
    let layer = || IdempotencyLayer::idempotency_key();
    let (n, last) = runs(
        layer(),
        &[("/pay?amount=1", &[]), ("/pay?amount=1000", &[])],
    )
    .await;
    assert_eq!(n, 1);
    assert_eq!(last.status, 422);
    assert_eq!(last.headers["content-type"], "application/problem+json");
    let json: serde_json::Value = serde_json::from_slice(&last.body).unwrap();
    assert_eq!(json["title"], "Idempotency-Key is already used");
    assert_eq!(json["status"], 422);
    assert!(json["type"].as_str().unwrap().starts_with("https://"));
    assert!(json["detail"]
        .as_str()
        .unwrap()
        .contains("different request payload"));
    // One query, both spellings of the key: one record.
    let quoted: &[(&str, &str)] = &[("idempotency-key", "\"k\"")];
    let (n, last) = runs(
        layer(),
        &[("/pay?amount=1", &[]), ("/pay?amount=1", quoted)],
    )
    .await;
    assert_eq!((n, last.replayed()), (1, true), "{}", last.text());
}

/// A bare `Idempotency-Key` is visible ASCII (UUIDs, keys that start with a
/// digit); the draft's quoted string may hold a space and `\"`, `\\`
/// escapes. A bare value with a space or a control character is refused
/// with 400, never taken as a key.
#[tokio::test]
async fn an_idempotency_key_is_visible_ascii_or_a_quoted_string() {
    let count = Counter::default();
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key())
        .service(handler(count.clone()));
    let send = |value: &'static [u8]| {
        let svc = svc.clone();
        async move {
            let mut req = request("/pay", &[], "{}");
            req.headers_mut()
                .insert("idempotency-key", HeaderValue::from_bytes(value).unwrap());
            read(svc.oneshot(req).await.unwrap()).await
        }
    };
    for (value, key) in [
        (
            &b"123e4567-e89b-12d3-a456-426614174000"[..],
            "123e4567-e89b-12d3-a456-426614174000",
        ),
        (b"7f1c", "7f1c"),
        (b"ord:42/a~b!", "ord:42/a~b!"),
        (b"\"a b\"", "a b"),
        (br#""say \"hi\" \\ bye""#, r#"say "hi" \ bye"#),
    ] {
        let answer = send(value).await;
        assert_eq!(answer.status, 200, "{value:?}: {}", answer.text());
        assert!(
            answer.text().ends_with(key),
            "{value:?} is the key {key:?}: {}",
            answer.text()
        );
    }
    let runs = count.get();
    assert_eq!(runs, 5);
    for value in [&b"a b"[..], b"a\tb", b"\"a b", b"\"a\tb\"", b"a\"b c"] {
        let answer = send(value).await;
        let text = answer.text();
        assert_eq!(answer.status, 400, "{value:?}: {text}");
        assert_eq!(answer.headers["content-type"], "application/problem+json");
        assert!(
            text.contains("Idempotency-Key is malformed"),
            "{value:?}: {text}"
        );
    }
    assert_eq!(count.get(), runs, "a refused key never runs the handler");
}
