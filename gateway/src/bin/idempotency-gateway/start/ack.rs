//! Acknowledge-then-deliver: the queue picked by `--queue` (or the embedded
//! one in `--data-dir`), and the worker that delivers its entries through
//! the routes' dedup layers.

use crate::settings::routes::RouteSettings;
use crate::start::pauses;
use crate::start::store::GatewayStore;
use either::Either;
use idempotency_gateway::journal::{Journal, JournalEvent, JournalOutcome};
use idempotency_gateway::proxy::{
    destination_scope, pause_key, Gateway, Pauses, RouteTable, Target,
};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tower::Service;
use tower_idempotency::consumer::Failure;
use tower_idempotency_queue::original_key;
use tower_idempotency_queue::{
    AmqpQueue, JetStreamQueue, Message, Pace, Park, Queue, QueueKey, RedbQueue, RedisStreamsQueue,
    Sealed, Worker,
};
use tracing::{error, info, warn};

/// The queue: the embedded file, or one of the queues several gateways
/// share.
pub(crate) type GatewayQueue = Either<RedbQueue, SharedQueue>;

/// A queue several gateways share, whose workers pace together: Redis
/// Streams, RabbitMQ (its key records in the gateway's store), or NATS
/// JetStream.
pub(crate) type SharedQueue =
    Either<RedisStreamsQueue, Either<AmqpQueue<GatewayStore>, JetStreamQueue>>;

/// The shared queue of `queue`, if it is one (`None`: the embedded queue).
pub(crate) fn shared(queue: &GatewayQueue) -> Option<&SharedQueue> {
    queue.as_ref().right()
}

/// The queue as routes ingest into it and the worker delivers from it:
/// sealed (see [`QueueSettings::seal`]), or, for a shared queue given no
/// secret, as it is.
pub(crate) type DeliveryQueue = Either<Sealed<GatewayQueue>, GatewayQueue>;

/// How the worker paces its deliveries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pacing {
    /// On its own concurrency, rate and breaker: one gateway on its queue
    /// (the embedded one).
    Alone,
    /// Together with every gateway on the queue: a route's
    /// `deliver_concurrency` and `deliver_rate` hold for all of them, and
    /// its breaker is the queue's where the queue shares one.
    Shared,
}

/// The queue the worker delivers from, by how it paces.
pub(crate) enum WorkerQueue {
    /// The embedded queue: paces alone.
    Alone(Either<Sealed<RedbQueue>, RedbQueue>),
    /// A queue several gateways share: paces with them.
    Shared(Either<Sealed<SharedQueue>, SharedQueue>),
}

impl WorkerQueue {
    /// `queue` for a worker that paces as `pacing` says; an error when the
    /// queue opened cannot pace so (a worker that must pace with the other
    /// gateways never falls back to pacing alone in silence).
    pub(crate) fn new(
        queue: DeliveryQueue,
        pacing: Pacing,
        describe: &str,
    ) -> Result<Self, String> {
        let split = match queue {
            Either::Left(sealed) => match sealed.factor() {
                Either::Left(embedded) => Self::Alone(Either::Left(embedded)),
                Either::Right(shared) => Self::Shared(Either::Left(shared)),
            },
            Either::Right(Either::Left(embedded)) => Self::Alone(Either::Right(embedded)),
            Either::Right(Either::Right(shared)) => Self::Shared(Either::Right(shared)),
        };
        match (pacing, &split) {
            (Pacing::Shared, Self::Alone(_)) => Err(format!(
                "the queue {describe} is the embedded one, which cannot pace deliveries together with other gateways, but the configuration needs its worker to (a queue several gateways share: `--queue redis://…`, `amqp://…` or `nats://…`)"
            )),
            _ => Ok(split),
        }
    }

    /// How its worker paces.
    pub(crate) fn pacing(&self) -> Pacing {
        match self {
            Self::Alone(_) => Pacing::Alone,
            Self::Shared(_) => Pacing::Shared,
        }
    }
}

/// `worker`, parking a paused route's entries under its prefix until the
/// route resumes (see `pauses::spawn_waker`).
/// A paused destination's entries (`pause PREFIX --upstream NAME`) are
/// parked under its own name (`destinations`: the routes' destinations).
fn parking<Q: Park, S>(
    worker: Worker<Q, S>,
    pauses: &Pauses,
    destinations: &[DestinationLane],
) -> Worker<Q, S> {
    let paused = pauses.clone();
    let mut routes = RouteTable::new();
    for DestinationLane { prefix, .. } in destinations {
        let _ = routes.insert(prefix, prefix.clone());
    }
    worker.park_paused(move |m: &Message| {
        let path = m.uri.path();
        paused.covering(path).or_else(|| {
            let (route, _) = routes.find(path)?;
            let scope = destination_scope(route, m.destination.as_deref()?);
            paused.is_paused(&scope).then(|| pause_key(&scope))
        })
    })
}

/// A shared queue the worker delivers from, by whether it parks a paused
/// route's entries: Redis Streams does (left); RabbitMQ and JetStream,
/// whose delays cannot be shortened once set, do not (right).
fn by_parking(
    queue: Either<Sealed<SharedQueue>, SharedQueue>,
) -> Either<
    Either<Sealed<RedisStreamsQueue>, RedisStreamsQueue>,
    Either<Sealed<Postponing>, Postponing>,
> {
    match queue {
        Either::Left(sealed) => match sealed.factor() {
            Either::Left(redis) => Either::Left(Either::Left(redis)),
            Either::Right(other) => Either::Right(Either::Left(other)),
        },
        Either::Right(Either::Left(redis)) => Either::Left(Either::Right(redis)),
        Either::Right(Either::Right(other)) => Either::Right(Either::Right(other)),
    }
}

/// The shared queues that cannot park a paused route's entries.
type Postponing = Either<AmqpQueue<GatewayStore>, JetStreamQueue>;

/// The embedded queue's key, made at its first start: `DIR/queue.key`.
const EMBEDDED_KEY: &str = "queue.key";

/// The queue's name in metrics, in Redis, on RabbitMQ and in JetStream.
const NAME: &str = "gateway";

/// `--data-dir` when neither it nor `--queue` is given.
pub(crate) const DEFAULT_DATA_DIR: &str = "./gateway-data";

/// Creates the data directory (and its missing parents) readable by its
/// owner only (0700): the queue and the journal hold what senders sent. An
/// existing directory is left as it is.
pub(crate) fn create_private_dir(dir: &std::path::Path) -> Result<(), String> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    builder
        .create(dir)
        .map_err(|e| format!("cannot create {}: {e}", dir.display()))
}

/// `--data-dir-reserve` when it is not given.
pub(crate) const DEFAULT_DATA_DIR_RESERVE: u64 = 64 << 20;

/// Where the queue lives.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum QueueSpec {
    /// The embedded queue, `DIR/queue.redb`.
    Dir(PathBuf),
    /// Redis Streams at this URL.
    Redis(String),
    /// RabbitMQ at this URL (`amqp://USER:PASS@HOST:PORT/VHOST`).
    Amqp(String),
    /// NATS JetStream at this URL.
    Nats(String),
}

/// `--queue DIR|redis://HOST:PORT|amqp://USER:PASS@HOST:PORT/VHOST|nats://HOST:PORT`.
pub(crate) fn queue_spec(s: &str) -> Result<QueueSpec, String> {
    const EXPECTED: &str =
        "a directory, redis://HOST:PORT, amqp://USER:PASS@HOST:PORT/VHOST or nats://HOST:PORT";
    if s.starts_with("redis://") || s.starts_with("rediss://") {
        return Ok(QueueSpec::Redis(s.to_owned()));
    }
    if s.starts_with("amqp://") || s.starts_with("amqps://") {
        return Ok(QueueSpec::Amqp(s.to_owned()));
    }
    if s.starts_with("nats://") || s.starts_with("tls://") {
        return Ok(QueueSpec::Nats(s.to_owned()));
    }
    if s.contains("://") {
        return Err(format!(
            "`{}`: expected {EXPECTED}",
            crate::redact::redact(s)
        ));
    }
    if s.is_empty() {
        return Err(format!("expected {EXPECTED}"));
    }
    Ok(QueueSpec::Dir(PathBuf::from(s)))
}

/// `--max-attempts N`: at least 1.
pub(crate) fn attempts(s: &str) -> Result<u32, String> {
    match s.parse::<u32>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err("expected a whole number of attempts, at least 1".into()),
    }
}

/// How the queue is opened and delivered.
#[derive(Debug, Clone)]
pub(crate) struct QueueSettings {
    pub(crate) spec: QueueSpec,
    /// Failed attempts before an entry is dead-lettered.
    pub(crate) max_attempts: u32,
    /// The backoff after the first failure (doubled after each, up to 15 minutes).
    pub(crate) backoff: Duration,
    /// Replicas that must hold an entry before it is acknowledged (Redis
    /// Streams only).
    pub(crate) replicas: u32,
    /// Bytes kept free on the embedded queue's disk (`--data-dir-reserve`).
    pub(crate) reserve: u64,
    /// The file of the secret the gateways of a queue share to seal its
    /// entries (`--queue-secret-file`).
    pub(crate) secret_file: Option<PathBuf>,
    /// Whether entries with no MAC (queued by an earlier version) are
    /// delivered (`queue_accept_unsigned`).
    pub(crate) accept_unsigned: bool,
    /// Whether a shared queue runs without a secret, trusting every writer
    /// (`queue_unauthenticated`).
    pub(crate) unauthenticated: bool,
}

impl QueueSettings {
    /// From the flags or file values; `None` keeps the defaults.
    pub(crate) fn new(
        queue: Option<QueueSpec>,
        data_dir: Option<PathBuf>,
        max_attempts: Option<u32>,
        backoff: Option<Duration>,
    ) -> Self {
        let dir = data_dir.unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR));
        Self {
            spec: queue.unwrap_or(QueueSpec::Dir(dir)),
            max_attempts: max_attempts.unwrap_or(25),
            backoff: backoff.unwrap_or(Duration::from_secs(1)),
            replicas: 0,
            reserve: DEFAULT_DATA_DIR_RESERVE,
            secret_file: None,
            accept_unsigned: false,
            unauthenticated: false,
        }
    }

    /// `--queue-secret-file FILE`, `queue_accept_unsigned` and
    /// `queue_unauthenticated`.
    pub(crate) fn sealing(
        mut self,
        secret_file: Option<PathBuf>,
        accept_unsigned: bool,
        unauthenticated: bool,
    ) -> Self {
        self.secret_file = secret_file;
        self.accept_unsigned = accept_unsigned;
        self.unauthenticated = unauthenticated;
        self
    }

    /// Before the gateway starts: the secret file (or the embedded queue's
    /// key, once made) is its owner's alone, and a shared queue has a
    /// secret unless the configuration trusts every writer of the queue.
    pub(crate) fn check_secret(&self) -> Result<(), String> {
        match (&self.secret_file, &self.spec) {
            (Some(file), _) => crate::private::check_secret_file(file, "queue secret file"),
            (None, QueueSpec::Dir(dir)) if dir.join(EMBEDDED_KEY).exists() => {
                crate::private::check_secret_file(&dir.join(EMBEDDED_KEY), "queue key file")
            }
            (None, QueueSpec::Dir(_)) => Ok(()),
            (None, _) if self.unauthenticated => Ok(()),
            (None, _) => Err(format!(
                "the shared queue {} has no secret: anyone who can write to it could have this \
                 gateway deliver any notification to an ack-then-deliver route. Make one, once, \
                 for every gateway of the queue (`head -c 32 /dev/urandom > FILE && chmod 600 \
                 FILE`) and give it as `--queue-secret-file FILE` (`queue_secret_file`); or, to \
                 trust every writer of the queue, write `queue_unauthenticated = true` \
                 (`--queue-unauthenticated`)",
                self.describe()
            )),
        }
    }

    /// `queue` with its entries sealed and checked: under the secret of
    /// `--queue-secret-file`, or for the embedded queue under the key made
    /// at its first start in the data directory (`queue.key`, 0600). A
    /// shared queue given no secret (only with `queue_unauthenticated`, see
    /// [`QueueSettings::check_secret`]) is delivered as it is, with an error
    /// in the log: a key of this instance's own would refuse every other
    /// instance's entries.
    pub(crate) fn seal(&self, queue: GatewayQueue) -> Result<DeliveryQueue, String> {
        let key = match (&self.secret_file, &self.spec) {
            (Some(file), _) => QueueKey::from_file(file).map_err(|e| e.to_string())?,
            (None, QueueSpec::Dir(dir)) => {
                create_private_dir(dir)?;
                QueueKey::load_or_create(&dir.join(EMBEDDED_KEY)).map_err(|e| e.to_string())?
            }
            (None, _) => {
                // Only with `queue_unauthenticated` (see `check_secret`).
                error!(queue = %self.describe(), "THE SHARED QUEUE'S ENTRIES ARE NOT AUTHENTICATED (`queue_unauthenticated`): anyone who can write to it can have this gateway deliver any notification to any ack-then-deliver route; give every gateway of this queue the same `--queue-secret-file`");
                return Ok(Either::Right(queue));
            }
        };
        if self.accept_unsigned {
            warn!(queue = %self.describe(), "`queue_accept_unsigned` is on: queue entries with no MAC (queued by an earlier version, or by anyone who can write to the queue) are delivered; turn it off once they are drained");
        }
        Ok(Either::Left(
            Sealed::new(queue, key, NAME).accept_unsigned(self.accept_unsigned),
        ))
    }

    /// `--data-dir-reserve SIZE`; `None` keeps the default.
    pub(crate) fn reserve(mut self, reserve: Option<usize>) -> Self {
        if let Some(reserve) = reserve {
            self.reserve = reserve as u64;
        }
        self
    }

    /// `--queue-replicas N`: only for a Redis Streams queue.
    pub(crate) fn replicas(mut self, replicas: u32) -> Result<Self, String> {
        if replicas > 0 && !matches!(self.spec, QueueSpec::Redis(_)) {
            return Err(
                "`--queue-replicas` needs a Redis Streams queue (`--queue redis://HOST:PORT`); the embedded queue is one file on one node".into(),
            );
        }
        self.replicas = replicas;
        Ok(self)
    }

    /// Whether several gateways can share this queue (Redis Streams,
    /// RabbitMQ, JetStream).
    pub(crate) fn is_shared(&self) -> bool {
        matches!(
            self.spec,
            QueueSpec::Redis(_) | QueueSpec::Amqp(_) | QueueSpec::Nats(_)
        )
    }

    /// How the worker must pace: together with the other gateways on a
    /// queue several of them can share, alone on the embedded one.
    pub(crate) fn pacing(&self) -> Pacing {
        match self.is_shared() {
            true => Pacing::Shared,
            false => Pacing::Alone,
        }
    }

    /// Opens (or creates) the queue; a RabbitMQ queue keeps its key records
    /// in `store`.
    pub(crate) async fn open(&self, store: &GatewayStore) -> Result<GatewayQueue, String> {
        match &self.spec {
            QueueSpec::Dir(dir) => {
                create_private_dir(dir)?;
                crate::private::owner_only_file(&dir.join("queue.redb"))?;
                RedbQueue::open(dir.join("queue.redb"))
                    .map(|q| Either::Left(q.reserve(self.reserve)))
                    .map_err(|e| format!("cannot open the queue: {e}"))
            }
            QueueSpec::Redis(url) => RedisStreamsQueue::standalone(url.as_str(), NAME)
                .await
                .map(|q| Either::Right(Either::Left(q.replicas(self.replicas))))
                .map_err(|e| {
                    let (shown, e) = (crate::redact::redact(url), crate::redact::scrub(url, e));
                    format!("cannot open the queue at {shown}: {e}")
                }),
            QueueSpec::Amqp(url) => AmqpQueue::open(url, NAME, store.clone())
                .await
                .map(|q| Either::Right(Either::Right(Either::Left(q))))
                .map_err(|e| {
                    let (shown, e) = (crate::redact::redact(url), crate::redact::scrub(url, e));
                    format!("cannot open the queue at {shown}: {e}")
                }),
            QueueSpec::Nats(url) => JetStreamQueue::connect(url, NAME)
                .await
                .map(|q| Either::Right(Either::Right(Either::Right(q))))
                .map_err(|e| {
                    let (shown, e) = (crate::redact::redact(url), crate::redact::scrub(url, e));
                    format!("cannot open the queue at {shown}: {e}")
                }),
        }
    }

    /// The queue to deliver from: always when a route acknowledges first
    /// (`acked`); otherwise the queue of an earlier run if it still holds
    /// entries (an acknowledgement is owed to the entry, not to the
    /// configuration), or a Redis queue named by `--queue` (other instances
    /// may fill it).
    pub(crate) async fn open_for(
        &self,
        acked: bool,
        store: &GatewayStore,
    ) -> Result<Option<GatewayQueue>, String> {
        if acked {
            return self.open(store).await.map(Some);
        }
        if let QueueSpec::Dir(dir) = &self.spec
            && !dir.join("queue.redb").exists()
        {
            return Ok(None);
        }
        let queue = match self.open(store).await {
            Ok(queue) => queue,
            Err(e) => {
                warn!(error = %e, "no route acknowledges first, and the queue of earlier runs cannot be opened: its entries wait for the next start");
                return Ok(None);
            }
        };
        if let Either::Left(embedded) = &queue {
            match embedded.stats().await {
                Ok(stats) if stats.depth == 0 => return Ok(None),
                Ok(stats) => info!(
                    entries = stats.depth,
                    "no route acknowledges first; delivering the entries queued by earlier runs"
                ),
                Err(e) => warn!(error = %e, "cannot read the queue of earlier runs"),
            }
        }
        Ok(Some(queue))
    }

    /// Where the queue is, for the start line.
    pub(crate) fn describe(&self) -> String {
        match &self.spec {
            QueueSpec::Dir(dir) => dir.join("queue.redb").display().to_string(),
            QueueSpec::Redis(url) | QueueSpec::Amqp(url) | QueueSpec::Nats(url) => {
                crate::redact::redact(url)
            }
        }
    }

    /// Delivers the queue's entries through `gateway` until `stop` fires,
    /// each ack-then-deliver route at its own pace (`lanes`, by prefix; see
    /// `pace::lanes`): across every gateway on a shared queue, alone on the
    /// embedded one.
    pub(crate) fn spawn_worker(
        &self,
        queue: WorkerQueue,
        gateway: &Gateway<GatewayStore>,
        journal: Option<Journal>,
        (lanes, destinations): (&[(String, Option<Pace>)], &[DestinationLane]),
        pauses: &Pauses,
        stop: tokio::sync::oneshot::Receiver<()>,
    ) -> tokio::task::JoinHandle<()> {
        info!(queue = %self.describe(), max_attempts = self.max_attempts, pacing = ?queue.pacing(), "delivering queued notifications");
        // Entries nobody authenticated reach no synchronous route.
        let unauthenticated = match &queue {
            WorkerQueue::Alone(Either::Left(_)) | WorkerQueue::Shared(Either::Left(_)) => {
                self.accept_unsigned
            }
            WorkerQueue::Alone(Either::Right(_)) | WorkerQueue::Shared(Either::Right(_)) => true,
        };
        let stop = async move {
            let _ = stop.await;
        };
        // A paused route's entries are parked until it resumes (see
        // `pauses::spawn_waker`), where the queue can park them: the
        // embedded queue and Redis Streams. RabbitMQ and JetStream postpone
        // them.
        match queue {
            WorkerQueue::Alone(queue) => {
                pauses::spawn_waker(pauses.clone(), queue.clone());
                let worker = self.worker(
                    queue,
                    gateway,
                    journal,
                    (lanes, destinations),
                    unauthenticated,
                );
                tokio::spawn(parking(worker, pauses, destinations).run(stop))
            }
            WorkerQueue::Shared(queue) => match by_parking(queue) {
                Either::Left(queue) => {
                    pauses::spawn_waker(pauses.clone(), queue.clone());
                    let worker = self.worker(
                        queue,
                        gateway,
                        journal,
                        (lanes, destinations),
                        unauthenticated,
                    );
                    tokio::spawn(
                        parking(worker, pauses, destinations)
                            .shared_pacing()
                            .run(stop),
                    )
                }
                Either::Right(queue) => {
                    let worker = self.worker(
                        queue,
                        gateway,
                        journal,
                        (lanes, destinations),
                        unauthenticated,
                    );
                    tokio::spawn(worker.shared_pacing().run(stop))
                }
            },
        }
    }

    /// The worker over `queue`, its lanes one per ack-then-deliver route.
    fn worker<Q: Queue>(
        &self,
        queue: Q,
        gateway: &Gateway<GatewayStore>,
        journal: Option<Journal>,
        (lanes, destinations): (&[(String, Option<Pace>)], &[DestinationLane]),
        unauthenticated: bool,
    ) -> Worker<
        Q,
        impl Service<Message, Response: Send, Error: Failure + Send, Future: Send> + Send + 'static,
    > {
        let deliver = gateway.deliverer().ack_routes_only(unauthenticated);
        // Each attempt is journaled under the key it was queued for.
        let deliver = tower::service_fn(move |message: Message| {
            let (mut deliver, journal) = (deliver.clone(), journal.clone());
            async move {
                // A destination's entry: under the notification's key, each
                // destination's delivery noted on its record.
                let key = match &message.destination {
                    None => original_key(&message.key).to_owned(),
                    Some(_) => message.notification_key().to_owned(),
                };
                let destination = message.destination.clone();
                let route = message.uri.path().to_owned();
                let trace_id = crate::serve::otel::delivery_trace_id(&message.headers);
                let done = deliver.call(message).await;
                if let Some(journal) = journal {
                    let (outcome, upstream) = match &done {
                        // Settled by the route's order: acked, never delivered.
                        Ok(d) if d.is_stale() => (JournalOutcome::Stale, None),
                        Ok(d) => (JournalOutcome::Delivered, d.upstream()),
                        Err(e) => (JournalOutcome::DeliveryFailed, e.upstream()),
                    };
                    let preset = key.split(':').nth(1).unwrap_or_default().to_owned();
                    let note = match (&destination, &done) {
                        (Some(d), Ok(_)) => Some(
                            JournalEvent::new(
                                key.clone(),
                                preset.clone(),
                                route.clone(),
                                JournalOutcome::Delivered,
                            )
                            .note(format!("delivered to {d}")),
                        ),
                        _ => None,
                    };
                    let mut event = JournalEvent::new(key, preset, route, outcome).attempt();
                    // What the upstream answered this attempt, when it was called.
                    if let Some(answer) = upstream {
                        event = event.upstream(answer.status.as_u16(), answer.took);
                    }
                    if let Some(trace_id) = &trace_id {
                        event = event.trace_id(trace_id);
                    }
                    journal.record(event);
                    if let Some(note) = note {
                        journal.record(note);
                    }
                }
                done
            }
        });
        let mut worker = Worker::new(queue, deliver)
            .name(NAME)
            .max_attempts(self.max_attempts)
            .backoff(self.backoff, Duration::from_secs(15 * 60))
            .concurrency(crate::settings::pace::DEFAULT_DELIVER_CONCURRENCY);
        // Entries of a path no ack-then-deliver route serves now (queued by
        // an earlier run) go to the default lane.
        let mut table = RouteTable::new();
        let mut held = crate::settings::pace::DEFAULT_DELIVER_CONCURRENCY;
        for (prefix, pace) in lanes {
            let lane = pace.as_ref().map(|_| Arc::<str>::from(prefix.as_str()));
            // The prefixes were checked with the routes.
            let _ = table.insert(prefix, lane);
            if let Some(pace) = pace {
                info!(route = %prefix, pace = %crate::settings::pace::describe(pace), "ack-then-deliver route's pace");
                held = held.saturating_add(pace.get_concurrency().unwrap_or(0));
                worker = worker.lane(prefix.as_str(), pace.clone());
            }
        }
        // A destination's entries in a lane of their own: its pace and
        // breaker alone.
        let mut own = std::collections::HashMap::new();
        for DestinationLane {
            prefix,
            destination,
            pace,
        } in destinations
        {
            // The worker names a destination's lane `PREFIX@NAME`.
            let lane = Arc::<str>::from(format!("{prefix}@{destination}"));
            info!(route = %prefix, destination = %destination, pace = %crate::settings::pace::describe(pace), "destination's pace");
            held = held.saturating_add(pace.get_concurrency().unwrap_or(0));
            worker = worker.destination_lane(prefix.as_str(), destination.as_str(), pace.clone());
            own.insert((prefix.clone(), destination.clone()), lane);
        }
        worker.batch(held.max(32)).lanes(move |m: &Message| {
            let route = table.find(m.uri.path())?.0.clone()?;
            match &m.destination {
                None => Some(route),
                Some(d) => own.get(&(route.to_string(), d.clone())).cloned(),
            }
        })
    }
}

/// The lane of one destination of a route: its entries' own pace.
pub(crate) struct DestinationLane {
    pub(crate) prefix: String,
    pub(crate) destination: String,
    pub(crate) pace: Pace,
}

/// Warns about every ack-then-deliver route that does not verify its
/// sender: anyone can queue a notification there, and a copy with another
/// payload is queued beside the first (the upstream must check them).
/// How long after it was queued an entry may still be delivered: the
/// shortest window of the ack-then-deliver routes (an older entry could be
/// a copy of one delivered and forgotten, written back into the queue).
pub(crate) fn max_age(routes: &[RouteSettings]) -> Duration {
    (routes.iter())
        .filter(|r| r.options.is_ack_then_deliver())
        .map(|r| match (r.options.get_window(), &r.target) {
            (Some(window), _) => window,
            (None, Target::Preset(preset)) => preset.window(),
            (None, Target::Auto) => tower_idempotency_queue::DEFAULT_MAX_AGE,
        })
        .min()
        .unwrap_or(tower_idempotency_queue::DEFAULT_MAX_AGE)
}

pub(crate) fn warn_unverified(routes: &[RouteSettings]) {
    for RouteSettings {
        prefix, options, ..
    } in routes
    {
        if options.is_ack_then_deliver() && !options.verifies() {
            warn!(route = %prefix, "ack-then-deliver route without `verify`: its notifications are acknowledged before anyone checked their sender; copies with another payload are queued beside the first (up to 4) and the upstream decides; configure the channel's keys in the route's `verify` table");
        }
    }
}

/// Warns when a shared queue (Redis Streams, JetStream) is delivered through a memory store:
/// every instance on that queue keeps its own records, so an entry another
/// instance reclaims (its worker died or its lease ran out) or a redelivery
/// finds no record there and reaches the upstream again.
pub(crate) fn warn_memory_store(queue: &QueueSettings, memory_store: bool) {
    if matches!(queue.spec, QueueSpec::Amqp(_)) && memory_store {
        warn!(queue = %queue.describe(), "THE RABBITMQ QUEUE KEEPS ITS KEY RECORDS IN `--store memory`: if several gateways share this queue, each deduplicates and paces (`deliver_concurrency`, `deliver_rate`) on its own, and an entry one of them redelivers finds no record in another's memory and can reach the upstream twice; give every instance the same `--store redis://…`, or run one instance");
        return;
    }
    if queue.is_shared() && memory_store {
        warn!(queue = %queue.describe(), "THE SHARED QUEUE IS DELIVERED THROUGH `--store memory`: if several gateways share this queue, an entry one of them reclaims from another finds no record in its own memory and can reach the upstream twice; give every instance the same `--store redis://…`, or run one instance");
    }
}

/// A route's `mode`: `true` for `ack-then-deliver`.
pub(crate) fn mode(mode: &str, target: &Target) -> Result<bool, String> {
    match mode {
        "synchronous" => Ok(false),
        "ack-then-deliver" => ackable(target).map(|()| true),
        _ => Err(format!(
            "`mode`: `{mode}` is not `synchronous` or `ack-then-deliver`"
        )),
    }
}

fn ackable(target: &Target) -> Result<(), String> {
    match target {
        Target::Preset(p) if !p.is_client_api() => Ok(()),
        Target::Preset(p) => Err(format!(
            "ack-then-deliver needs a channel preset; `{}` answers with its handler's response",
            p.name()
        )),
        Target::Auto => Err("ack-then-deliver needs the route's preset, not `auto`".into()),
    }
}

/// Applies `--ack-then-deliver PREFIX` flags to the routes with that prefix.
pub(crate) fn flag_routes(prefixes: &[String], routes: &mut [RouteSettings]) -> Result<(), String> {
    for prefix in prefixes {
        let norm = |p: &str| p.trim_end_matches('/').to_owned();
        let route = routes
            .iter_mut()
            .find(|r| norm(&r.prefix) == norm(prefix))
            .ok_or_else(|| {
                format!("`--ack-then-deliver {prefix}`: no route has this prefix (add `--route {prefix}=PRESET`)")
            })?;
        ackable(&route.target).map_err(|e| format!("`--ack-then-deliver {prefix}`: {e}"))?;
        route.options = route.options.clone().ack_then_deliver(true);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn embedded() -> (RedbQueue, PathBuf) {
        let dir = std::env::temp_dir().join(format!(
            "gw-pacing-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        create_private_dir(&dir).unwrap();
        let queue = RedbQueue::open(dir.join("queue.redb")).unwrap();
        (queue, dir)
    }

    #[test]
    fn a_shared_queue_needs_its_worker_to_pace_with_the_others() {
        let spec = |s: &str| QueueSettings::new(Some(queue_spec(s).unwrap()), None, None, None);
        assert_eq!(spec("redis://127.0.0.1:6379").pacing(), Pacing::Shared);
        assert_eq!(spec("amqp://u:p@127.0.0.1:5672/v").pacing(), Pacing::Shared);
        assert_eq!(spec("nats://127.0.0.1:4222").pacing(), Pacing::Shared);
        assert_eq!(spec("./data").pacing(), Pacing::Alone);
    }

    #[test]
    fn the_embedded_queue_paces_alone_and_refuses_a_worker_that_must_share() {
        let (queue, dir) = embedded();
        let key = QueueKey::new(&[7; 32]).unwrap();
        let sealed: DeliveryQueue =
            Either::Left(Sealed::new(Either::Left(queue.clone()), key, NAME));
        let alone = WorkerQueue::new(sealed.clone(), Pacing::Alone, "q").unwrap();
        assert_eq!(alone.pacing(), Pacing::Alone);
        let plain: DeliveryQueue = Either::Right(Either::Left(queue));
        let alone = WorkerQueue::new(plain.clone(), Pacing::Alone, "q").unwrap();
        assert_eq!(alone.pacing(), Pacing::Alone);
        for queue in [sealed, plain] {
            let refused = WorkerQueue::new(queue, Pacing::Shared, "./data/queue.redb");
            let Err(e) = refused else {
                panic!("a worker that must pace with other gateways got the embedded queue");
            };
            assert!(
                e.contains("./data/queue.redb is the embedded one")
                    && e.contains("cannot pace deliveries together with other gateways"),
                "{e}"
            );
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}
