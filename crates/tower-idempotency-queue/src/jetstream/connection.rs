//! Connecting and opening a queue: the builder, the streams, the consumer
//! and the buckets it creates.

use super::AtomicU64;
use super::{err, err_in, fail, Arc, Duration, HashMap, Inner, JetStreamQueue, Mutex, QueueError};
use crate::QueueErrorKind;
use async_nats::jetstream::{self, consumer, kv, stream};

/// The consumer every gateway of a queue shares.
const CONSUMER: &str = "workers";

/// The stream's duplicate window: two publishes with one message id within
/// it store one message.
const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// A name JetStream accepts in stream, bucket and subject names.
pub(super) fn sanitize(name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() {
        "default".to_owned()
    } else {
        s
    }
}

/// A URL's percent-escaped userinfo, decoded (`p%40ss` -> `p@ss`).
pub(super) fn unescape(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (
            b[i],
            b.get(i + 1).copied().and_then(hex),
            b.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// How a [`JetStreamQueue`] is created: [`JetStreamQueue::builder`].
#[derive(Debug, Clone)]
pub struct JetStreamQueueBuilder {
    name: String,
    window: Duration,
    lease: Duration,
    replicas: usize,
}

impl JetStreamQueueBuilder {
    /// How long a delivered key is remembered (its marker's age limit).
    /// Defaults to 25 hours.
    pub fn window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }

    /// The consumer's ack wait: an entry whose worker stopped renewing it
    /// (died) is handed out again after it. Give it the workers' lease.
    /// Defaults to 30 seconds.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease.max(Duration::from_secs(1));
        self
    }

    /// Replicas of the streams and buckets when they are created (in a
    /// JetStream cluster: 3, so that a PubAck means a quorum holds the
    /// entry). Defaults to 1. Streams that exist keep their settings.
    pub fn replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas.max(1);
        self
    }

    /// Connects to `url` (`nats://HOST:PORT`, `nats://USER:PASS@HOST:PORT`,
    /// `tls://…`) and opens the queue.
    pub async fn connect(self, url: &str) -> Result<JetStreamQueue, QueueError> {
        let addr: async_nats::ServerAddr = url
            .parse()
            .map_err(|_| fail(QueueErrorKind::Invalid, "not a nats://HOST:PORT address"))?;
        // The client does not read credentials from the address itself.
        let mut options = async_nats::ConnectOptions::new().name("tower-idempotency");
        match (addr.username(), addr.password()) {
            (Some(user), Some(pass)) => {
                options = options.user_and_password(unescape(user), unescape(pass));
            }
            (Some(token), None) => options = options.token(unescape(token)),
            _ => {}
        }
        let client = options.connect(addr).await.map_err(err)?;
        self.open(client).await
    }

    /// Opens (or creates) the queue over a client you connected (TLS,
    /// credentials, NKeys).
    pub async fn open(self, client: async_nats::Client) -> Result<JetStreamQueue, QueueError> {
        let js = jetstream::new(client.clone());
        let base = sanitize(&self.name);
        let subject = format!("idem.{base}.q");
        let dead_subject = format!("idem.{base}.dead");
        let queue = js
            .get_or_create_stream(stream::Config {
                name: format!("IDEM_{base}"),
                subjects: vec![subject.clone()],
                retention: stream::RetentionPolicy::WorkQueue,
                storage: stream::StorageType::File,
                num_replicas: self.replicas,
                duplicate_window: DUPLICATE_WINDOW,
                ..Default::default()
            })
            .await
            .map_err(|e| err_in(format_args!("the stream IDEM_{base}"), e))?;
        let dead = js
            .get_or_create_stream(stream::Config {
                name: format!("IDEM_{base}_DEAD"),
                subjects: vec![dead_subject.clone()],
                storage: stream::StorageType::File,
                num_replicas: self.replicas,
                duplicate_window: DUPLICATE_WINDOW,
                ..Default::default()
            })
            .await
            .map_err(|e| err_in(format_args!("the stream IDEM_{base}_DEAD"), e))?;
        let config = consumer::pull::Config {
            durable_name: Some(CONSUMER.to_owned()),
            filter_subject: subject.clone(),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait: self.lease,
            max_deliver: -1,
            // Entries backing off (nak with a delay) stay pending: no
            // limit, so that a backlog of failures never blocks new ones.
            max_ack_pending: -1,
            ..Default::default()
        };
        let consumer: consumer::PullConsumer = match queue.get_consumer(CONSUMER).await {
            Ok(c) => {
                let c: consumer::PullConsumer = c;
                if c.cached_info().config.ack_wait != self.lease {
                    // The same durable again with the new ack wait (an
                    // update, on servers that allow it).
                    queue
                        .create_consumer(config)
                        .await
                        .map_err(|e| err_in("the consumer's ack wait is not this lease", e))?
                } else {
                    c
                }
            }
            Err(_) => queue
                .get_or_create_consumer(CONSUMER, config)
                .await
                .map_err(|e| err_in(format_args!("the consumer {CONSUMER}"), e))?,
        };
        let keys = bucket(&js, format!("IDEM_{base}_KEYS"), self.window, self.replicas).await?;
        let pace = bucket(
            &js,
            format!("IDEM_{base}_PACE"),
            Duration::ZERO,
            self.replicas,
        )
        .await?;
        Ok(JetStreamQueue {
            inner: Arc::new(Inner {
                client,
                js,
                name: self.name,
                subject,
                dead_subject,
                queue,
                dead,
                consumer,
                keys,
                pace,
                held: Mutex::new(HashMap::new()),
                next_lease: AtomicU64::new(1),
                ack_wait: self.lease,
            }),
        })
    }
}

/// Opens (or creates) a key-value bucket. Its stream is created here as
/// the client's `create_key_value` would (that call first reads the
/// account's info, which some servers answer in a form the client cannot
/// read).
async fn bucket(
    js: &jetstream::Context,
    name: String,
    max_age: Duration,
    replicas: usize,
) -> Result<kv::Store, QueueError> {
    js.get_or_create_stream(stream::Config {
        name: format!("KV_{name}"),
        subjects: vec![format!("$KV.{name}.>")],
        max_messages_per_subject: 1,
        max_age,
        storage: stream::StorageType::File,
        allow_rollup: true,
        deny_delete: true,
        allow_direct: true,
        discard: stream::DiscardPolicy::New,
        num_replicas: replicas,
        ..Default::default()
    })
    .await
    .map_err(|e| err_in(format_args!("the bucket {name}"), e))?;
    js.get_key_value(name.clone())
        .await
        .map_err(|e| err_in(format_args!("the bucket {name}"), e))
}

impl JetStreamQueue {
    /// A builder for the queue `name` (window, lease, replicas).
    pub fn builder(name: &str) -> JetStreamQueueBuilder {
        JetStreamQueueBuilder {
            name: name.to_owned(),
            window: Duration::from_secs(25 * 3600),
            lease: Duration::from_secs(30),
            replicas: 1,
        }
    }

    /// Connects to `url` and opens (or creates) the queue `name` with the
    /// defaults of [`builder`](Self::builder).
    pub async fn connect(url: &str, name: &str) -> Result<Self, QueueError> {
        Self::builder(name).connect(url).await
    }

    /// The queue's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }
}
