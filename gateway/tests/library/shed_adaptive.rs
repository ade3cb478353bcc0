//! The adaptive cap of `InFlightLimitLayer::adaptive` (`AimdLimit`): it
//! grows under fast successes while in use, shrinks under failures and slow
//! calls (a call still unanswered at the threshold counts at once), stays
//! within its bounds, never takes back a slot a call holds, and under many
//! tasks at once never lets more calls in than its max nor loses a slot.
//!
//! Latencies are real: a fast call is far under its threshold and a slow
//! one far over it, so that a busy machine does not change the answers.

use test_support::common;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use idempotency_gateway::shed::{AimdLimit, InFlightLimit, InFlightLimitLayer, Slots};
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Semaphore;
use tower::{Service, ServiceExt};
use tower_idempotency::Outcome;

type Req = Request<Full<Bytes>>;
type Res = Response<Full<Bytes>>;

fn req() -> Req {
    Request::post("/").body(Full::new(Bytes::new())).unwrap()
}

/// A handler that sleeps `latency` and answers `status`.
fn answering(
    latency: Duration,
    status: StatusCode,
) -> impl Service<Req, Response = Res, Error = Infallible, Future = impl Send> + Clone + Send {
    tower::service_fn(move |_req: Req| async move {
        tokio::time::sleep(latency).await;
        let mut res = Response::new(Full::new(Bytes::new()));
        *res.status_mut() = status;
        Ok::<_, Infallible>(res)
    })
}

/// `calls` calls at once through `limit` to `inner`, each read to the end;
/// how many were shed.
async fn round<S>(limit: &InFlightLimitLayer, inner: S, calls: usize) -> usize
where
    S: Service<Req, Response = Res, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send,
{
    let mut tasks = Vec::new();
    for _ in 0..calls {
        let svc = InFlightLimit::new(inner.clone(), limit.clone());
        tasks.push(tokio::spawn(async move {
            let res = svc.oneshot(req()).await.unwrap();
            let shed = res.extensions().get::<Outcome>() == Some(&Outcome::Shed);
            let _ = res.into_body().collect().await;
            shed
        }));
    }
    let mut shed = 0;
    for t in tasks {
        shed += usize::from(t.await.unwrap());
    }
    shed
}

#[tokio::test]
async fn fast_successes_grow_the_limit_while_it_is_in_use() {
    // Only failures could shrink it: the threshold is far off.
    let aimd = AimdLimit::new()
        .min(2)
        .max(12)
        .initial(4)
        .latency_threshold(Duration::from_secs(30));
    let limit = InFlightLimitLayer::adaptive(aimd).queue_wait(Duration::ZERO);
    let slots = limit.slots().clone();
    let fast = answering(Duration::from_millis(10), StatusCode::OK);
    let mut seen = vec![slots.max()];
    for _ in 0..60 {
        // The whole limit in use: every call finds a slot.
        let shed = round(&limit, fast.clone(), slots.max()).await;
        assert_eq!(shed, 0);
        seen.push(slots.max());
    }
    assert!(seen.windows(2).all(|w| w[1] >= w[0]), "{seen:?}");
    assert_eq!(slots.max(), 12, "stops at max: {seen:?}");
    assert_eq!(slots.in_flight(), 0);
}

#[tokio::test]
async fn an_idle_limit_does_not_grow() {
    let aimd = AimdLimit::new()
        .initial(10)
        .latency_threshold(Duration::from_secs(30));
    let limit = InFlightLimitLayer::adaptive(aimd);
    let slots = limit.slots().clone();
    let fast = answering(Duration::from_millis(10), StatusCode::OK);
    for _ in 0..100 {
        // One call at a time: under half the limit in use.
        round(&limit, fast.clone(), 1).await;
    }
    assert_eq!(slots.max(), 10);
}

#[tokio::test]
async fn failures_shrink_the_limit_down_to_min() {
    let aimd = AimdLimit::new().min(3).max(50).initial(20).backoff(0.5);
    let limit = InFlightLimitLayer::adaptive(aimd);
    let slots = limit.slots().clone();
    let failing = answering(Duration::from_millis(10), StatusCode::SERVICE_UNAVAILABLE);
    round(&limit, failing.clone(), 1).await;
    assert_eq!(slots.max(), 10, "x0.5 once");
    round(&limit, failing.clone(), 1).await;
    assert_eq!(slots.max(), 5);
    for _ in 0..5 {
        round(&limit, failing.clone(), 1).await;
    }
    assert_eq!(slots.max(), 3, "never under min");
    // 429 counts as overload too; 4xx otherwise is a success.
    let limit = InFlightLimitLayer::adaptive(AimdLimit::new().initial(20));
    round(
        &limit,
        answering(Duration::ZERO, StatusCode::TOO_MANY_REQUESTS),
        1,
    )
    .await;
    assert_eq!(limit.slots().max(), 18);
    round(&limit, answering(Duration::ZERO, StatusCode::NOT_FOUND), 1).await;
    assert_eq!(limit.slots().max(), 18);
}

#[tokio::test]
async fn calls_over_the_threshold_shrink_the_limit() {
    // A fixed threshold.
    let aimd = AimdLimit::new()
        .initial(20)
        .latency_threshold(Duration::from_millis(100));
    let limit = InFlightLimitLayer::adaptive(aimd);
    round(&limit, answering(Duration::ZERO, StatusCode::OK), 1).await;
    assert_eq!(limit.slots().max(), 20);
    round(
        &limit,
        answering(Duration::from_millis(400), StatusCode::OK),
        1,
    )
    .await;
    assert_eq!(limit.slots().max(), 18);

    // Twice the measured baseline (the default tolerance).
    let limit = InFlightLimitLayer::adaptive(AimdLimit::new().initial(20));
    assert_eq!(limit.slots().latency_threshold(), None, "no baseline yet");
    round(
        &limit,
        answering(Duration::from_millis(50), StatusCode::OK),
        1,
    )
    .await;
    let threshold = limit.slots().latency_threshold().unwrap();
    assert!(
        threshold >= Duration::from_millis(100),
        "at least twice the baseline of a 50 ms call: {threshold:?}"
    );
    assert_eq!(limit.slots().max(), 20);
    round(&limit, answering(threshold * 3, StatusCode::OK), 1).await;
    assert_eq!(limit.slots().max(), 18);
}

/// A call still unanswered at the threshold counts as slow then; the
/// calls holding slots keep them when the limit shrinks under them; no new
/// call gets in until fewer than the new limit are in flight.
#[tokio::test]
async fn shrinking_never_takes_a_held_slot_back() {
    let aimd = AimdLimit::new()
        .min(1)
        .initial(10)
        .latency_threshold(Duration::from_millis(100));
    let limit = InFlightLimitLayer::adaptive(aimd).queue_wait(Duration::ZERO);
    let slots = limit.slots().clone();
    let gate = Arc::new(Semaphore::new(0));
    let running = Arc::new(AtomicUsize::new(0));
    let hung = {
        let (gate, running) = (gate.clone(), running.clone());
        tower::service_fn(move |_req: Req| {
            let (gate, running) = (gate.clone(), running.clone());
            async move {
                running.fetch_add(1, Ordering::SeqCst);
                gate.acquire().await.unwrap().forget();
                running.fetch_sub(1, Ordering::SeqCst);
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
            }
        })
    };
    let held: Vec<_> = (0..10)
        .map(|_| {
            let svc = InFlightLimit::new(hung.clone(), limit.clone());
            tokio::spawn(async move {
                let res = svc.oneshot(req()).await.unwrap();
                let _ = res.into_body().collect().await;
            })
        })
        .collect();
    while running.load(Ordering::SeqCst) < 10 {
        tokio::task::yield_now().await;
    }
    assert_eq!(slots.max(), 10);
    tokio::time::sleep(Duration::from_millis(400)).await;
    // Ten slow samples: 10 x 0.9^10 = 3.4.
    assert_eq!(slots.max(), 3, "shrunk while the calls still run");
    assert_eq!(running.load(Ordering::SeqCst), 10, "no call was stopped");
    assert_eq!(slots.in_flight(), 10);
    // 8 end: 2 in flight, under the new limit of 3: one more gets in.
    gate.add_permits(8);
    while slots.in_flight() > 2 {
        tokio::task::yield_now().await;
    }
    let svc = InFlightLimit::new(hung.clone(), limit.clone());
    let third = tokio::spawn(async move {
        let res = svc.oneshot(req()).await.unwrap();
        let _ = res.into_body().collect().await;
    });
    while running.load(Ordering::SeqCst) < 3 {
        tokio::task::yield_now().await;
    }
    // (A quick handler: were it let in, the test fails instead of hanging.)
    let quick = answering(Duration::ZERO, StatusCode::OK);
    let over = InFlightLimit::new(quick, limit.clone())
        .oneshot(req())
        .await
        .unwrap();
    assert_eq!(
        over.extensions().get::<Outcome>(),
        Some(&Outcome::Shed),
        "3 in flight at a limit of 3"
    );
    gate.add_permits(3);
    for t in held {
        t.await.unwrap();
    }
    third.await.unwrap();
    assert_eq!(slots.in_flight(), 0);
    assert_exact_capacity(&limit).await;
}

/// Exactly `slots.max()` calls fit at once: no slot lost, none extra.
async fn assert_exact_capacity(limit: &InFlightLimitLayer) {
    let slots = limit.slots().clone();
    let max = slots.max();
    let gate = Arc::new(Semaphore::new(0));
    let hung = {
        let gate = gate.clone();
        tower::service_fn(move |_req: Req| {
            let gate = gate.clone();
            async move {
                gate.acquire().await.unwrap().forget();
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
            }
        })
    };
    let limit = limit.clone().queue_wait(Duration::ZERO);
    let mut held = Vec::new();
    for _ in 0..max {
        let svc = InFlightLimit::new(hung.clone(), limit.clone());
        held.push(tokio::spawn(svc.oneshot(req())));
    }
    while slots.in_flight() < max {
        tokio::task::yield_now().await;
    }
    let quick = answering(Duration::ZERO, StatusCode::OK);
    let extra = InFlightLimit::new(quick, limit.clone())
        .oneshot(req())
        .await
        .unwrap();
    assert_eq!(extra.extensions().get::<Outcome>(), Some(&Outcome::Shed));
    gate.add_permits(max);
    for t in held {
        let res = t.await.unwrap().unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        let _ = res.into_body().collect().await;
    }
    assert_eq!(slots.in_flight(), 0);
}

/// A small seeded generator (xorshift64*): the schedule is printed on failure.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Many tasks at once on a multi-threaded runtime, each call fast, slow or
/// failing at random (seeded; `SHED_SEED=N` replays one): the calls inside
/// the handler never exceed the max, the limit stays within its bounds,
/// and once every call is over exactly the limit's slots are free.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_calls_never_pass_max_nor_lose_a_slot() {
    // Printed with the failure of any assertion below.
    let seed = common::seed("SHED_SEED");
    let (min, max) = (2, 16);
    let aimd = AimdLimit::new()
        .min(min)
        .max(max)
        .initial(8)
        .latency_threshold(Duration::from_millis(8));
    let limit = InFlightLimitLayer::adaptive(aimd).queue_wait(Duration::from_millis(2));
    let slots = limit.slots().clone();
    let inside = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let limits = Arc::new(Mutex::new(Vec::new()));
    let schedule = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    let mut rng = Rng(seed);
    for task in 0..48 {
        let mut rng = Rng(rng.next() | 1);
        let (limit, slots) = (limit.clone(), slots.clone());
        let (inside, peak) = (inside.clone(), peak.clone());
        let (limits, schedule) = (limits.clone(), schedule.clone());
        tasks.push(tokio::spawn(async move {
            for call in 0..40 {
                // 0: fast success, 1: slow success, 2: 503, 3: error-free 404.
                let kind = rng.below(10).min(3);
                let hold = Duration::from_micros(rng.below(4000));
                schedule.lock().unwrap().push((task, call, kind, hold));
                let (inside, peak) = (inside.clone(), peak.clone());
                let handler = tower::service_fn(move |_req: Req| {
                    let (inside, peak) = (inside.clone(), peak.clone());
                    async move {
                        let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                        peak.fetch_max(now, Ordering::SeqCst);
                        let took = if kind == 1 {
                            hold * 4 + Duration::from_millis(9)
                        } else {
                            hold
                        };
                        tokio::time::sleep(took).await;
                        inside.fetch_sub(1, Ordering::SeqCst);
                        let mut res = Response::new(Full::new(Bytes::new()));
                        *res.status_mut() = match kind {
                            2 => StatusCode::SERVICE_UNAVAILABLE,
                            3 => StatusCode::NOT_FOUND,
                            _ => StatusCode::OK,
                        };
                        Ok::<_, Infallible>(res)
                    }
                });
                let res = InFlightLimit::new(handler, limit.clone())
                    .oneshot(req())
                    .await
                    .unwrap();
                if rng.below(2) == 0 {
                    tokio::task::yield_now().await;
                }
                let _ = res.into_body().collect().await;
                limits.lock().unwrap().push(slots.max());
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let context = || {
        let schedule = schedule.lock().unwrap();
        format!(
            "seed {seed} (replay: SHED_SEED={seed}); first calls of the schedule \
             (task, call, kind, hold): {:?}",
            &schedule[..schedule.len().min(40)]
        )
    };
    let peak = peak.load(Ordering::SeqCst);
    assert!(
        peak <= max,
        "{peak} calls at once over max {max}; {}",
        context()
    );
    let limits = limits.lock().unwrap().clone();
    assert!(
        limits.iter().all(|l| (min..=max).contains(l)),
        "a limit out of [{min}, {max}]: {limits:?}; {}",
        context()
    );
    assert_eq!(slots.in_flight(), 0, "{}", context());
    assert_exact_capacity(&limit).await;
}

#[test]
fn the_builder_keeps_its_values_within_bounds() {
    let d = AimdLimit::new();
    assert_eq!(AimdLimit::default(), d);
    assert_eq!(
        (d.get_min(), d.get_max(), d.get_initial()),
        (1, 200, 20),
        "defaults"
    );
    assert_eq!(d.get_backoff(), 0.9);
    assert_eq!(d.get_tolerance(), 2.0);
    assert_eq!(d.get_latency_threshold(), None);
    let odd = AimdLimit::new()
        .min(0)
        .max(0)
        .initial(9)
        .backoff(0.1)
        .tolerance(0.2);
    assert_eq!((odd.get_min(), odd.get_max(), odd.get_initial()), (1, 1, 1));
    assert_eq!(odd.get_backoff(), 0.5);
    assert_eq!(odd.get_tolerance(), 1.0);
    let slots = Slots::adaptive(AimdLimit::new().min(5).max(8).initial(30));
    assert_eq!(slots.max(), 8);
}

/// Values no limit can work with are refused by `validate`, and used
/// anyway they never panic: an infinite tolerance, a threshold of
/// `Duration::MAX`, a min past the semaphore's bound.
#[tokio::test]
async fn extreme_values_are_errors_not_panics() {
    for bad in [
        AimdLimit::new().tolerance(f64::INFINITY),
        AimdLimit::new().tolerance(f64::NAN),
        AimdLimit::new().latency_threshold(Duration::MAX),
        AimdLimit::new().latency_threshold(Duration::ZERO),
        AimdLimit::new().min(usize::MAX),
        AimdLimit::new().max(3).min(5),
        AimdLimit::new().backoff(f64::INFINITY),
    ] {
        assert!(bad.validate().is_err(), "{bad:?} validated");
        // Used anyway: calls run, fast and slow, without a panic.
        let limit = InFlightLimitLayer::adaptive(bad);
        round(&limit, answering(Duration::ZERO, StatusCode::OK), 2).await;
        round(
            &limit,
            answering(Duration::from_millis(30), StatusCode::OK),
            2,
        )
        .await;
        assert!(limit.slots().max() >= 1);
    }
    assert!(AimdLimit::new().validate().is_ok());
}
