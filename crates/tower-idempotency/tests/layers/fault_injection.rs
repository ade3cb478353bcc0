//! Randomized fault injection: a deterministic seed drives schedules of
//! concurrent copies, callers hanging up, handler failures and panics, and a
//! store that fails or times out around the memory store; after each
//! schedule the model is checked.
//!
//! `FAULT_SEED=<n>` replays one schedule (the seed is printed on failure);
//! `FAULT_SCHEDULES=<n>` runs more (200 by default).

use test_support::common;

use bytes::Bytes;
use common::faults::{backend_error, FaultStore, Faults, Op};
use common::{read, request};
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tower::{service_fn, ServiceBuilder, ServiceExt};
use tower_idempotency::store::StoreError;
use tower_idempotency::{IdempotencyLayer, TaskTracker};

/// xorshift64*: small, deterministic, good enough for schedules.
#[derive(Clone)]
struct Rng(Arc<Mutex<u64>>);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(Arc::new(Mutex::new(
            seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
        )))
    }
    fn next(&self) -> u64 {
        let mut s = self.0.lock().unwrap();
        *s ^= *s >> 12;
        *s ^= *s << 25;
        *s ^= *s >> 27;
        s.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// The faults injected into the memory store: errors before or after the
/// store acted, and calls slower than the store timeout.
#[derive(Clone)]
struct Faulty {
    rng: Rng,
    /// Keys whose completion already failed once (a completion fails at
    /// most once per key, so the background retry gets it through).
    complete_failed: Arc<Mutex<std::collections::HashSet<String>>>,
}

fn injected() -> StoreError {
    backend_error("injected fault")
}

impl Faulty {
    async fn fault(&self) -> Result<(), StoreError> {
        match self.rng.below(100) {
            0..=3 => Err(injected()),
            4..=5 => {
                tokio::time::sleep(Duration::from_millis(80)).await; // past the timeout
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

impl Faults for Faulty {
    async fn before(&self, op: Op, key: &str) -> Result<(), StoreError> {
        match op {
            Op::Claim | Op::Renew => self.fault().await,
            Op::Complete => {
                if self.rng.chance(10)
                    && self.complete_failed.lock().unwrap().insert(key.to_owned())
                {
                    return Err(injected());
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }
    async fn after(&self, op: Op, _key: &str) -> Result<(), StoreError> {
        // Sometimes the store acted but the answer is lost.
        if op == Op::Claim && self.rng.chance(4) {
            return Err(injected());
        }
        Ok(())
    }
}

/// What the handler saw, per key.
#[derive(Default)]
struct Model {
    running: HashMap<String, usize>,
    executions: HashMap<String, usize>,
    successes: HashMap<String, Vec<String>>,
    violations: Vec<String>,
}

async fn schedule(seed: u64) -> Result<(), String> {
    let rng = Rng::new(seed);
    let store = FaultStore::new(Faulty {
        rng: rng.clone(),
        complete_failed: Default::default(),
    });
    let model = Arc::new(Mutex::new(Model::default()));
    let (m, r) = (model.clone(), rng.clone());
    let handler = service_fn(move |req: Request<Full<Bytes>>| {
        let key = req.headers()["idempotency-key"]
            .to_str()
            .unwrap()
            .to_owned();
        let (m, r) = (m.clone(), r.clone());
        async move {
            let n = {
                let mut m = m.lock().unwrap();
                let running = m.running.entry(key.clone()).or_default();
                *running += 1;
                let running = *running;
                if running > 1 {
                    m.violations
                        .push(format!("{key}: {running} executions at once"));
                }
                if m.successes.get(&key).is_some_and(|s| !s.is_empty()) {
                    m.violations
                        .push(format!("{key}: ran again after a success"));
                }
                let n = m.executions.entry(key.clone()).or_default();
                *n += 1;
                *n
            };
            // Decrements `running` however this ends (panic, cancellation).
            struct Running(Arc<Mutex<Model>>, String);
            impl Drop for Running {
                fn drop(&mut self) {
                    if let Ok(mut m) = self.0.lock() {
                        *m.running.get_mut(&self.1).unwrap() -= 1;
                    }
                }
            }
            let _running = Running(m.clone(), key.clone());
            tokio::time::sleep(Duration::from_millis(r.below(6))).await;
            let roll = r.below(100);
            if roll < 8 {
                panic!("injected handler panic");
            }
            if roll < 30 {
                let mut res = Response::new(Full::new(Bytes::from_static(b"failed")));
                *res.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                return Ok::<_, Infallible>(res);
            }
            let body = format!("{key} run {n} {}", "x".repeat(r.below(64) as usize));
            m.lock()
                .unwrap()
                .successes
                .entry(key.clone())
                .or_default()
                .push(body.clone());
            Ok(Response::new(Full::new(Bytes::from(body))))
        }
    });
    let tracker = TaskTracker::new();
    let svc = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::idempotency_key()
                .with_store(store)
                .store_timeout(Duration::from_millis(40))
                .wait(Duration::from_millis(rng.below(30)))
                .finish_on_disconnect(true)
                .task_tracker(tracker.clone()),
        )
        .service(handler);
    let keys = 1 + rng.below(3);
    let mut copies = Vec::new();
    for i in 0..(2 + rng.below(10)) {
        let key = format!("k{}", i % keys);
        let svc = svc.clone();
        let delay = Duration::from_millis(rng.below(8));
        let cut = rng.chance(25).then(|| Duration::from_millis(rng.below(8)));
        copies.push(tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let call = async {
                let res = svc
                    .oneshot(request("/orders", &[("idempotency-key", &key)], "{}"))
                    .await;
                read(res.unwrap()).await
            };
            let answer = match cut {
                Some(cut) => tokio::time::timeout(cut, call).await.ok(),
                None => Some(call.await),
            };
            (key, answer)
        }));
    }
    let mut answers = Vec::new();
    for c in copies {
        answers.push(c.await.map_err(|e| format!("copy panicked: {e}"))?);
    }
    tracker.close();
    tokio::time::timeout(Duration::from_secs(5), tracker.wait())
        .await
        .map_err(|_| "background work did not end".to_owned())?;
    let (violations, successes) = {
        let m = model.lock().unwrap();
        (m.violations.clone(), m.successes.clone())
    };
    if !violations.is_empty() {
        return Err(violations.join("; "));
    }
    for (key, answer) in answers
        .iter()
        .filter_map(|(k, a)| a.as_ref().map(|a| (k, a)))
    {
        if answer.status == 200 {
            let known = successes
                .get(key)
                .is_some_and(|s| s.contains(&answer.text()));
            if !known {
                return Err(format!(
                    "{key}: 200 {:?} with no such success",
                    answer.text()
                ));
            }
        }
    }
    // A record for every success, replayed byte for byte.
    for (key, runs) in &successes {
        let first = &runs[0];
        for _ in 0..2 {
            // The checks go through the faulty store too: retry what it
            // refuses as unavailable.
            let mut again = None;
            for _ in 0..50 {
                let res = svc
                    .clone()
                    .oneshot(request("/orders", &[("idempotency-key", key)], "{}"))
                    .await
                    .unwrap();
                let a = read(res).await;
                if a.status != 503 {
                    again = Some(a);
                    break;
                }
            }
            let again = again.ok_or_else(|| format!("{key}: store unavailable 50 times"))?;
            if (again.status, again.replayed()) != (200, true) || again.text() != *first {
                return Err(format!(
                    "{key}: success {first:?} not replayed: {} {:?}",
                    again.status,
                    again.text()
                ));
            }
        }
        for (k, answer) in answers
            .iter()
            .filter_map(|(k, a)| a.as_ref().map(|a| (k, a)))
        {
            if k == key && answer.status == 200 && answer.text() != *first {
                return Err(format!("{key}: two different successes answered"));
            }
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_fault_schedules_keep_the_promises() {
    std::panic::set_hook(Box::new(|info| {
        let injected = info
            .payload()
            .downcast_ref::<&str>()
            .is_some_and(|m| m.contains("injected"));
        if !injected {
            eprintln!("{info}");
        }
    }));
    let schedules: u64 = std::env::var("FAULT_SCHEDULES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let seeds: Vec<u64> = match std::env::var("FAULT_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        Some(seed) => vec![seed],
        None => (1..=schedules).collect(),
    };
    let ran = AtomicUsize::new(0);
    for seed in seeds {
        if let Err(e) = schedule(seed).await {
            panic!("schedule failed: {e}\nreplay with FAULT_SEED={seed}");
        }
        ran.fetch_add(1, Ordering::Relaxed);
    }
    assert!(ran.load(Ordering::Relaxed) > 0);
}
