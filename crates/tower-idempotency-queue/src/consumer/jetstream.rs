//! [`JetStreamConsumer`]: a handler run once per message key on NATS
//! JetStream.

use async_nats::jetstream::{AckKind, Message};
use std::future::Future;
use std::time::Duration;
use tower_idempotency::consumer::{ConsumeError, Consumer, MessageKey, Once, Receipt};
use tower_idempotency::store::Store;
use tower_idempotency::Fingerprint;

/// Runs a handler once per message key on JetStream messages, and settles
/// each message.
///
/// JetStream delivers at least once: a message whose consumer died before
/// acknowledging it is delivered again after its ack wait, a publisher that
/// retried with another `Nats-Msg-Id` (or after the stream's duplicate
/// window) stored it twice, and a `nak` redelivers it. The key read from
/// the message (a business id, not the message id) is claimed in the
/// [`Consumer`]'s store before the handler runs, with the same lease, run
/// limit and failure rules as every other consumer: the handler runs once
/// per key, however often the message arrives.
///
/// Each message is settled after its handler: acknowledged (`+ACK`, waiting
/// for the server's confirmation) once it ran or had run before; `nak`ed
/// with a delay when it failed, panicked, ran past the run limit or found
/// its key in flight elsewhere (it comes back); terminated (`+TERM`, never
/// delivered again) when no delivery can succeed (no key, the key reused
/// with another payload). While the handler runs, the message's ack wait is
/// renewed (`+WPI`) every third of it, so a long handler does not see its
/// message handed to another consumer meanwhile.
///
/// ```no_run
/// use futures_util::StreamExt;
/// use tower_idempotency::consumer::Consumer;
/// use tower_idempotency_queue::consumer::JetStreamConsumer;
/// use tower_idempotency::store::MemoryStore;
/// # async fn f(pull: async_nats::jetstream::consumer::PullConsumer) -> Result<(), async_nats::Error> {
/// // Keyed by the publisher's `Idempotency-Key` header, the payload as
/// // the fingerprint.
/// let once = JetStreamConsumer::new(
///     Consumer::new(MemoryStore::new()).scope("orders"),
///     JetStreamConsumer::header_key("Idempotency-Key"),
/// );
/// let mut messages = pull.messages().await?;
/// while let Some(message) = messages.next().await {
///     let message = message?;
///     let _ = once
///         .handle(&message, |m| {
///             let order = m.payload.clone();
///             async move { Ok::<_, std::io::Error>(format!("shipped {} bytes", order.len())) }
///         })
///         .await;
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct JetStreamConsumer<St, K> {
    consumer: Consumer<St>,
    key: K,
    ack_wait: Duration,
    retry_after: Duration,
}

impl<St: Store, K: MessageKey<Message>> JetStreamConsumer<St, K> {
    /// Guards every message with `consumer`, keyed by `key` (a closure
    /// `Fn(&Message) -> Option<(String, Fingerprint)>`, or
    /// [`header_key`](Self::header_key)).
    pub fn new(consumer: Consumer<St>, key: K) -> Self {
        Self {
            consumer,
            key,
            ack_wait: Duration::from_secs(30),
            retry_after: Duration::from_secs(1),
        }
    }

    /// The JetStream consumer's ack wait: the message's is renewed every
    /// third of it while the handler runs. Defaults to 30 seconds (the
    /// server's default).
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait.max(Duration::from_millis(30));
        self
    }

    /// How long a failed message waits before it is delivered again (the
    /// `nak`'s delay). Defaults to 1 second.
    pub fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = after;
        self
    }

    /// The consumer.
    pub fn consumer(&self) -> &Consumer<St> {
        &self.consumer
    }

    /// Runs `handler` for `message` unless its key already succeeded, then
    /// settles the message (see [`JetStreamConsumer`]). A
    /// settlement that fails is not an error of the handler: the message is
    /// then delivered again, and finds its key done.
    pub async fn handle<T, E, F, Fut>(
        &self,
        message: &Message,
        handler: F,
    ) -> Result<Once<T>, ConsumeError<E>>
    where
        T: Receipt,
        F: FnOnce(&Message) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let Some((key, fingerprint)) = self.key.key(message) else {
            let _ = message.ack_with(AckKind::Term).await;
            return Err(ConsumeError::KeyMissing);
        };
        let run = self.consumer.once(&key, fingerprint, handler(message));
        let got = renewing(message, self.ack_wait / 3, run).await;
        let settled = match &got {
            Ok(_) => message.double_ack().await,
            Err(e) if !e.is_retryable() => message.ack_with(AckKind::Term).await,
            Err(_) => message.ack_with(AckKind::Nak(Some(self.retry_after))).await,
        };
        if let Err(_e) = settled {
            crate::log_warn!(error = %_e, "jetstream message not settled; it is delivered again");
        }
        got
    }
}

impl JetStreamConsumer<(), ()> {
    /// A key from the header `name` (the message's business id), and the
    /// payload's hash as its fingerprint. A message without the header has
    /// no key (terminated, never run unguarded).
    pub fn header_key(
        name: &'static str,
    ) -> impl Fn(&Message) -> Option<(String, Fingerprint)> + Clone {
        move |m: &Message| {
            let value = m.headers.as_ref()?.get(name)?.as_str();
            (!value.is_empty()).then(|| (value.to_owned(), Fingerprint::of(&m.payload)))
        }
    }
}

/// Runs `work`, sending `+WPI` for `message` every `every` meanwhile.
async fn renewing<O>(message: &Message, every: Duration, work: impl Future<Output = O>) -> O {
    let mut work = std::pin::pin!(work);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        tokio::select! {
            out = &mut work => return out,
            _ = tick.tick() => {
                let _ = message.ack_with(AckKind::Progress).await;
            }
        }
    }
}
