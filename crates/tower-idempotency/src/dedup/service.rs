//! The [`Dedup`] service and its response future.

use super::config::DedupConfig;
use super::run::Run;
use crate::body::{BoxError, ResponseBody};
use crate::key::is_guarded_method;
use crate::store::Store;
use crate::IdempotencyKey;
use bytes::Bytes;
use futures_util::FutureExt;
use http::{Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio_util::task::TaskTracker;
use tower_service::Service;

/// Runs the inner service at most once per key. See the [module docs](crate::dedup).
pub struct Dedup<S, St> {
    inner: S,
    store: St,
    config: Arc<DedupConfig>,
    tasks: TaskTracker,
}

impl<S: Clone, St: Clone> Clone for Dedup<S, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            store: self.store.clone(),
            config: self.config.clone(),
            tasks: self.tasks.clone(),
        }
    }
}

impl<S: fmt::Debug, St: fmt::Debug> fmt::Debug for Dedup<S, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dedup")
            .field("inner", &self.inner)
            .field("store", &self.store)
            .field("config", &self.config)
            .finish()
    }
}

impl<S, St: Store> Dedup<S, St> {
    /// Wraps `inner` with the default settings over `store`.
    pub fn new(inner: S, store: St) -> Self {
        Self::from_parts(
            inner,
            store,
            Arc::new(DedupConfig::new()),
            TaskTracker::new(),
        )
    }

    pub(crate) fn from_parts(
        inner: S,
        store: St,
        config: Arc<DedupConfig>,
        tasks: TaskTracker,
    ) -> Self {
        Self {
            inner,
            store,
            config,
            tasks,
        }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes `self`, returning the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

pin_project! {
    /// Response future of [`Dedup`].
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B, E> {
        // Not guarded: the inner future, its body streamed.
        Unguarded { #[pin] fut: F },
        // Guarded: the claim, wait, replay or execution.
        Guarded { fut: BoxFuture<Result<Response<ResponseBody<B>>, E>> },
    }
}

impl<F, B, E> fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            Kind::Unguarded { .. } => "Unguarded",
            Kind::Guarded { .. } => "Guarded",
        };
        f.debug_tuple("dedup::ResponseFuture").field(&kind).finish()
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Unguarded { fut } => fut
                .poll(cx)
                .map(|r| r.map(|res| res.map(ResponseBody::stream))),
            KindProj::Guarded { fut } => fut.as_mut().poll(cx),
        }
    }
}

impl<S, St, ReqBody, ResBody> Service<Request<ReqBody>> for Dedup<S, St>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: Store,
    ReqBody: Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let key = match req.extensions().get::<IdempotencyKey>() {
            Some(key) if is_guarded_method(req.method()) => key.clone(),
            _ => {
                return ResponseFuture {
                    kind: Kind::Unguarded {
                        fut: self.inner.call(req),
                    },
                }
            }
        };
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let run = Run {
            inner,
            store: self.store.clone(),
            config: self.config.clone(),
            tasks: self.tasks.clone(),
            key,
        };
        // Outer code (an access log, a journal) reads the key in the
        // response, unless told nobody does.
        let key = self.config.key_in_response.then(|| run.key.clone());
        // A combinator, not an `async` block: that would hold `run` and the
        // request twice, as its captures and inside the future it awaits
        // (3.4 KB to copy into the box, where this holds it once).
        let fut = run.run(req).map(move |res| {
            let mut res = res?;
            if let Some(key) = key {
                res.extensions_mut().insert(key);
            }
            Ok(res)
        });
        ResponseFuture {
            kind: Kind::Guarded { fut: Box::pin(fut) },
        }
    }
}
