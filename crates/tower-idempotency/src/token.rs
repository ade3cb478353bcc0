//! Issuing one-time client tokens (anti-resubmit tokens).
//!
//! Before a user submits an order, the page asks [`IssueToken`] for a token;
//! the submit carries it in `Idempotency-Token` to a route guarded by
//! [`IdempotencyLayer::client_token`](crate::IdempotencyLayer::client_token)
//! over the same store. Build the issuer from the consuming layer with
//! [`IssueToken::for_layer`]: it takes the layer's store, principal and
//! prefix, so the two cannot disagree (an issuer with another principal or
//! prefix issues tokens that the route refuses as unknown).
//!
//! What a submit gets:
//!
//! - **The first** with a token consumes it atomically and runs the handler;
//!   the token becomes a dedup record, kept for the layer's window (24 hours
//!   by default).
//! - **A copy** (the same token, method, path and body) that arrives while the
//!   first runs waits and gets its response replayed; a later copy within
//!   the window gets the replay at once (`idempotent-replayed: true`). With
//!   `.strict(true)` copies get 409 instead.
//! - **The same token with another body** (or method, or path) within the
//!   window gets 422 "idempotency token already used for a different
//!   request"; the handler is not called.
//! - **An unknown, expired or other user's token**, or a used one after the
//!   window, gets 400 "unknown, expired or already used idempotency token".
//! - **A submit that fails** (non-2xx, error, panic) gives the token back, so
//!   the client can retry with it.
//!
//! ```
//! use axum::{routing::{get, post}, Router};
//! use tower_idempotency::store::MemoryStore;
//! use tower_idempotency::token::IssueToken;
//! use tower_idempotency::{IdempotencyLayer, Preset};
//!
//! async fn create_order(body: String) -> String { format!("created {body}") }
//!
//! let orders = IdempotencyLayer::new_in(Preset::client_token(), MemoryStore::new());
//! let app: Router = Router::new()
//!     .route_service("/orders/token", IssueToken::for_layer(&orders))
//!     .route("/orders", post(create_order).layer(orders));
//! ```

use crate::body::text_response;
use crate::key::{AuthorizationHash, IdempotencyKey, Principal};
use crate::store::Store;
use crate::IdempotencyLayer;
use bytes::Bytes;
use http::{header, HeaderValue, Request, Response, StatusCode};
use http_body_util::Full;
use std::borrow::Cow;
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tower_service::Service;

/// A tower service that issues one-time tokens: answers
/// `{"token":"…","expires_in":300}` (128 random bits, hex) and stores the
/// token for its lifetime, scoped to the caller's principal.
///
/// Mount it on any method (e.g. `GET /orders/token` or
/// `POST /idempotency-tokens`). The principal and prefix must match the
/// consuming route's (both default to a hash of `Authorization` and `idem`):
/// build it with [`for_layer`](Self::for_layer) to take them from the
/// consuming layer.
#[derive(Clone)]
pub struct IssueToken<St> {
    store: St,
    ttl: Duration,
    principal: Arc<dyn Principal>,
    prefix: Cow<'static, str>,
    store_timeout: Duration,
}

impl<St: Store> IssueToken<St> {
    /// An issuer over `store`: tokens live 5 minutes, scoped to a hash of
    /// `Authorization`, prefix `idem`.
    pub fn new(store: St) -> Self {
        Self {
            store,
            ttl: Duration::from_secs(300),
            principal: Arc::new(AuthorizationHash),
            prefix: Cow::Borrowed("idem"),
            store_timeout: Duration::from_secs(1),
        }
    }

    /// An issuer for the route guarded by `layer` (a
    /// [`client_token`](crate::IdempotencyLayer::client_token) layer): over
    /// its store, with its principal and prefix, so that every token issued
    /// is one the route accepts. Tokens live 5 minutes.
    ///
    /// In debug builds, panics if `layer` does not consume tokens (its preset
    /// is not `client-token`): the tokens would never be used.
    pub fn for_layer(layer: &IdempotencyLayer<St>) -> Self {
        let key = &layer.key_layer().config;
        debug_assert!(
            key.consume_token,
            "IssueToken::for_layer: the layer's preset ({}) does not consume tokens",
            key.preset
        );
        Self {
            principal: key.principal.clone(),
            prefix: key.prefix.clone(),
            ..Self::new(layer.store().clone())
        }
    }

    /// The timeout of the store call that keeps a new token; past it the
    /// caller gets 503 with `Retry-After`. Defaults to 1 second.
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        self.store_timeout = timeout;
        self
    }

    /// How long a token can be used. Defaults to 5 minutes.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Who the token belongs to: the consuming layer's principal. Defaults to
    /// [`AuthorizationHash`] ([`for_layer`](Self::for_layer): the layer's).
    pub fn principal(mut self, principal: impl Principal) -> Self {
        self.principal = Arc::new(principal);
        self
    }

    /// The key prefix (as on the consuming layer). Defaults to `idem`
    /// ([`for_layer`](Self::for_layer): the layer's).
    pub fn prefix(mut self, prefix: impl Into<Cow<'static, str>>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The same settings over another store. Defaults to the store given to
    /// [`new`](Self::new).
    pub fn with_store<St2: Store>(self, store: St2) -> IssueToken<St2> {
        IssueToken {
            store,
            ttl: self.ttl,
            principal: self.principal,
            prefix: self.prefix,
            store_timeout: self.store_timeout,
        }
    }

    /// The store.
    pub fn store(&self) -> &St {
        &self.store
    }
}

/// Response future of [`IssueToken`]: resolves to the token reply, or to 503
/// with `Retry-After` when the store cannot keep the token.
pub struct ResponseFuture {
    // Boxed: issuing a token is off the hot path (one store write per page).
    inner: Pin<Box<dyn Future<Output = Reply> + Send>>,
}

type Reply = Result<Response<Full<Bytes>>, Infallible>;

impl fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl Future for ResponseFuture {
    type Output = Reply;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<St> fmt::Debug for IssueToken<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IssueToken")
            .field("ttl", &self.ttl)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// 128 random bits as 32 hex digits.
fn new_token() -> Result<String, getrandom::Error> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

impl<St: Store, B> Service<Request<B>> for IssueToken<St> {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let (parts, _body) = req.into_parts();
        let principal = self.principal.principal(&parts);
        let (store, ttl, prefix) = (self.store.clone(), self.ttl, self.prefix.clone());
        let timeout = self.store_timeout;
        let inner = Box::pin(async move {
            let Ok(token) = new_token() else {
                return Ok(unavailable());
            };
            let key = IdempotencyKey::token_store_key(&prefix, principal.as_deref(), &token);
            match tokio::time::timeout(timeout, store.put_token(&key, ttl)).await {
                Ok(Ok(())) => {}
                _ => return Ok(unavailable()),
            }
            let body = format!(r#"{{"token":"{token}","expires_in":{}}}"#, ttl.as_secs());
            let mut res = Response::new(Full::new(Bytes::from(body)));
            let headers = res.headers_mut();
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            Ok(res)
        });
        ResponseFuture { inner }
    }
}

fn unavailable() -> Response<Full<Bytes>> {
    let mut res = text_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "could not issue a token; retry later\n",
    );
    res.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    res
}
