//! The gateway's request path step by step, in process: routing, the
//! forward to a loopback upstream, a whole first delivery and a replay
//! through a [`Gateway`] on one `wechatpay-v3` route; and the heap
//! allocations each of them makes per request (a counting global
//! allocator), printed before the timings.
//!
//! `cargo bench --features proxy --bench gateway_path -- --warm-up-time 1 --measurement-time 2`
//!
//! The other steps (key extraction, the store's claim, the channel reply)
//! are in `benches/stack.rs` (`layer/...`).

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion};
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use idempotency_gateway::proxy::{Forward, Gateway, RouteTable, Target};
use std::alloc::{GlobalAlloc, Layout, System};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use tower::{Service, ServiceExt};
use tower_idempotency::store::MemoryStore;
use tower_idempotency::Preset;

/// Counts every allocation (and reallocation) of the process.
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

#[allow(unsafe_code)] // a counting allocator cannot be written without it
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// A WeChat Pay v3 notification, as `benches/wrk_notify.lua` sends it.
fn notification(id: &str) -> Request<Full<Bytes>> {
    let body = format!(
        concat!(
            r#"{{"id":"{}","create_time":"2026-11-30T08:00:00+08:00","resource_type":"encrypt-resource","#,
            r#""event_type":"TRANSACTION.SUCCESS","summary":"支付成功","resource":{{"original_type":"transaction","#,
            r#""algorithm":"AEAD_AES_256_GCM","ciphertext":"sRvt4YOGXeWyk3qNrYBlQX0YTr1MrJLm1w6R3ExSlXY0mAEOWX2qHSGgmAjtmg8=","#,
            r#""associated_data":"transaction","nonce":"fdasflkja484w"}}}}"#
        ),
        id
    );
    Request::post("http://gateway.test/notify")
        .header("content-type", "application/json")
        .header("wechatpay-signature", "x")
        .header("wechatpay-timestamp", "1764460800")
        .header("wechatpay-nonce", "fdasflkja484w")
        .header(
            "wechatpay-serial",
            "5157F09EFDC096DE15EBE81A47057A7232F1B8E1",
        )
        .body(Full::new(Bytes::from(body)))
        .expect("a valid request")
}

/// A loopback upstream answering 200 with a small body, as nginx's
/// `return 200`; its address.
async fn upstream() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|_req: Request<Incoming>| async {
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok\n"))))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

/// Sends `req` through `svc` and reads the whole answer.
async fn drive<S, B>(svc: &S, req: Request<Full<Bytes>>)
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>, Error = Infallible> + Clone,
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let res = svc.clone().oneshot(req).await.unwrap();
    assert!(res.status().is_success(), "{}", res.status());
    let _ = res.into_body().collect().await.unwrap();
}

/// The allocations per request of `n` requests made by `make`.
fn allocations<F: std::future::Future<Output = ()>>(
    rt: &tokio::runtime::Runtime,
    n: u64,
    mut make: impl FnMut(u64) -> F,
) -> f64 {
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    for i in 0..n {
        rt.block_on(make(i));
    }
    (ALLOCATIONS.load(Ordering::Relaxed) - before) as f64 / n as f64
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let addr = rt.block_on(upstream());
    let forward = Forward::new(format!("http://{addr}").parse().unwrap());
    let gateway = Gateway::builder(forward.clone(), MemoryStore::new())
        .route("/", Target::Preset(Preset::wechatpay_v3()))
        .build()
        .unwrap();
    let counter = AtomicU64::new(0);
    let next = || format!("first-{}", counter.fetch_add(1, Ordering::Relaxed));

    // Warm: the pools' connections, the replayed record.
    rt.block_on(drive(&forward, notification("warm")));
    rt.block_on(drive(&gateway, notification("replayed")));

    let n = 2000;
    let fwd = allocations(&rt, n, |_| drive(&forward, notification("x")));
    let first = allocations(&rt, n, |i| {
        drive(&gateway, notification(&format!("alloc-{i}")))
    });
    let replay = allocations(&rt, n, |_| drive(&gateway, notification("replayed")));
    let request = allocations(&rt, n, |_| async {
        drop(notification("x"));
    });
    println!(
        "allocations per request: building the request {request:.1}, forward (client and \
         upstream) {fwd:.1}, gateway first delivery {first:.1}, gateway replay {replay:.1}"
    );

    let mut group = c.benchmark_group("gateway");
    let mut routes = RouteTable::new();
    for prefix in ["/", "/notify/stripe", "/notify/wechat", "/api"] {
        routes.insert(prefix, ()).unwrap();
    }
    group.bench_function("route/find", |b| {
        b.iter(|| routes.find(std::hint::black_box("/notify/wechat/v3")))
    });
    group.bench_function("forward", |b| {
        b.to_async(&rt).iter(|| drive(&forward, notification("x")))
    });
    group.bench_function("first", |b| {
        b.to_async(&rt)
            .iter(|| drive(&gateway, notification(&next())))
    });
    group.bench_function("replay", |b| {
        b.to_async(&rt)
            .iter(|| drive(&gateway, notification("replayed")))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
