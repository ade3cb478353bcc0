//! [`ConsumerLayer`]: the tower adapter over any message type.

use super::{ConsumeError, Consumer, Once, Receipt};
use crate::store::Store;
use crate::Fingerprint;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use tower_layer::Layer;
use tower_service::Service;

/// Reads the key and the fingerprint of a message.
///
/// Implemented for closures `Fn(&M) -> Option<(String, Fingerprint)>`; a
/// message without a key is refused with [`ConsumeError::KeyMissing`] (it
/// cannot be guarded, and running it unguarded could run it twice).
pub trait MessageKey<M> {
    /// The message's key and fingerprint, or `None` if it has no key.
    fn key(&self, message: &M) -> Option<(String, Fingerprint)>;
}

impl<M, F> MessageKey<M> for F
where
    F: Fn(&M) -> Option<(String, Fingerprint)>,
{
    fn key(&self, message: &M) -> Option<(String, Fingerprint)> {
        self(message)
    }
}

/// Applies [`ConsumeOnce`] to a message handler service.
#[derive(Debug, Clone)]
pub struct ConsumerLayer<St, K> {
    consumer: Consumer<St>,
    key: K,
}

impl<St: Store, K> ConsumerLayer<St, K> {
    /// A layer that guards every message with `consumer`, keyed by `key`.
    pub fn new(consumer: Consumer<St>, key: K) -> Self {
        Self { consumer, key }
    }
}

impl<S, St: Store, K: Clone> Layer<S> for ConsumerLayer<St, K> {
    type Service = ConsumeOnce<S, St, K>;

    fn layer(&self, inner: S) -> Self::Service {
        ConsumeOnce::new(inner, self.consumer.clone(), self.key.clone())
    }
}

/// Calls the inner service at most once per message key. Answers
/// [`Once::Ran`] with the inner response, or [`Once::Done`] with the receipt
/// of an earlier success; failures are [`ConsumeError`]s, and are never
/// recorded, so a redelivery runs again.
#[derive(Clone)]
pub struct ConsumeOnce<S, St, K> {
    inner: S,
    consumer: Consumer<St>,
    key: K,
}

impl<S: fmt::Debug, St: fmt::Debug, K> fmt::Debug for ConsumeOnce<S, St, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumeOnce")
            .field("inner", &self.inner)
            .field("consumer", &self.consumer)
            .finish_non_exhaustive()
    }
}

impl<S, St: Store, K> ConsumeOnce<S, St, K> {
    /// Wraps `inner`.
    pub fn new(inner: S, consumer: Consumer<St>, key: K) -> Self {
        Self {
            inner,
            consumer,
            key,
        }
    }

    /// A layer; see [`ConsumerLayer::new`].
    pub fn layer(consumer: Consumer<St>, key: K) -> ConsumerLayer<St, K> {
        ConsumerLayer::new(consumer, key)
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

/// Response future of [`ConsumeOnce`].
pub type ConsumeFuture<T, E> =
    Pin<Box<dyn Future<Output = Result<Once<T>, ConsumeError<E>>> + Send>>;

impl<S, St, K, M> Service<M> for ConsumeOnce<S, St, K>
where
    S: Service<M> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Response: Receipt + Send + 'static,
    S::Error: Send + 'static,
    St: Store,
    K: MessageKey<M>,
    M: Send + 'static,
{
    type Response = Once<S::Response>;
    type Error = ConsumeError<S::Error>;
    type Future = ConsumeFuture<S::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(ConsumeError::Handler)
    }

    fn call(&mut self, message: M) -> Self::Future {
        let Some((key, fingerprint)) = self.key.key(&message) else {
            return Box::pin(std::future::ready(Err(ConsumeError::KeyMissing)));
        };
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let consumer = self.consumer.clone();
        Box::pin(async move {
            // The inner call is made only once the key is claimed.
            let handler = async move { inner.call(message).await };
            consumer.once(&key, fingerprint, handler).await
        })
    }
}
