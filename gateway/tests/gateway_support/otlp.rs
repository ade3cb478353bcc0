//! A small OTLP/HTTP collector on loopback: a hyper server that takes
//! `POST /v1/traces` (protobuf), keeps every span it decodes and answers
//! as a collector does.
#![allow(dead_code)]

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message as _;
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// A span as the collector got it: ids in hex, string attributes.
#[derive(Debug, Clone)]
pub struct Span {
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    pub attributes: BTreeMap<String, String>,
    /// The resource's `service.name`.
    pub service: String,
}

/// A running collector; stopped on drop.
pub struct Collector {
    pub addr: SocketAddr,
    spans: Arc<Mutex<Vec<Span>>>,
    task: JoinHandle<()>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn decode(body: &[u8]) -> Vec<Span> {
    let request = ExportTraceServiceRequest::decode(body).expect("an OTLP trace export");
    let mut spans = Vec::new();
    for resource in request.resource_spans {
        let attributes = resource.resource.map(|r| r.attributes).unwrap_or_default();
        let service = attributes
            .iter()
            .find(|kv| kv.key == "service.name")
            .and_then(|kv| kv.value.as_ref()?.value.as_ref())
            .map(text)
            .unwrap_or_default();
        for scope in resource.scope_spans {
            for span in scope.spans {
                spans.push(Span {
                    name: span.name,
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: hex(&span.parent_span_id),
                    attributes: (span.attributes.iter())
                        .filter_map(|kv| {
                            let value = kv.value.as_ref()?.value.as_ref()?;
                            Some((kv.key.clone(), text(value)))
                        })
                        .collect(),
                    service: service.clone(),
                });
            }
        }
    }
    spans
}

fn text(value: &Value) -> String {
    match value {
        Value::StringValue(s) => s.clone(),
        Value::IntValue(n) => n.to_string(),
        Value::BoolValue(b) => b.to_string(),
        Value::DoubleValue(f) => f.to_string(),
        other => format!("{other:?}"),
    }
}

impl Collector {
    /// Listens on 127.0.0.1:0.
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let spans: Arc<Mutex<Vec<Span>>> = Arc::default();
        let kept = spans.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let kept = kept.clone();
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let kept = kept.clone();
                    async move {
                        let path = req.uri().path().to_owned();
                        let body = req.into_body().collect().await.unwrap().to_bytes();
                        assert_eq!(path, "/v1/traces", "the OTLP/HTTP traces path");
                        kept.lock().unwrap().extend(decode(&body));
                        let answer = ExportTraceServiceResponse::default().encode_to_vec();
                        Ok::<_, Infallible>(
                            Response::builder()
                                .header("content-type", "application/x-protobuf")
                                .body(Full::new(Bytes::from(answer)))
                                .unwrap(),
                        )
                    }
                });
                tokio::spawn(async move {
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Self { addr, spans, task }
    }

    /// `http://ADDR`: the base endpoint (`/v1/traces` is added).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span so far.
    pub fn spans(&self) -> Vec<Span> {
        self.spans.lock().unwrap().clone()
    }

    /// Waits (at most `within`) for `n` spans named `name`.
    pub async fn wait_for(&self, name: &str, n: usize, within: Duration) -> Vec<Span> {
        let deadline = Instant::now() + within;
        loop {
            let found: Vec<Span> = (self.spans().into_iter())
                .filter(|s| s.name == name)
                .collect();
            if found.len() >= n || Instant::now() > deadline {
                return found;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.task.abort();
    }
}
