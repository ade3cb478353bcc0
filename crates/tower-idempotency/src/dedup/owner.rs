//! The owner of a claim: runs the inner call in its own tracked task,
//! renews the lease alongside it, bounds it by the run limit, streams a
//! success to the caller while teeing it into the record, and completes or
//! releases the claim when the answer ends.
//!
//! Running in its own task is what lets the call outlive its caller: past the
//! reply deadline, or when the caller hangs up (finish on disconnect), the
//! task goes on, so that a success is recorded and the next retry replays it.

use super::capture::{grpc_failed, Capture};
use super::clock::{renewing, Biased, RunClock};
use super::config::DedupConfig;
use super::guard::ClaimGuard;
use super::reply::{refusal, retry_later};
use crate::body::{BodyBuffer, BoxError, Piece, ResponseBody};
use crate::outcome::{self, log_warn, Outcome};
use crate::store::Store;
use bytes::Bytes;
use either::Either;
use futures_util::FutureExt;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tower_service::Service;

/// How long past the run limit the end of a recorded body waits for its reader.
const GRACE: Duration = Duration::from_secs(1);

/// What the owner sends its caller first.
pub(super) enum Head<B, E> {
    /// A success: its head; the body follows on the receiver.
    Streamed(http::response::Parts, mpsc::Receiver<Piece>, SizeHint),
    /// A whole answer: a failure, or the inner service's error.
    Done(Result<Response<ResponseBody<B>>, E>),
}

/// How the inner call ended.
enum Verdict<B, E> {
    /// A 2xx whose whole body was ready at once: nothing was sent to the
    /// caller yet; the head, the body's bytes and its trailers.
    Whole(
        Box<Capture>,
        http::response::Parts,
        Bytes,
        Option<HeaderMap>,
    ),
    /// A 2xx whose body ended; the trailers still to send.
    Ended(Box<Capture>, Option<HeaderMap>),
    Failure(http::response::Parts, B),
    Error(E),
    BodyError(BoxError),
    Panicked,
    RunLimit,
    Cancelled,
}

/// The way back to the caller; either end may be gone.
struct Link<B, E> {
    head: Option<oneshot::Sender<Head<B, E>>>,
    body: Option<mpsc::Sender<Piece>>,
    /// The end of the run limit: a caller that holds the body without
    /// reading it is not waited for past it.
    until: Instant,
    /// Whether the caller was let go because it stopped reading.
    let_go: bool,
}

impl<B, E> Link<B, E> {
    fn answer(&mut self, head: Head<B, E>) {
        if let Some(tx) = self.head.take() {
            let _ = tx.send(head);
        }
    }

    /// Sends a piece of the body at the caller's pace, but not past the
    /// run limit: a caller that stops reading is then let go (its body ends
    /// in error) and the call goes on without it, under its second run
    /// limit, so that its success is still recorded.
    async fn send(&mut self, piece: Piece, clock: &RunClock) {
        let Some(tx) = &self.body else { return };
        // Room in the channel: no timer.
        let piece = match tx.try_send(piece) {
            Ok(()) => return,
            Err(mpsc::error::TrySendError::Closed(_)) => {
                self.body = None;
                return;
            }
            Err(mpsc::error::TrySendError::Full(piece)) => piece,
        };
        clock.on_caller(true);
        // Boxed: a full channel is the rare case (a large body, a slow
        // reader), and its timer and send would enlarge every call's future.
        let sent = Box::pin(tokio::time::timeout_at(clock.caller_end(), tx.send(piece))).await;
        clock.on_caller(false);
        match sent {
            Ok(Ok(())) => {}
            // The caller hung up: go on without it.
            Ok(Err(_)) => self.body = None,
            Err(_) => {
                clock.extend();
                self.let_go = true;
                self.body = None;
            }
        }
    }

    /// Sends the last pieces of a body, waiting for the caller to read them
    /// no longer than the run limit.
    async fn finish(&mut self, pieces: impl IntoIterator<Item = Piece>) {
        for piece in pieces {
            let Some(tx) = &self.body else { return };
            // Boxed, as in `send`: only a streamed body ends here.
            match Box::pin(tokio::time::timeout_at(self.until, tx.send(piece))).await {
                Ok(Ok(())) => {}
                _ => self.body = None,
            }
        }
    }

    /// Ends the answer in error, whichever part of it the caller is at. A
    /// body the caller is not reading is closed early, which it reads as an
    /// error too.
    fn fail(&mut self, early: Response<ResponseBody<B>>, error: BoxError) {
        if self.head.is_some() {
            self.answer(Head::Done(Ok(early)));
        } else if let Some(tx) = self.body.take() {
            let _ = tx.try_send(Piece::Error(error));
        }
    }
}

/// One claim's owner.
pub(super) struct Owner<S, St: Store> {
    pub(super) inner: S,
    pub(super) guard: ClaimGuard<St>,
    pub(super) config: Arc<DedupConfig>,
}

impl<S, St: Store> Owner<S, St> {
    /// Runs the inner call to its end; `cancelled` (if any) resolves when the
    /// caller hung up and the call is not to be finished.
    pub(super) async fn run<ReqBody, B, C>(
        self,
        req: Request<ReqBody>,
        head: oneshot::Sender<Head<B, S::Error>>,
        cancelled: Option<C>,
    ) where
        C: std::future::Future<Output = ()>,
        S: Service<Request<ReqBody>, Response = Response<B>>,
        B: Body<Data = Bytes>,
        B::Error: Into<BoxError>,
    {
        let Owner {
            mut inner,
            guard,
            config,
        } = self;
        let clock = RunClock::start(config.max_run);
        let end = clock.caller_end();
        let mut link = Link {
            head: Some(head),
            body: None,
            until: end.checked_add(GRACE).unwrap_or(end),
            let_go: false,
        };
        // One expression, no named futures: a future named in an `async fn`
        // keeps its own slot beside the one it is moved into.
        let verdict = Biased {
            first: async {
                match cancelled {
                    Some(cancelled) => cancelled.await,
                    None => std::future::pending().await,
                }
            },
            // One timer serves the renewals and the run limit; a call that
            // is over at its first poll registers none.
            second: renewing(
                AssertUnwindSafe(crate::span::instrument(
                    serve(&mut inner, req, &mut link, &config, &clock),
                    crate::span::upstream(),
                ))
                .catch_unwind(),
                &guard,
                &config,
                &clock,
            ),
        }
        .await;
        let verdict = match verdict {
            Either::Left(()) => Verdict::Cancelled,
            Either::Right(Some(v)) => v.unwrap_or(Verdict::Panicked),
            Either::Right(None) => Verdict::RunLimit,
        };
        let key = guard.key().clone();
        let preset = key.preset_arc();
        if link.let_go {
            log_warn!(key = %key.redacted(), limit = ?config.max_run, "the caller stopped reading its answer until the run limit ended: its answer was cut short; the call went on to record its result");
        }
        match verdict {
            Verdict::Whole(capture, parts, data, trailers) => {
                // The record is kept before the caller hears anything.
                let outcome = settle(*capture, guard, &config).await;
                let res = if outcome == Outcome::Executed {
                    let mut res = Response::from_parts(parts, ResponseBody::full(data, trailers));
                    res.extensions_mut().insert(outcome);
                    res
                } else {
                    uncommitted(outcome)
                };
                link.answer(Head::Done(Ok(res)));
            }
            Verdict::Ended(capture, trailers) => {
                // Always finished, even if the caller hangs up meanwhile.
                let outcome = settle(*capture, guard, &config).await;
                if outcome != Outcome::Executed {
                    // The body went out; its end does not.
                    if let Some(tx) = link.body.take() {
                        let _ = tx.try_send(Piece::Error(
                            "the handler's record was not committed".into(),
                        ));
                    }
                    return;
                }
                let trailers = trailers.map(|t| Piece::Frame(Frame::trailers(t)));
                link.finish(trailers.into_iter().chain([Piece::End])).await;
            }
            Verdict::Failure(parts, body) => {
                // A call refused before it was sent (a full cap) is shed.
                let shed = parts.extensions.get::<Outcome>() == Some(&Outcome::Shed);
                let outcome = if shed { Outcome::Shed } else { Outcome::Failed };
                outcome::record(preset, outcome);
                guard.release().await;
                let mut res = Response::from_parts(parts, ResponseBody::stream(body));
                res.extensions_mut().insert(outcome);
                link.answer(Head::Done(Ok(res)));
            }
            Verdict::Error(e) => {
                outcome::record(preset, Outcome::Failed);
                guard.release().await;
                link.answer(Head::Done(Err(e)));
            }
            Verdict::BodyError(e) => {
                outcome::record(preset, Outcome::Failed);
                log_warn!(key = %key.redacted(), "the response body failed before it ended; claim released");
                guard.release().await;
                if let Some(tx) = link.body.take() {
                    let _ = tx.try_send(Piece::Error(e));
                }
            }
            Verdict::Panicked => {
                outcome::record(preset, Outcome::Failed);
                log_warn!(key = %key.redacted(), "inner service panicked; claim released");
                guard.release().await;
                let res = refusal(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal error\n",
                    Outcome::Failed,
                );
                link.fail(res, "the inner service panicked".into());
            }
            Verdict::RunLimit => {
                outcome::record(preset, Outcome::RunLimitExceeded);
                log_warn!(key = %key.redacted(), limit = ?config.max_run, "inner call ran past the run limit: cancelled, claim released");
                guard.release().await;
                let res = retry_later(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the request ran past its time limit; retry later\n",
                    Outcome::RunLimitExceeded,
                );
                link.fail(res, "the response ran past the run limit".into());
            }
            Verdict::Cancelled => guard.release().await,
        }
    }
}

/// Ends a claim whose answer ended: completes it with the record of a
/// success, or releases it. Counts the outcome and returns what the answer
/// was (`Executed` or `Failed`).
async fn settle<St: Store>(
    capture: Capture,
    mut guard: ClaimGuard<St>,
    config: &DedupConfig,
) -> Outcome {
    let key = guard.key().clone();
    if !capture.succeeded() {
        outcome::record(key.preset_arc(), Outcome::Failed);
        guard.release().await;
        return Outcome::Failed;
    }
    let record = Arc::new(capture.into_record(key.fingerprint()));
    let by_handler = guard.completed_by_handler();
    let outcome = guard.complete(record, config.window, config.lease).await;
    if outcome == Outcome::LeaseLost {
        log_warn!(key = %key.redacted(), "the lease ran out before the record completed");
    }
    outcome::record(key.preset_arc(), outcome);
    // The layer's own record is retried in the background when the store
    // fails; the handler's is there only if its transaction committed.
    if by_handler && outcome != Outcome::Executed {
        return outcome;
    }
    Outcome::Executed
}

/// The answer to a success whose record, written by the handler in its own
/// transaction, was not committed (or cannot be told): a retryable failure.
fn uncommitted<B>(outcome: Outcome) -> Response<ResponseBody<B>> {
    retry_later(
        StatusCode::SERVICE_UNAVAILABLE,
        "the handler's transaction did not commit its record; retry later\n",
        outcome,
    )
}

/// Calls the inner service and streams a success's body to the caller,
/// teeing it into a [`Capture`].
async fn serve<S, ReqBody, B>(
    inner: &mut S,
    req: Request<ReqBody>,
    link: &mut Link<B, S::Error>,
    config: &DedupConfig,
    clock: &RunClock,
) -> Verdict<B, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<B>>,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let res = match inner.call(req).await {
        Ok(res) => res,
        Err(e) => return Verdict::Error(e),
    };
    let (parts, body) = res.into_parts();
    if !parts.status.is_success() || grpc_failed(&parts.headers, None) {
        return Verdict::Failure(parts, body);
    }
    let mut capture = Capture::new(parts.status, &parts.headers, config.max_cached_body);
    // The whole body's size, read before any of it is taken: a body's hint
    // may shrink as it is read (hyper's counts what is left), and the
    // caller's body answers for every byte, the early ones included. A hint
    // read later would frame the answer shorter than its `Content-Length`.
    let hint = body.size_hint();
    let mut body = std::pin::pin!(body);
    let mut trailers: Option<HeaderMap> = None;
    // Whatever of the body is ready now is taken without waiting: a small
    // answer usually arrives whole with its head, and is then answered in
    // one piece, after its record is kept, without a channel to the caller.
    let mut early = BodyBuffer::default();
    let mut early_error = None;
    let mut frames = 0;
    let ended = loop {
        // Bounded in bytes and in frames (a body of empty frames that are
        // always ready must not hold the thread).
        if early.len() > EARLY_MAX || frames == EARLY_FRAMES {
            break false;
        }
        frames += 1;
        let Some(frame) = poll_now(body.as_mut()).await else {
            break false;
        };
        match frame {
            None => break true,
            Some(Err(e)) => {
                early_error = Some(e);
                break false;
            }
            Some(Ok(frame)) => take_frame(frame, &mut capture, &mut trailers, |data| {
                early.push(data);
            }),
        }
    };
    if ended {
        return Verdict::Whole(Box::new(capture), parts, early.into_bytes(), trailers);
    }
    // A couple of frames in transit: the caller's pace is the handler's.
    let (tx, rx) = mpsc::channel(2);
    if let Some(head) = link.head.take()
        && head.send(Head::Streamed(parts, rx, hint)).is_ok()
    {
        link.body = Some(tx);
    }
    if !early.is_empty() {
        link.send(Piece::Frame(Frame::data(early.into_bytes())), clock)
            .await;
    }
    if let Some(e) = early_error {
        return Verdict::BodyError(e);
    }
    // The body's own error never waits across an await (it need not be Send).
    loop {
        let frame = std::future::poll_fn(|cx| {
            let polled = std::task::ready!(body.as_mut().poll_frame(cx));
            std::task::Poll::Ready(polled.map(|r| r.map_err(Into::<BoxError>::into)))
        })
        .await;
        let Some(frame) = frame else { break };
        let frame = match frame {
            Ok(frame) => frame,
            Err(e) => return Verdict::BodyError(e),
        };
        let mut data = None;
        take_frame(frame, &mut capture, &mut trailers, |d| data = Some(d));
        if let Some(data) = data {
            link.send(Piece::Frame(Frame::data(data)), clock).await;
        }
        debug_assert!(capture.held() <= config.max_cached_body);
        // A body that is always ready (and nobody reading it) must still let
        // the run limit and cancellation in.
        tokio::task::coop::consume_budget().await;
    }
    Verdict::Ended(Box::new(capture), trailers)
}

/// How much of a body is taken at once before its head goes to the caller:
/// bytes, and frames.
const EARLY_MAX: usize = 64 * 1024;
const EARLY_FRAMES: usize = 64;

/// Polls `body` once: `None` if it has nothing ready.
async fn poll_now<B>(
    mut body: std::pin::Pin<&mut B>,
) -> Option<Option<Result<Frame<Bytes>, BoxError>>>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    std::future::poll_fn(|cx| {
        std::task::Poll::Ready(match body.as_mut().poll_frame(cx) {
            std::task::Poll::Ready(polled) => Some(polled.map(|r| r.map_err(Into::into))),
            std::task::Poll::Pending => None,
        })
    })
    .await
}

/// Tees one frame into `capture`: data goes on to `data`, trailers are
/// gathered into `trailers`.
fn take_frame(
    frame: Frame<Bytes>,
    capture: &mut Capture,
    trailers: &mut Option<HeaderMap>,
    data: impl FnOnce(Bytes),
) {
    match frame.into_data() {
        Ok(d) => {
            capture.data(&d);
            data(d);
        }
        Err(frame) => {
            if let Ok(t) = frame.into_trailers() {
                capture.trailers(&t);
                match trailers {
                    Some(existing) => existing.extend(t),
                    None => *trailers = Some(t),
                }
            }
        }
    }
}
