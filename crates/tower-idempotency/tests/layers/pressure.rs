//! Exactly once under pressure: hung and slow handlers, endless answers,
//! callers hanging up at the worst moment, trailers over HTTP/1.1, slow
//! store calls, and the background work a server waits for at shutdown.

use test_support::common;

use bytes::Bytes;
use common::faults::{FaultStore, Faults, Op};
use common::{client, post, read, request, serve, Counter};
use http::{Request, Response};
use http_body_util::{BodyExt, Full, StreamBody};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tower::{service_fn, ServiceBuilder, ServiceExt};
use tower_idempotency::store::StoreError;
use tower_idempotency::token::IssueToken;
use tower_idempotency::{IdempotencyLayer, Outcome, Preset, TaskTracker};

fn key_req(key: &str) -> Request<Full<Bytes>> {
    request("/orders", &[("idempotency-key", key)], "{}")
}

fn ok(body: impl Into<Bytes>) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(Response::new(Full::new(body.into())))
}

/// Slows down or holds chosen calls of the memory store.
#[derive(Clone, Default)]
struct Slow {
    complete_delay: Option<Duration>,
    put_token_delay: Option<Duration>,
    /// When set, `renew` signals `renew_entered` and then waits for
    /// `renew_release`.
    hold_renew: bool,
    renew_entered: Arc<Notify>,
    renew_release: Arc<Notify>,
}

impl Faults for Slow {
    async fn before(&self, op: Op, _key: &str) -> Result<(), StoreError> {
        let delay = match op {
            Op::Complete => self.complete_delay,
            Op::PutToken => self.put_token_delay,
            Op::Renew if self.hold_renew => {
                self.renew_entered.notify_one();
                self.renew_release.notified().await;
                None
            }
            _ => None,
        };
        if let Some(d) = delay {
            tokio::time::sleep(d).await;
        }
        Ok(())
    }
}

// ------------------------------------------------------------ run limit

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_handler_is_cancelled_at_the_run_limit_and_the_key_runs_again() {
    let runs = Counter::default();
    let r = runs.clone();
    let handler = service_fn(move |_req: Request<Full<Bytes>>| {
        let n = r.bump();
        async move {
            if n == 1 {
                std::future::pending::<()>().await; // hangs for ever
            }
            ok(format!("order {n}"))
        }
    });
    let svc = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::idempotency_key()
                .lease(Duration::from_millis(300))
                .max_run(Duration::from_secs(1))
                .wait(Duration::ZERO),
        )
        .service(handler);
    let first = tokio::spawn(svc.clone().oneshot(key_req("hung")));
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (s, b, replayed) = {
        let a = read(svc.clone().oneshot(key_req("hung")).await.unwrap()).await;
        (a.status, a.text(), a.replayed())
    };
    assert_eq!((s, b.as_str(), replayed), (200, "order 2", false));
    let first = tokio::time::timeout(Duration::from_secs(5), first)
        .await
        .expect("the hung call answered at its run limit")
        .unwrap()
        .unwrap();
    assert_eq!(first.status(), 503);
    assert_eq!(first.headers()["retry-after"], "1");
    assert_eq!(
        first.extensions().get::<Outcome>(),
        Some(&Outcome::RunLimitExceeded)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_past_the_run_limit_gets_its_failure_reply() {
    let handler = service_fn(|_req: Request<Full<Bytes>>| async {
        std::future::pending::<()>().await;
        ok("never")
    });
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::alipay().max_run(Duration::from_millis(300)))
        .service(handler);
    let body =
        "notify_id=n1&out_trade_no=o1&trade_no=t1&trade_status=TRADE_SUCCESS&total_amount=1.00";
    let req = request(
        "/notify/alipay",
        &[("content-type", "application/x-www-form-urlencoded")],
        body,
    );
    let a = tokio::time::timeout(Duration::from_secs(5), svc.oneshot(req))
        .await
        .expect("answered at the run limit")
        .unwrap();
    let a = read(a).await;
    assert_eq!((a.status, a.text().as_str()), (500, "fail"));
}

// ------------------------------------------------------- reply deadline

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_reply_deadline_the_call_goes_on_and_its_success_is_replayed() {
    let runs = Counter::default();
    let r = runs.clone();
    let handler = service_fn(move |_req: Request<Full<Bytes>>| {
        let n = r.bump();
        async move {
            tokio::time::sleep(Duration::from_secs(3)).await;
            ok(format!("order {n}"))
        }
    });
    let layer = IdempotencyLayer::idempotency_key()
        .reply_timeout(Duration::from_secs(1))
        .wait(Duration::ZERO);
    let tasks = layer.tasks().clone();
    let svc = ServiceBuilder::new().layer(layer).service(handler);
    let (addr, _server) = serve(svc).await;
    let http = client();
    let started = tokio::time::Instant::now();
    let h = &[("idempotency-key", "slow")];
    let first = post(&http, addr, "/orders", h, "{}").await;
    assert_eq!(first.status, 503, "{}", first.text());
    assert_eq!(first.headers["retry-after"], "1");
    tokio::time::sleep_until(started + Duration::from_millis(1500)).await;
    let second = post(&http, addr, "/orders", h, "{}").await;
    assert_eq!(second.status, 409, "{}", second.text());
    assert_eq!(second.headers["retry-after"], "1");
    tokio::time::sleep_until(started + Duration::from_millis(4500)).await;
    let third = post(&http, addr, "/orders", h, "{}").await;
    assert_eq!(
        (third.status, third.text().as_str(), third.replayed()),
        (200, "order 1", true)
    );
    assert_eq!(runs.get(), 1, "one execution in all");
    tasks.close();
    tokio::time::timeout(Duration::from_secs(2), tasks.wait())
        .await
        .expect("no background work left");
}

// --------------------------------------------------- streamed responses

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_success_stream_arrives_at_once_and_is_not_buffered() {
    const CHUNK: usize = 16 * 1024;
    let produced = Arc::new(AtomicU64::new(0));
    let p = produced.clone();
    let handler = service_fn(move |_req: Request<Full<Bytes>>| {
        let p = p.clone();
        async move {
            let frames = futures_util::stream::unfold((), move |()| {
                let p = p.clone();
                async move {
                    p.fetch_add(CHUNK as u64, Ordering::SeqCst);
                    let frame = http_body::Frame::data(Bytes::from(vec![b'x'; CHUNK]));
                    Some((Ok::<_, Infallible>(frame), ()))
                }
            });
            Ok::<_, Infallible>(Response::new(StreamBody::new(frames)))
        }
    });
    let layer = IdempotencyLayer::idempotency_key()
        .max_cached_body_bytes(64 * 1024)
        .max_run(Duration::from_secs(4));
    let tasks = layer.tasks().clone();
    let svc = ServiceBuilder::new().layer(layer).service(handler);
    let res = tokio::time::timeout(
        Duration::from_secs(5),
        svc.clone().oneshot(key_req("endless")),
    )
    .await
    .expect("the head of an endless answer arrives")
    .unwrap();
    assert_eq!(res.status(), 200);
    let mut body = Box::pin(res.into_body());
    let mut consumed = 0u64;
    while consumed < 8 * 1024 * 1024 {
        let frame = body.frame().await.expect("endless").unwrap();
        consumed += frame.into_data().map_or(0, |d| d.len() as u64);
        // What the handler produced but the caller has not read yet is what
        // the layer holds: a few chunks, whatever the size of the answer.
        let held = produced.load(Ordering::SeqCst) - consumed;
        assert!(held <= 8 * CHUNK as u64, "the layer holds {held} bytes");
    }
    // The caller stops reading: the rest is drained in the background,
    // bounded by the run limit, then the claim is released.
    drop(body);
    tasks.close();
    tokio::time::timeout(Duration::from_secs(10), tasks.wait())
        .await
        .expect("the background drain ends at the run limit");
}

/// A success whose body is an endless run of empty frames, every one ready
/// at once: the head still arrives, and the run limit still ends the call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_run_of_empty_frames_does_not_hold_the_thread() {
    let handler = service_fn(move |_req: Request<Full<Bytes>>| async move {
        let frames = futures_util::stream::repeat_with(|| {
            Ok::<_, Infallible>(http_body::Frame::data(Bytes::new()))
        });
        Ok::<_, Infallible>(Response::new(StreamBody::new(frames)))
    });
    let layer = IdempotencyLayer::idempotency_key().max_run(Duration::from_secs(2));
    let tasks = layer.tasks().clone();
    let svc = ServiceBuilder::new().layer(layer).service(handler);
    let res = tokio::time::timeout(Duration::from_secs(5), svc.oneshot(key_req("empty")))
        .await
        .expect("the head of an endless answer arrives")
        .unwrap();
    assert_eq!(res.status(), 200);
    drop(res);
    tasks.close();
    tokio::time::timeout(Duration::from_secs(10), tasks.wait())
        .await
        .expect("the call ends at the run limit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_success_over_the_cache_limit_is_streamed_and_its_replay_says_so() {
    let runs = Counter::default();
    let r = runs.clone();
    let handler = service_fn(move |_req: Request<Full<Bytes>>| {
        r.bump();
        async move {
            let frames = (0..64).map(|_| {
                Ok::<_, Infallible>(http_body::Frame::data(Bytes::from(vec![b'y'; 4096])))
            });
            let body = StreamBody::new(futures_util::stream::iter(frames));
            Ok::<_, Infallible>(Response::builder().status(201).body(body).unwrap())
        }
    });
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key().max_cached_body_bytes(10_000))
        .service(handler);
    let first = read(svc.clone().oneshot(key_req("big")).await.unwrap()).await;
    assert_eq!((first.status, first.body.len()), (201, 64 * 4096));
    let again = read(svc.clone().oneshot(key_req("big")).await.unwrap()).await;
    assert_eq!((again.status, again.body.len()), (201, 0));
    assert_eq!(again.headers["idempotent-body-omitted"], "true");
    assert_eq!(runs.get(), 1);
}

/// A body that, like hyper's, announces what is left of it; its second
/// frame is not ready at the first poll.
struct Shrinking {
    frames: std::collections::VecDeque<Bytes>,
    waited: bool,
}

impl http_body::Body for Shrinking {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        if self.frames.len() == 1 && !self.waited {
            self.waited = true;
            cx.waker().wake_by_ref();
            return std::task::Poll::Pending;
        }
        std::task::Poll::Ready(
            self.frames
                .pop_front()
                .map(|b| Ok(http_body::Frame::data(b))),
        )
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.frames.iter().map(|b| b.len() as u64).sum())
    }
}

/// A streamed first answer announces its whole size, the part read before
/// its head went out included (hyper frames the answer by it).
#[tokio::test]
async fn a_streamed_first_answer_announces_its_whole_size() {
    let handler = service_fn(|_req: Request<Full<Bytes>>| async {
        let frames = [Bytes::from(vec![b'a'; 8000]), Bytes::from(vec![b'b'; 3000])];
        let body = Shrinking {
            frames: frames.into_iter().collect(),
            waited: false,
        };
        Ok::<_, Infallible>(Response::new(body))
    });
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key())
        .service(handler);
    let res = svc.oneshot(key_req("whole-size")).await.unwrap();
    assert_eq!(http_body::Body::size_hint(res.body()).exact(), Some(11_000));
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body.len(), 11_000);
}

/// The run limit bounds the call, not the caller's reading: a caller that
/// holds a streamed success without reading it past the limit is let go
/// (its body ends in error), and the success is still recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_stops_reading_past_the_run_limit_does_not_make_the_call_run_again() {
    let runs = Counter::default();
    let r = runs.clone();
    let handler = service_fn(move |_req: Request<Full<Bytes>>| {
        r.bump();
        async move {
            let frames = (0..1024).map(|_| {
                Ok::<_, Infallible>(http_body::Frame::data(Bytes::from(vec![b'z'; 4096])))
            });
            let body = StreamBody::new(futures_util::stream::iter(frames));
            Ok::<_, Infallible>(Response::new(body))
        }
    });
    let svc = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::idempotency_key()
                .max_cached_body_bytes(10_000)
                .max_run(Duration::from_millis(300)),
        )
        .service(handler);
    let first = svc.clone().oneshot(key_req("stops")).await.unwrap();
    assert_eq!(first.status(), 200);
    tokio::time::sleep(Duration::from_millis(900)).await;
    let cut = first.into_body().collect().await;
    assert!(cut.is_err(), "a body cut short must end in error");
    let again = read(svc.clone().oneshot(key_req("stops")).await.unwrap()).await;
    assert_eq!(again.status, 200);
    assert_eq!(again.headers["idempotent-replayed"], "true");
    assert_eq!(again.headers["idempotent-body-omitted"], "true");
    assert_eq!(runs.get(), 1, "the call ran again");
}

/// A handler whose first answer is a 200 whose body fails half way, and
/// whose later answers are a 200 with `whole`.
fn half_then_whole(
    runs: Counter,
    whole: &'static [u8],
) -> impl tower::Service<
    Request<Full<Bytes>>,
    Response = Response<StreamBody<futures_util::stream::Iter<std::vec::IntoIter<HalfFrame>>>>,
    Error = Infallible,
    Future = impl Send,
> + Clone {
    service_fn(move |_req: Request<Full<Bytes>>| {
        let n = runs.bump();
        async move {
            let frames: Vec<HalfFrame> = if n == 1 {
                vec![
                    Ok(http_body::Frame::data(Bytes::from_static(b"half"))),
                    Err(std::io::Error::other("upstream reset")),
                ]
            } else {
                vec![Ok(http_body::Frame::data(Bytes::from_static(whole)))]
            };
            Ok::<_, Infallible>(Response::new(StreamBody::new(futures_util::stream::iter(
                frames,
            ))))
        }
    })
}

type HalfFrame = Result<http_body::Frame<Bytes>, std::io::Error>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_success_body_that_fails_half_way_releases_the_claim() {
    let runs = Counter::default();
    let r = runs.clone();
    let handler = half_then_whole(r, b"whole");
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key())
        .service(handler);
    let res = svc.clone().oneshot(key_req("half")).await.unwrap();
    assert!(
        res.into_body().collect().await.is_err(),
        "the caller sees the error"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    let a = read(svc.clone().oneshot(key_req("half")).await.unwrap()).await;
    assert_eq!(
        (a.status, a.text().as_str(), a.replayed()),
        (200, "whole", false)
    );
    assert_eq!(runs.get(), 2);
}

/// A channel is told "success" only once the record is kept, and a success
/// whose body fails half way gets the channel's failure reply (the claim is
/// released, so the retry runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_hears_success_only_after_the_record_is_kept() {
    let runs = Counter::default();
    let r = runs.clone();
    let handler = half_then_whole(r, b"done");
    let store = tower_idempotency::store::MemoryStore::new();
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::alipay().with_store(store.clone()))
        .service(handler);
    let body =
        "notify_id=n2&out_trade_no=o2&trade_no=t2&trade_status=TRADE_SUCCESS&total_amount=1.00";
    let req = || {
        request(
            "/notify/alipay",
            &[("content-type", "application/x-www-form-urlencoded")],
            body,
        )
    };
    let a = read(svc.clone().oneshot(req()).await.unwrap()).await;
    assert_eq!(
        (a.status, a.text().as_str()),
        (500, "fail"),
        "a body that failed half way is no success"
    );
    assert_eq!(store.len(), 0, "nothing recorded for the failed body");
    let b = read(svc.clone().oneshot(req()).await.unwrap()).await;
    assert_eq!((b.status, b.text().as_str()), (200, "success"));
    assert_eq!(
        store.len(),
        1,
        "the record is kept before the channel hears success"
    );
    let c = read(svc.clone().oneshot(req()).await.unwrap()).await;
    assert_eq!(
        (c.status, c.text().as_str(), c.replayed()),
        (200, "success", true)
    );
    assert_eq!(runs.get(), 2);
}

// ------------------------------------------------------------- trailers

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trailers_cross_http1_on_the_first_answer_and_on_replays() {
    let runs = Counter::default();
    let r = runs.clone();
    let handler = service_fn(move |_req: Request<Full<Bytes>>| {
        r.bump();
        async move {
            let mut trailers = http::HeaderMap::new();
            trailers.insert("x-checksum", "abc".parse().unwrap());
            let frames = vec![
                Ok::<_, Infallible>(http_body::Frame::data(Bytes::from_static(b"paid"))),
                Ok(http_body::Frame::trailers(trailers)),
            ];
            let res = Response::builder()
                .header("trailer", "x-checksum")
                .body(StreamBody::new(futures_util::stream::iter(frames)))
                .unwrap();
            Ok::<_, Infallible>(res)
        }
    });
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key())
        .service(handler);
    let (addr, _server) = serve(svc).await;
    let http = client(); // HTTP/1.1 over TCP
    let h = &[("idempotency-key", "trl"), ("te", "trailers")];
    for replayed in [false, true] {
        let a = post(&http, addr, "/orders", h, "{}").await;
        assert_eq!(
            (a.status, a.text().as_str(), a.replayed()),
            (200, "paid", replayed)
        );
        let trailers = a
            .trailers
            .unwrap_or_else(|| panic!("trailers lost (replay: {replayed})"));
        assert_eq!(trailers["x-checksum"], "abc");
    }
    assert_eq!(runs.get(), 1);
}

// ------------------------------------------------------- client tokens

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_token_submit_gives_the_token_back_before_its_copy_claims() {
    let store = FaultStore::new(Slow {
        put_token_delay: Some(Duration::from_millis(300)),
        ..Slow::default()
    });
    let runs = Counter::default();
    let r = runs.clone();
    let handler = service_fn(move |_req: Request<Full<Bytes>>| {
        let n = r.bump();
        async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let mut res = Response::new(Full::new(Bytes::from(format!("order {n}"))));
            *res.status_mut() = if n == 1 {
                http::StatusCode::SERVICE_UNAVAILABLE
            } else {
                http::StatusCode::CREATED
            };
            Ok::<_, Infallible>(res)
        }
    });
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::new_in(
            Preset::client_token(),
            store.clone(),
        ))
        .service(handler);
    let issued = read(
        IssueToken::new(store.clone())
            .oneshot(
                Request::get("/orders/token")
                    .header("authorization", "Bearer alice")
                    .body(())
                    .unwrap(),
            )
            .await
            .unwrap(),
    )
    .await;
    let v: serde_json::Value = serde_json::from_slice(&issued.body).unwrap();
    let token = v["token"].as_str().unwrap().to_owned();
    let submit = || {
        request(
            "/orders",
            &[
                ("idempotency-token", &token),
                ("authorization", "Bearer alice"),
            ],
            r#"{"sku":"tea"}"#,
        )
    };
    // A double click: the second copy waits on the first, which fails.
    let first = tokio::spawn(svc.clone().oneshot(submit()));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let second = read(svc.clone().oneshot(submit()).await.unwrap()).await;
    let first = read(first.await.unwrap().unwrap()).await;
    assert_eq!(first.status, 503);
    assert_eq!((second.status, second.text().as_str()), (201, "order 2"));
}

// --------------------------------------------- completion and renewal

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_hanging_up_during_completion_does_not_lose_the_success() {
    let store = FaultStore::new(Slow {
        complete_delay: Some(Duration::from_millis(300)),
        ..Slow::default()
    });
    let runs = Counter::default();
    let r = runs.clone();
    let handler = service_fn(move |_req: Request<Full<Bytes>>| {
        let n = r.bump();
        async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            ok(format!("order {n}"))
        }
    });
    let svc = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::idempotency_key()
                .with_store(store)
                .finish_on_disconnect(false),
        )
        .service(handler);
    // The caller hangs up while the record is being written (its body ends
    // once the record is stored).
    let svc2 = svc.clone();
    let cut = tokio::time::timeout(Duration::from_millis(200), async move {
        let res = svc2.oneshot(key_req("c")).await.unwrap();
        res.into_body().collect().await
    })
    .await;
    assert!(cut.is_err());
    tokio::time::sleep(Duration::from_millis(600)).await;
    let a = read(svc.clone().oneshot(key_req("c")).await.unwrap()).await;
    assert_eq!(
        (a.status, a.text().as_str(), a.replayed()),
        (200, "order 1", true)
    );
    assert_eq!(runs.get(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inner_call_keeps_running_while_a_renewal_is_in_flight() {
    let store = FaultStore::new(Slow {
        hold_renew: true,
        ..Slow::default()
    });
    let entered = store.renew_entered.clone();
    let release = store.renew_release.clone();
    let go = Arc::new(Notify::new());
    let g = go.clone();
    let handler = service_fn(move |_req: Request<Full<Bytes>>| {
        let g = g.clone();
        async move {
            g.notified().await;
            ok("done")
        }
    });
    let svc = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::idempotency_key()
                .with_store(store)
                .lease(Duration::from_millis(300))
                .store_timeout(Duration::from_secs(30)),
        )
        .service(handler);
    let call = tokio::spawn(svc.clone().oneshot(key_req("r")));
    entered.notified().await; // a renewal is now in flight, and stays so
    go.notify_one();
    let res = tokio::time::timeout(Duration::from_secs(5), call).await;
    release.notify_waiters();
    let a = read(
        res.expect("answered while the renewal hung")
            .unwrap()
            .unwrap(),
    )
    .await;
    assert_eq!((a.status, a.text().as_str()), (200, "done"));
}

// ---------------------------------------------------- background work

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_work_is_tracked_and_awaited_at_shutdown() {
    let runs = Counter::default();
    let r = runs.clone();
    let handler = service_fn(move |_req: Request<Full<Bytes>>| {
        let n = r.bump();
        async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            ok(format!("order {n}"))
        }
    });
    let tracker = TaskTracker::new();
    let layer = IdempotencyLayer::idempotency_key()
        .wait(Duration::ZERO)
        .task_tracker(tracker.clone());
    assert!(layer.tasks().is_empty());
    let svc = ServiceBuilder::new().layer(layer).service(handler);
    let cut = tokio::time::timeout(
        Duration::from_millis(100),
        svc.clone().oneshot(key_req("bg")),
    )
    .await;
    assert!(cut.is_err(), "the caller hung up");
    assert!(!tracker.is_empty(), "the finishing call is tracked");
    tracker.close();
    tokio::time::timeout(Duration::from_secs(5), tracker.wait())
        .await
        .expect("background work ends");
    // Once the tracker is done, the success is recorded.
    let a = read(svc.clone().oneshot(key_req("bg")).await.unwrap()).await;
    assert_eq!(
        (a.status, a.text().as_str(), a.replayed()),
        (200, "order 1", true)
    );
    assert_eq!(runs.get(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issuing_a_token_is_bounded_by_the_store_timeout() {
    let store = FaultStore::new(Slow {
        put_token_delay: Some(Duration::from_secs(30)),
        ..Slow::default()
    });
    let issuer = IssueToken::new(store).store_timeout(Duration::from_millis(100));
    let req = Request::get("/orders/token").body(()).unwrap();
    let res = tokio::time::timeout(Duration::from_secs(5), issuer.oneshot(req))
        .await
        .expect("answered at the store timeout")
        .unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(res.headers()["retry-after"], "1");
}
