//! The gateway's spans: a request is one trace with its claim, its upstream
//! call and its replays; a refused signature is a verify span; a client's
//! `traceparent` is dropped unless accepted.

use bytes::Bytes;
use http::Response;
use http_body_util::Full;
use idempotency_gateway::proxy::{Forward, Gateway, GatewayBuilder, Target};
use opentelemetry::trace::{SpanId, TraceId};
use std::convert::Infallible;
use test_support::common::otel::{all_values, attr, traceparent, Traces};
use test_support::common::upstream::Upstream;
use test_support::common::{read, request};
use tower::{service_fn, ServiceBuilder, ServiceExt};
use tower_idempotency::store::MemoryStore;
use tower_idempotency::verify::StripeKeys;
use tower_idempotency::{IdempotencyLayer, Preset};

/// A WeChat Pay notification whose key is `id`.
fn wechat(id: &str) -> String {
    format!(r#"{{"id":"{id}","event_type":"TRANSACTION.SUCCESS","resource":{{}}}}"#)
}

fn gateway(
    up: &Upstream,
    f: impl FnOnce(GatewayBuilder<MemoryStore>) -> GatewayBuilder<MemoryStore>,
) -> Gateway<MemoryStore> {
    let forward = Forward::new(up.url().parse().unwrap());
    let builder = Gateway::builder(forward, MemoryStore::new())
        .route("/wx", Target::Preset(Preset::wechatpay_v3()));
    f(builder).build().unwrap()
}

const JSON: &[(&str, &str)] = &[("content-type", "application/json")];

#[tokio::test]
async fn a_request_is_a_trace_with_its_claim_and_upstream_and_a_replay_its_own() {
    let traces = Traces::start();
    let up = Upstream::start().await;
    let gw = gateway(&up, |b| b);
    let first = read(
        gw.clone()
            .oneshot(request("/wx", JSON, wechat("ORDER-SECRET-7")))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(first.status, 200);
    let again = read(
        gw.clone()
            .oneshot(request("/wx", JSON, wechat("ORDER-SECRET-7")))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(again.status, 200);
    assert_eq!(up.total(), 1);

    let requests = traces.named("idempotency");
    assert_eq!(requests.len(), 2, "one span per request");
    let (run, replayed) = (&requests[0], &requests[1]);
    // A request with no caller's context starts a trace of its own.
    assert_eq!(run.parent_span_id, SpanId::INVALID);
    assert_ne!(
        run.span_context.trace_id(),
        replayed.span_context.trace_id()
    );
    let claim = traces.child(run, "claim");
    let upstream = traces.child(run, "upstream");
    assert!(
        claim.end_time <= upstream.start_time,
        "claimed, then called"
    );
    assert_eq!(attr(run, "preset").as_deref(), Some("wechatpay-v3"));
    assert_eq!(attr(run, "outcome").as_deref(), Some("executed"));
    traces.child(replayed, "claim");
    traces.child(replayed, "replay");
    assert!(traces.named("upstream").len() == 1, "a replay calls nobody");
    assert_eq!(attr(replayed, "outcome").as_deref(), Some("replayed"));

    // The key's hash: the stored key's SHA-256 the upstream got, cut to 16 digits.
    let seen = up.last("/wx");
    let key_hash = attr(run, "key_hash").unwrap();
    assert_eq!(key_hash.len(), 16);
    assert!(seen.headers["idempotency-key"]
        .to_str()
        .unwrap()
        .starts_with(&key_hash));
    assert_eq!(attr(replayed, "key_hash"), Some(key_hash));
    // Never the key, nor the body.
    for value in all_values(&traces.spans()) {
        assert!(
            !value.contains("ORDER-SECRET-7"),
            "the key in an attribute: {value}"
        );
    }

    // The upstream's call is a child of the `upstream` span: its trace joins ours.
    let (trace, parent) = traceparent(&seen.headers["traceparent"]);
    assert_eq!(trace, run.span_context.trace_id());
    assert_eq!(parent, upstream.span_context.span_id());
}

#[tokio::test]
async fn a_refused_signature_is_a_verify_span_and_the_outcome() {
    let traces = Traces::start();
    let keys = StripeKeys::new().secret("whsec_not_the_signer").unwrap();
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::stripe().verify(keys))
        .service(service_fn(|_req| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
        }));
    let body = r#"{"id":"evt_1","type":"payment_intent.succeeded"}"#;
    let res = svc
        .oneshot(request(
            "/stripe",
            &[("stripe-signature", "t=1,v1=00")],
            body,
        ))
        .await
        .unwrap();
    assert_eq!(res.status(), 401);
    let request = &traces.named("idempotency")[0];
    traces.child(request, "verify");
    assert!(traces.named("claim").is_empty(), "nothing claimed");
    assert_eq!(attr(request, "outcome").as_deref(), Some("unverified"));
}

/// A caller's own trace context.
const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

#[tokio::test]
async fn a_clients_traceparent_is_dropped_unless_accepted() {
    let traces = Traces::start();
    let up = Upstream::start().await;
    let client = [
        ("content-type", "application/json"),
        (
            "traceparent",
            &*format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"),
        ),
        ("tracestate", "vendor=client"),
    ];
    let client_trace = TraceId::from_hex(CLIENT_TRACE).unwrap();

    // By default: a trace of our own, and the client's never reaches the upstream.
    let gw = gateway(&up, |b| b);
    let res = read(
        gw.oneshot(request("/wx", &client, wechat("EV-1")))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(res.status, 200);
    let ours = traces.named("idempotency").pop().unwrap();
    assert_ne!(ours.span_context.trace_id(), client_trace);
    assert_eq!(ours.parent_span_id, SpanId::INVALID);
    let seen = up.last("/wx");
    assert_eq!(
        traceparent(&seen.headers["traceparent"]).0,
        ours.span_context.trace_id()
    );
    assert!(
        seen.headers.get("tracestate").is_none(),
        "{:?}",
        seen.headers
    );

    // Accepted: the request's span continues the client's trace.
    let gw = gateway(&up, |b| b.accept_traceparent(true));
    let res = read(
        gw.oneshot(request("/wx", &client, wechat("EV-2")))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(res.status, 200);
    let followed = traces.named("idempotency").pop().unwrap();
    assert_eq!(followed.span_context.trace_id(), client_trace);
    assert_eq!(
        followed.parent_span_id,
        SpanId::from_hex(CLIENT_SPAN).unwrap()
    );
    let upstream = traces.child(&followed, "upstream");
    let seen = up.last("/wx");
    let (trace, parent) = traceparent(&seen.headers["traceparent"]);
    assert_eq!(
        (trace, parent),
        (client_trace, upstream.span_context.span_id())
    );
    assert_eq!(seen.headers["tracestate"], "vendor=client");
}
