//! [`GatewayBuilder`]: a [`Gateway`]'s routes, each with one idempotency
//! stack per preset, built once at start.

use super::entrance::verified_presets;
use super::forward::RouteLimit;
use super::gateway::{Gateway, Guard, Route, Shared, Target};
use super::ingest::{Ingest, IngestFn};
use super::order::{Answer, ToUpstream};
use super::route::{RouteError, RouteTable};
use super::{Forward, RouteOptions};
use crate::shed::Gauge;
use std::fmt;
use std::sync::Arc;
use tower_idempotency::limit::BodyLimitsLayer;
use tower_idempotency::store::Store;
use tower_idempotency::token::IssueToken;
use tower_idempotency::{Preset, TaskTracker};
use tower_idempotency_queue::Queue;
use tower_layer::Layer;

/// The name of the unguarded requests' share of the upstream's calls (no
/// prefix: a prefix starts with `/`).
const UNGUARDED: &str = "unguarded";

/// Builds a [`Gateway`]; from [`Gateway::builder`].
#[derive(Debug)]
pub struct GatewayBuilder<S> {
    forward: Forward,
    store: S,
    routes: RouteTable<(Target, RouteOptions)>,
    error: Option<RouteError>,
    tasks: TaskTracker,
    queue: Option<IngestFn>,
    bodies: BodyLimitsLayer,
    stores: Option<PickStore<S>>,
    capture: bool,
    extensions: bool,
    accept_traceparent: Option<bool>,
    pauses: Option<super::pause::Pauses>,
}

/// The function that picks a route's store for one of its presets.
type PickFn<S> = dyn Fn(&str, &Preset) -> S + Send + Sync;

/// Picks the store of a route's records for one preset.
struct PickStore<S>(Box<PickFn<S>>);

impl<S> fmt::Debug for PickStore<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PickStore")
    }
}

impl<S: Store> Gateway<S> {
    /// A builder of a gateway to `forward`'s upstream, keeping its records
    /// in `store`. It starts with no route: everything is forwarded.
    pub fn builder(forward: Forward, store: S) -> GatewayBuilder<S> {
        GatewayBuilder {
            forward,
            store,
            routes: RouteTable::new(),
            error: None,
            tasks: TaskTracker::new(),
            queue: None,
            bodies: BodyLimitsLayer::new(),
            stores: None,
            capture: false,
            extensions: true,
            accept_traceparent: None,
            pauses: None,
        }
    }
}

impl<S: Store> GatewayBuilder<S> {
    /// Routes `prefix` to `target` with every setting the preset's.
    pub fn route(self, prefix: &str, target: Target) -> Self {
        self.route_with(prefix, target, RouteOptions::new())
    }

    /// Routes `prefix` to `target` with `options`.
    pub fn route_with(mut self, prefix: &str, target: Target, options: RouteOptions) -> Self {
        if matches!(target, Target::Auto) && options.verifies() {
            self.error
                .get_or_insert(RouteError::VerifyOnAuto(prefix.to_owned()));
        }
        if let Err(e) = self.routes.insert(prefix, (target, options)) {
            self.error.get_or_insert(e);
        }
        self
    }

    /// The tracker every route's background work is spawned on (calls
    /// finished after the reply deadline or after their caller hung up,
    /// completions, releases). Defaults to a new tracker, see
    /// [`Gateway::tasks`].
    pub fn task_tracker(mut self, tracker: TaskTracker) -> Self {
        self.tasks = tracker;
        self
    }

    /// The deadline and the budget of the request bodies that guarded and
    /// `auto` routes buffer (see [`BodyLimitsLayer`]): past the deadline 408,
    /// past the budget the retryable failure at once (counted as shed).
    /// Streamed bodies (unrouted requests, safe methods on `auto` routes)
    /// are bounded by the [`Forward`]'s timeout instead. Defaults to
    /// [`BodyLimitsLayer::new`]: a deadline of 10 seconds and no budget.
    pub fn body_limits(mut self, limits: BodyLimitsLayer) -> Self {
        self.bodies = limits;
        self
    }

    /// The durable queue of the acknowledge-then-deliver routes (see
    /// [`RouteOptions::ack_then_deliver`]); deliver its entries with a
    /// [`Worker`](tower_idempotency_queue::Worker) over [`Gateway::deliverer`].
    /// Defaults to none: such a route is refused by [`build`](Self::build).
    pub fn queue<Q: Queue>(mut self, queue: Q) -> Self {
        self.queue = Some(IngestFn::new(queue));
        self
    }

    /// The store of each route's records: `pick(prefix, preset)` for every
    /// preset a route guards (its preset, or each preset of an `auto`
    /// route), its client tokens and its queued deliveries included.
    /// Give routes stores of their own (each with its own memory budget) so
    /// that one route's traffic, or client keys anyone can make up, never
    /// pushes another route's or a channel's records out. Defaults to the
    /// builder's store for every route.
    ///
    /// ```
    /// use idempotency_gateway::proxy::{Forward, Gateway, Target};
    /// use tower_idempotency::store::MemoryStore;
    /// use tower_idempotency::Preset;
    ///
    /// let (channels, clients) = (MemoryStore::new(), MemoryStore::new());
    /// let forward = Forward::new("http://127.0.0.1:9000".parse().unwrap());
    /// let gateway = Gateway::builder(forward, channels.clone())
    ///     .route("/", Target::Auto)
    ///     .stores(move |_prefix, preset: &Preset| {
    ///         if preset.is_client_api() { clients.clone() } else { channels.clone() }
    ///     })
    ///     .build()
    ///     .unwrap();
    /// # let _ = gateway;
    /// ```
    pub fn stores(mut self, pick: impl Fn(&str, &Preset) -> S + Send + Sync + 'static) -> Self {
        self.stores = Some(PickStore(Box::new(pick)));
        self
    }

    /// Whether every guarded response carries its request as a
    /// [`CapturedRequest`](tower_idempotency::key::CapturedRequest) in its extensions
    /// (the body, and the decrypted WeChat Pay v3 resource where the route
    /// decrypts), for a journal that records bodies or business ids.
    /// Defaults to `false`.
    pub fn capture_requests(mut self, capture: bool) -> Self {
        self.capture = capture;
        self
    }

    /// Whether every guarded response carries, in its extensions, its
    /// [`IdempotencyKey`](tower_idempotency::IdempotencyKey), its
    /// [`MatchedRoute`](super::MatchedRoute) and what the upstream answered
    /// ([`UpstreamAnswer`](super::UpstreamAnswer)), for outer code that reads
    /// them (a journal; a span that records the route; the crate's
    /// `idempotency` span records the key's `preset` and `key_hash` from
    /// there). [`Outcome`](tower_idempotency::Outcome) and
    /// [`RoutedPreset`](super::RoutedPreset) are always there. Off, each
    /// response costs three extensions less (allocations, and the map's
    /// growth past three entries); an acknowledge-then-deliver route keeps
    /// them, since its deliveries read them. Defaults to `true`.
    pub fn response_extensions(mut self, on: bool) -> Self {
        self.extensions = on;
        self
    }

    /// Whether a client's own `traceparent` and `tracestate` are followed
    /// (see [`ForwardBuilder::accept_traceparent`](super::ForwardBuilder::accept_traceparent)):
    /// on, a request that carries a valid `traceparent` runs in the
    /// client's trace (the `idempotency` span takes it as parent) unless a
    /// span of the program's is current, which then takes it itself (set
    /// its parent with [`trace::extract`](tower_idempotency::trace::extract)); off,
    /// they are dropped and every request starts a trace of its own (or
    /// joins the program's span). An acknowledge-then-deliver route stores
    /// its ingest's context with the notification either way. Defaults to
    /// the [`Forward`]'s setting (`false`).
    pub fn accept_traceparent(mut self, accept: bool) -> Self {
        self.accept_traceparent = Some(accept);
        self
    }

    /// Routes paused in `pauses` send nothing to the upstream while they
    /// stay paused (see [`Pauses`](super::Pauses)).
    pub fn pauses(mut self, pauses: super::pause::Pauses) -> Self {
        self.pauses = Some(pauses);
        self
    }

    /// The gateway, or the first bad route.
    pub fn build(self) -> Result<Gateway<S>, RouteError> {
        if let Some(e) = self.error {
            return Err(e);
        }
        for (prefix, (target, options)) in self.routes.iter() {
            if !options.is_ack_then_deliver() {
                if !options.get_destinations().is_empty() {
                    return Err(RouteError::AckThenDeliver(format!(
                        "{prefix}: destinations are delivered from the queue: the route must acknowledge, then deliver"
                    )));
                }
                continue;
            }
            let why = match target {
                _ if self.queue.is_none() => "no queue was given",
                Target::Auto => "the route must name its preset, not `auto`",
                Target::Preset(p) if p.is_client_api() => {
                    "a client API's answer is its handler's, which a queue cannot give"
                }
                Target::Preset(_) => continue,
            };
            return Err(RouteError::AckThenDeliver(format!("{prefix}: {why}")));
        }
        let verified = verified_presets(self.routes.iter());
        let forward = match self.accept_traceparent {
            Some(accept) => self.forward.with_accept_traceparent(accept),
            None => self.forward,
        };
        let (store, tasks, queue) = (self.store, self.tasks, self.queue);
        let bodies = self.bodies;
        let pick = self.stores;
        let capture = self.capture;
        let extensions = self.extensions;
        let pauses = self.pauses;
        let routes = self.routes.map(|prefix, (target, options)| {
            let store_for = |preset: &Preset| match &pick {
                Some(pick) => (pick.0)(prefix, preset),
                None => store.clone(),
            };
            // The reply deadline answers the caller; the run limit, not the
            // forwarder's timeout, ends the upstream call.
            let max_run = options
                .get_max_run()
                .unwrap_or(tower_idempotency::dedup::DEFAULT_MAX_RUN);
            // The route's own upstream, or the gateway's.
            let own = options
                .get_upstream()
                .map(|f| match self.accept_traceparent {
                    Some(accept) => f.clone().with_accept_traceparent(accept),
                    None => f.clone(),
                });
            let forward = own.as_ref().unwrap_or(&forward);
            // No cap of its own: a share of the upstream's, so that a slow
            // route cannot hold every slot.
            let slots = options
                .in_flight_slots()
                .cloned()
                .unwrap_or_else(|| forward.call_limit().share(prefix));
            // `idempotency_upstream_limit{route}` from the start.
            slots.name(prefix);
            // Deliveries read what the upstream answered.
            let extensions = extensions || options.is_ack_then_deliver();
            let guarded = forward
                .with_answer_extension(extensions)
                .with_timeout(max_run.max(forward.timeout()))
                .with_route_limit(RouteLimit {
                    slots,
                    queue_wait: options
                        .get_queue_wait()
                        .unwrap_or(forward.call_limit().get_queue_wait()),
                    gauge: Gauge::route(prefix),
                });
            let guarded = match &pauses {
                Some(p) => guarded.with_pause(p.gate(prefix)),
                None => guarded,
            };
            let reply = options.get_reply_timeout().unwrap_or(forward.timeout());
            // Every spelling of the route shares its records.
            let stack = |preset: Preset, options: &RouteOptions| {
                let store = store_for(&preset);
                // Behind the dedup layer: copies are replays before the
                // order sees them.
                let upstream = match options.order_layer(&preset, store.clone()) {
                    Some(order) => ToUpstream::Ordered(order.layer(Answer(guarded.clone()))),
                    None => ToUpstream::Forward(guarded.clone()),
                };
                options
                    .layer(preset, store)
                    .capture_request(capture)
                    .key_in_response(extensions)
                    .route(prefix)
                    .reply_timeout(reply)
                    .task_tracker(tasks.clone())
                    .layer(upstream)
            };
            let mut stacks: Vec<Guard<S>> = Vec::new();
            let guard = |preset: Preset, options: &RouteOptions| Guard {
                name: Arc::from(preset.name()),
                stack: stack(preset, options),
            };
            let mut issuer = None;
            let mut auto_limit = None;
            let mut ack = None;
            let mut route_reply = None;
            let mut channel = false;
            let mut deliver = None;
            let mut destinations = Vec::new();
            let mut reopen = None;
            match target {
                Target::Preset(preset) => {
                    route_reply = Some(preset.reply().clone());
                    channel = !preset.is_client_api();
                    if preset.consumes_token() {
                        let mut i = IssueToken::new(store_for(&preset));
                        if let Some(principal) = options.principal_for(&preset) {
                            i = i.principal(principal);
                        }
                        issuer = Some(i);
                    }
                    if let (true, Some(queue)) = (options.is_ack_then_deliver(), &queue) {
                        let ingest = Ingest {
                            queue: queue.clone(),
                            verified: options.verifies(),
                            accept_traceparent: forward.accepts_traceparent(),
                            destinations: options.get_destinations().into(),
                        };
                        let layer = options
                            .layer(preset.clone(), store_for(&preset))
                            .capture_request(capture)
                            .route(prefix);
                        ack = Some(layer.front(ingest));
                    }
                    if options.verifies() {
                        deliver = Some(stack(preset.clone(), &options.without_verify()));
                        reopen = options.reopener().cloned();
                    }
                    if options.is_ack_then_deliver() {
                        for d in options.get_destinations() {
                            let f = match self.accept_traceparent {
                                Some(accept) => d.forward.clone().with_accept_traceparent(accept),
                                None => d.forward.clone(),
                            };
                            let lane = super::destination_scope(prefix, &d.name);
                            let slots = f.call_limit().share(&lane);
                            slots.name(&lane);
                            let guarded = f
                                .with_answer_extension(true)
                                .with_timeout(max_run.max(f.timeout()))
                                .with_route_limit(RouteLimit {
                                    slots,
                                    queue_wait: options
                                        .get_queue_wait()
                                        .unwrap_or(f.call_limit().get_queue_wait()),
                                    gauge: Gauge::route(prefix),
                                });
                            let guarded = match &pauses {
                                Some(p) => guarded.with_pause(p.gate(prefix)),
                                None => guarded,
                            };
                            // Each destination's delivery is a claim of its
                            // own: its own record and fencing token; and, on
                            // a route with an order, its own positions.
                            let store = store_for(&preset);
                            let own = super::destination::store_prefix(&d.name);
                            let upstream = match options.order_layer(&preset, store.clone()) {
                                Some(order) => ToUpstream::Ordered(
                                    order.prefix(own.clone()).layer(Answer(guarded.clone())),
                                ),
                                None => ToUpstream::Forward(guarded),
                            };
                            let stack = options
                                .without_verify()
                                .layer(preset.clone(), store)
                                .prefix(own)
                                .capture_request(capture)
                                .key_in_response(extensions)
                                .route(prefix)
                                .reply_timeout(options.get_reply_timeout().unwrap_or(f.timeout()))
                                .task_tracker(tasks.clone())
                                .layer(upstream);
                            let gate = pauses.as_ref().map(|p| p.gate(&lane));
                            destinations.push((d.name.clone(), stack, gate));
                        }
                    }
                    stacks.push(guard(preset, &options));
                }
                Target::Auto => {
                    let mut limit = 0;
                    for name in Preset::builtin_names() {
                        if let Some(preset) = Preset::from_name(name) {
                            limit = limit.max(options.body_limit(&preset));
                            stacks.push(guard(preset, &options));
                        }
                    }
                    auto_limit = Some(limit);
                }
            }
            let preset = match auto_limit {
                Some(_) => Arc::from("auto"),
                None => stacks[0].name.clone(),
            };
            // What the route forwards unguarded goes to its own upstream,
            // as a share of that upstream's calls.
            let unguarded = own.as_ref().map(|f| {
                let calls = f.call_limit();
                let f = f.with_route_limit(RouteLimit {
                    slots: calls.share(UNGUARDED),
                    queue_wait: calls.get_queue_wait(),
                    gauge: Gauge::default(),
                });
                match &pauses {
                    Some(p) => f.with_pause(p.paths()),
                    None => f,
                }
            });
            Route {
                prefix: Arc::from(prefix),
                preset,
                unguarded,
                extensions,
                stacks,
                reply: route_reply,
                channel,
                verified: options.verifies() && auto_limit.is_none(),
                auto_limit,
                issuer,
                ack,
                deliver,
                destinations,
                reopen,
                pause: pauses.as_ref().map(|p| p.gate(prefix)),
            }
        });
        // Unguarded requests, all routes together, hold a share too.
        let calls = forward.call_limit();
        let forward = forward.with_route_limit(RouteLimit {
            slots: calls.share(UNGUARDED),
            queue_wait: calls.get_queue_wait(),
            gauge: Gauge::default(),
        });
        let forward = match &pauses {
            Some(p) => forward.with_pause(p.paths()),
            None => forward,
        };
        Ok(Gateway {
            shared: Arc::new(Shared {
                routes,
                forward,
                tasks,
                bodies,
                verified,
            }),
        })
    }
}
