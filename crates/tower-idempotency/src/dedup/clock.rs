//! The run limit of one owned call, and the lease renewals beside it.
//!
//! The run limit bounds the inner call, not its caller's reading: the
//! owner streams a success at the caller's pace, and when the limit passes
//! while it waits for a caller that stopped reading, it lets that caller go
//! (its body ends in error) and gets the run limit once more, from then, to
//! read the rest of the answer and record it.

use super::config::DedupConfig;
use super::guard::ClaimGuard;
use crate::outcome::{self, log_warn, Outcome};
use crate::store::Store;
use either::Either;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;
use tokio::time::Instant;

/// The end of a far-off limit: about 30 years (as tokio's own far future).
const FAR: Duration = Duration::from_secs(86_400 * 365 * 30);

/// `at + d`, or far off when that does not fit.
fn after(at: Instant, d: Duration) -> Instant {
    at.checked_add(d.min(FAR)).unwrap_or(at)
}

/// When an owned call must end, shared by the call and its renewals.
pub(super) struct RunClock {
    origin: Instant,
    max_run: Duration,
    /// The end of the run limit, in microseconds since `origin`.
    end: AtomicU64,
    /// Whether the call is waiting for its caller to read.
    on_caller: AtomicBool,
    /// Whether the call got its second run limit.
    extended: AtomicBool,
}

impl RunClock {
    /// A run limit of `max_run` from now.
    pub(super) fn start(max_run: Duration) -> Self {
        let max_run = max_run.min(FAR);
        Self {
            origin: Instant::now(),
            max_run,
            end: AtomicU64::new(micros(max_run)),
            on_caller: AtomicBool::new(false),
            extended: AtomicBool::new(false),
        }
    }

    /// The end of the run limit now.
    pub(super) fn end(&self) -> Instant {
        after(
            self.origin,
            Duration::from_micros(self.end.load(Ordering::Acquire)),
        )
    }

    /// The first run limit's end: a caller that does not read is not waited
    /// for past it.
    pub(super) fn caller_end(&self) -> Instant {
        after(self.origin, self.max_run)
    }

    /// Marks the call as waiting for its caller (or no longer).
    pub(super) fn on_caller(&self, waiting: bool) {
        self.on_caller.store(waiting, Ordering::Release);
    }

    /// The caller was let go because it stopped reading: the call gets the
    /// run limit once more, from now, for the rest of its answer. `false`
    /// when it had it already.
    pub(super) fn extend(&self) -> bool {
        if self.extended.swap(true, Ordering::AcqRel) {
            return false;
        }
        let end = self.origin.elapsed().saturating_add(self.max_run);
        self.end.store(micros(end), Ordering::Release);
        true
    }

    /// Whether the run limit is over now. When it passes while the call
    /// waits for its caller, the call gets its second run limit instead.
    fn over(&self) -> bool {
        if Instant::now() < self.end() {
            return false;
        }
        !(self.on_caller.load(Ordering::Acquire) && self.extend())
    }

    /// Sleeps until the run limit is over.
    async fn sleep_past(&self) {
        loop {
            tokio::time::sleep_until(self.end()).await;
            if self.over() {
                return;
            }
        }
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Polls `work` and, alongside it, renews the claim every `lease/3` (sooner
/// after a failed renewal), until `work` finishes (`Some`) or the run limit
/// of `clock` is over (`None`). A lost lease and a failed renewal are
/// logged and counted.
pub(super) fn renewing<'a, F: Future + 'a, St: Store>(
    work: F,
    guard: &'a ClaimGuard<St>,
    config: &'a DedupConfig,
    clock: &'a RunClock,
) -> impl Future<Output = Option<F::Output>> + 'a {
    let period = config.lease / 3;
    let renew = async move {
        let mut next = after(Instant::now(), period);
        loop {
            tokio::time::sleep_until(next.min(clock.end())).await;
            if clock.over() {
                return;
            }
            if Instant::now() < next {
                // The limit moved on: not yet time to renew.
                continue;
            }
            let preset = guard.key().preset_arc();
            // A renewal that hangs does not hold the run limit back. Boxed:
            // this loop lives beside every call, and a renewal is rare (a
            // call longer than a third of the lease), so the renewal's
            // future is not carried, and copied, in every call's own.
            let renewal = Box::pin(guard.renew(config.lease));
            let Ok(renewed) = tokio::time::timeout_at(clock.end(), renewal).await else {
                if clock.over() {
                    return;
                }
                continue;
            };
            match renewed {
                Ok(true) => next = after(Instant::now(), period),
                Ok(false) => {
                    outcome::record(preset, Outcome::LeaseLost);
                    log_warn!(key = %guard.key().redacted(), "lease lost while the inner service ran");
                    clock.sleep_past().await;
                    return;
                }
                // The store is down: try again soon; the lease may still hold.
                Err(error) => {
                    outcome::record(preset, Outcome::StoreError);
                    log_warn!(key = %guard.key().redacted(), error = %error, "renewing the lease failed; retrying");
                    let _ = &error;
                    next = after(Instant::now(), period / 5);
                }
            }
        }
    };
    // The renewal timer is polled outside the task's budget: a body that is
    // always ready spends it, and a budgeted timer would then never fire.
    let renew = tokio::task::unconstrained(renew);
    // Not an `async fn` with `select!`: that would hold `work` twice.
    let both = Biased {
        first: work,
        second: renew,
    };
    futures_util::FutureExt::map(both, Either::left)
}

pin_project_lite::pin_project! {
    /// Two futures polled together, `first` before `second` at every poll
    /// (as `tokio::select!` with `biased`), ending with whichever ends
    /// first. Unlike `select!` in an `async fn`, it holds each future once.
    pub(super) struct Biased<A, B> {
        #[pin]
        pub(super) first: A,
        #[pin]
        pub(super) second: B,
    }
}

impl<A: Future, B: Future> Future for Biased<A, B> {
    type Output = Either<A::Output, B::Output>;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let this = self.project();
        if let std::task::Poll::Ready(a) = this.first.poll(cx) {
            return std::task::Poll::Ready(Either::Left(a));
        }
        this.second.poll(cx).map(Either::Right)
    }
}
