//! [`Gateway`]: routing, `auto` detection and one idempotency stack per
//! route and preset, in front of a [`Forward`].

use super::ack::{Ingest, IngestFn};
use super::detect::detect;
use super::forward::RouteLimit;
use super::options::DEFAULT_MAX_RUN;
use super::panic::catching;
use super::route::{RouteError, RouteTable};
use super::{plain, BoxError, Forward, ProxyBody, RouteOptions};
use crate::channel::PRESET_NAMES;
use crate::key::{is_guarded_method, HeaderPrincipal, Key};
use crate::limit::BodyLimits;
use crate::normalize::Normalize;
use crate::queue::Queue;
use crate::shed::{Gauge, Slots};
use crate::store::Store;
use crate::token::IssueToken;
use crate::verify::Verify;
use crate::{Idempotency, Preset, ResponseBody, TaskTracker};
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tower_layer::Layer;
use tower_service::Service;

/// What a route does with its requests.
// Built once per route at start: the size difference does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum Target {
    /// Guard every request with this preset.
    Preset(Preset),
    /// Detect the preset per request (see [`detect`](super::detect)); a
    /// request that looks like no channel is forwarded unguarded.
    Auto,
}

/// The preset that guarded a request, in the response's extensions (absent
/// for a request no preset guarded).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoutedPreset(pub &'static str);

/// The prefix of the route that took a request, in the response's
/// extensions (absent for an unrouted request).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MatchedRoute(pub Arc<str>);

/// The response of a [`Gateway`].
pub type GatewayResponse = Response<ResponseBody<ProxyBody>>;

/// Under a `client-token` route, the path that issues tokens.
const TOKEN_PATH: &str = "/idempotency-token";

type Stack<S> = Idempotency<Forward, S>;

/// An acknowledge-then-deliver route's pipeline: the same layers in front
/// of the queue as a synchronous route has in front of its dedup layer.
type AckStack = Normalize<Verify<Key<Ingest>>>;

/// One route: its stacks, indexed like [`PRESET_NAMES`].
pub(super) struct Route<S> {
    /// The route's prefix, for [`MatchedRoute`].
    prefix: Arc<str>,
    pub(super) stacks: Vec<Option<Stack<S>>>,
    /// What an `auto` route buffers to detect; `None` for a preset route.
    auto_limit: Option<usize>,
    /// The token issuer of a `client-token` route.
    issuer: Option<IssueToken<S>>,
    /// The queueing pipeline of an acknowledge-then-deliver route (its
    /// stack in `stacks` delivers).
    pub(super) ack: Option<AckStack>,
}

/// A whole idempotency gateway as one tower service: each request goes to
/// the route with the longest matching prefix, and on to the upstream
/// through that route's idempotency stack; unrouted requests, requests
/// with a safe method on `auto` routes and requests `auto` does not
/// recognise are forwarded unguarded, their bodies streamed.
///
/// A `client-token` route also answers `GET` or `POST
/// PREFIX/idempotency-token` with a one-time token, scoped like its keys.
/// The key's scope is the route and the request path, so two paths never
/// share a record. An `auto` route buffers the body up to the largest body
/// limit of its presets (413 past it) to detect the sender.
///
/// On a guarded route the [`Forward`]'s timeout is the reply deadline
/// (unless the route sets its own, [`RouteOptions::reply_timeout`]): past it
/// the caller gets the channel's failure reply while the upstream call goes
/// on in the background until it answers or the route's run limit
/// ([`RouteOptions::max_run`]) ends, and its success is recorded for the
/// next retry. Unguarded requests keep the timeout as a plain one (504).
///
/// Every route's background work runs on one [`TaskTracker`]
/// ([`Gateway::tasks`]); at shutdown, once no request is in flight, close it
/// and wait for it so that no success is lost.
///
/// Clones share everything. Build one with [`Gateway::builder`].
pub struct Gateway<S> {
    pub(super) routes: Arc<RouteTable<Route<S>>>,
    forward: Forward,
    tasks: TaskTracker,
    bodies: Arc<BodyLimits>,
}

impl<S> Clone for Gateway<S> {
    fn clone(&self) -> Self {
        Self {
            routes: self.routes.clone(),
            forward: self.forward.clone(),
            tasks: self.tasks.clone(),
            bodies: self.bodies.clone(),
        }
    }
}

impl<S> fmt::Debug for Gateway<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let routes: Vec<&str> = self.routes.iter().map(|(p, _)| p).collect();
        f.debug_struct("Gateway")
            .field("routes", &routes)
            .field("forward", &self.forward)
            .finish()
    }
}

/// Builds a [`Gateway`]; from [`Gateway::builder`].
#[derive(Debug)]
pub struct GatewayBuilder<S> {
    forward: Forward,
    store: S,
    routes: RouteTable<(Target, RouteOptions)>,
    error: Option<RouteError>,
    tasks: TaskTracker,
    queue: Option<IngestFn>,
    bodies: BodyLimits,
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
            bodies: BodyLimits::new(),
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
    /// `auto` routes buffer (see [`BodyLimits`]): past the deadline 408,
    /// past the budget the retryable failure at once (counted as shed).
    /// Streamed bodies (unrouted requests, safe methods on `auto` routes)
    /// are bounded by the [`Forward`]'s timeout instead. Defaults to
    /// [`BodyLimits::new`]: a deadline of 10 seconds and no budget.
    pub fn body_limits(mut self, limits: BodyLimits) -> Self {
        self.bodies = limits;
        self
    }

    /// The durable queue of the acknowledge-then-deliver routes (see
    /// [`RouteOptions::ack_then_deliver`]); deliver its entries with a
    /// [`Worker`](crate::queue::Worker) over [`Gateway::deliverer`].
    /// Defaults to none: such a route is refused by [`build`](Self::build).
    pub fn queue<Q: Queue>(mut self, queue: Q) -> Self {
        self.queue = Some(IngestFn::new(queue));
        self
    }

    /// The gateway, or the first bad route.
    pub fn build(self) -> Result<Gateway<S>, RouteError> {
        if let Some(e) = self.error {
            return Err(e);
        }
        for (prefix, (target, options)) in self.routes.iter() {
            if !options.is_ack_then_deliver() {
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
        let (forward, store, tasks, queue) = (self.forward, self.store, self.tasks, self.queue);
        let bodies = Arc::new(self.bodies);
        let routes = self.routes.map(|prefix, (target, options)| {
            // The reply deadline answers the caller; the run limit, not the
            // forwarder's timeout, ends the upstream call.
            let max_run = options.get_max_run().unwrap_or(DEFAULT_MAX_RUN);
            let guarded = forward
                .with_timeout(max_run.max(forward.timeout()))
                .with_route_limit(RouteLimit {
                    slots: options
                        .in_flight_slots()
                        .cloned()
                        .unwrap_or_else(Slots::unlimited),
                    queue_wait: options
                        .get_queue_wait()
                        .unwrap_or(forward.call_limit().get_queue_wait()),
                    gauge: Gauge::route(prefix),
                });
            let reply = options.get_reply_timeout().unwrap_or(forward.timeout());
            let stack = |preset: Preset| {
                options
                    .layer(preset, store.clone())
                    .reply_timeout(reply)
                    .task_tracker(tasks.clone())
                    .layer(guarded.clone())
            };
            let mut stacks: Vec<Option<Stack<S>>> = PRESET_NAMES.iter().map(|_| None).collect();
            let mut issuer = None;
            let mut auto_limit = None;
            let mut ack = None;
            match target {
                Target::Preset(preset) => {
                    if preset.consumes_token() {
                        let mut i = IssueToken::new(store.clone());
                        if let Some(name) = options.get_principal_header() {
                            i = i.principal(HeaderPrincipal(name.clone()));
                        }
                        issuer = Some(i);
                    }
                    if let (true, Some(queue)) = (options.is_ack_then_deliver(), &queue) {
                        let ingest = Ingest {
                            queue: queue.clone(),
                        };
                        ack = Some(options.layer(preset.clone(), store.clone()).front(ingest));
                    }
                    // A preset outside the built-in names gets the last slot.
                    let at = PRESET_NAMES.iter().position(|n| *n == preset.name());
                    match at {
                        Some(at) => stacks[at] = Some(stack(preset)),
                        None => stacks.push(Some(stack(preset))),
                    }
                }
                Target::Auto => {
                    let mut limit = 0;
                    for (at, name) in PRESET_NAMES.iter().enumerate() {
                        if let Some(preset) = Preset::from_name(name) {
                            limit = limit.max(options.body_limit(&preset));
                            stacks[at] = Some(stack(preset));
                        }
                    }
                    auto_limit = Some(limit);
                }
            }
            Route {
                prefix: Arc::from(prefix),
                stacks,
                auto_limit,
                issuer,
                ack,
            }
        });
        Ok(Gateway {
            routes: Arc::new(routes),
            forward,
            tasks,
            bodies,
        })
    }
}

impl<S: Store> Gateway<S> {
    /// The tracker every route's background work runs on. At shutdown, stop
    /// accepting, let the requests in flight finish, then `close()` it and
    /// `wait()` for it.
    pub fn tasks(&self) -> &TaskTracker {
        &self.tasks
    }

    /// Every routed prefix and what it does (`auto` or the preset's name),
    /// longest first.
    pub fn routes(&self) -> impl Iterator<Item = (&str, &str)> {
        self.routes.iter().map(|(prefix, route)| {
            let what = match route.auto_limit {
                Some(_) => "auto",
                None => route
                    .stacks
                    .iter()
                    .position(Option::is_some)
                    .and_then(|i| PRESET_NAMES.get(i).copied())
                    .unwrap_or("custom"),
            };
            (prefix, what)
        })
    }

    async fn handle<B>(self, req: Request<B>) -> GatewayResponse
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let found = self.routes.find(req.uri().path());
        let Some((route, is_token_path)) = found.map(|(route, rest)| (route, rest == TOKEN_PATH))
        else {
            return self.pass_through(req).await;
        };
        if let (Some(issuer), true) = (&route.issuer, is_token_path) {
            return issue_token(issuer.clone(), req).await;
        }
        let Some(limit) = route.auto_limit else {
            let at = route.stacks.iter().position(Option::is_some);
            let at = at.expect("a preset route has its stack");
            let req = req.map(|body| self.bodies.wrap(body));
            if let Some(ack) = &route.ack {
                return queued(ack.clone(), route, at, req).await;
            }
            return guarded(route, at, req).await;
        };
        if !is_guarded_method(req.method()) {
            return self.pass_through(req).await;
        }
        let (parts, body) = req.into_parts();
        let body = self.bodies.wrap(body);
        let body = match Limited::new(body, limit).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
                return plain(StatusCode::PAYLOAD_TOO_LARGE, "request body too large\n")
                    .map(ResponseBody::stream)
            }
            Err(e) => return unreadable(&*e),
        };
        let at = detect(&parts.headers, &body)
            .and_then(|name| PRESET_NAMES.iter().position(|n| *n == name))
            .filter(|at| route.stacks[*at].is_some());
        let req = Request::from_parts(parts, Full::new(body));
        match at {
            Some(at) => guarded(route, at, req).await,
            None => self.pass_through(req).await,
        }
    }

    async fn pass_through<B>(mut self, req: Request<B>) -> GatewayResponse
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        match self.forward.call(req).await {
            Ok(res) => res.map(ResponseBody::stream),
            Err(never) => match never {},
        }
    }
}

/// The answer to an `auto` route's body that could not be read: 408 or the
/// shed answer past a body limit, 400 otherwise.
fn unreadable(e: &(dyn std::error::Error + 'static)) -> GatewayResponse {
    match crate::limit::BodyLimitError::find(e) {
        Some(limit) => {
            let res: GatewayResponse = crate::body::body_limit_response(limit);
            if let Some(outcome) = res.extensions().get::<crate::Outcome>() {
                crate::outcome::record(&Arc::from("auto"), *outcome);
            }
            res
        }
        None => plain(StatusCode::BAD_REQUEST, "could not read the request body\n")
            .map(ResponseBody::stream),
    }
}

/// Queues `req` through an acknowledge-then-deliver route's pipeline.
async fn queued<S, B>(
    mut ack: AckStack,
    route: &Route<S>,
    at: usize,
    req: Request<B>,
) -> GatewayResponse
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let name = PRESET_NAMES.get(at).copied().unwrap_or("custom");
    let mut res = catching(name, async move {
        match ack.call(req).await {
            Ok(res) => res,
            Err(never) => match never {},
        }
    })
    .await;
    res.extensions_mut().insert(RoutedPreset(name));
    res.extensions_mut()
        .insert(MatchedRoute(route.prefix.clone()));
    res
}

/// Runs `req` through the route's stack number `at`.
pub(super) async fn guarded<S, B>(route: &Route<S>, at: usize, req: Request<B>) -> GatewayResponse
where
    S: Store,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let mut stack = route.stacks[at].clone().expect("checked by the caller");
    let name = PRESET_NAMES.get(at).copied().unwrap_or("custom");
    let mut res = catching(name, async move {
        let ready =
            std::future::poll_fn(|cx| Service::<Request<B>>::poll_ready(&mut stack, cx)).await;
        match ready.map(|()| stack.call(req)) {
            Ok(fut) => match fut.await {
                Ok(res) => res,
                Err(never) => match never {},
            },
            Err(never) => match never {},
        }
    })
    .await;
    res.extensions_mut().insert(RoutedPreset(name));
    res.extensions_mut()
        .insert(MatchedRoute(route.prefix.clone()));
    res
}

async fn issue_token<S: Store, B>(mut issuer: IssueToken<S>, req: Request<B>) -> GatewayResponse {
    if !matches!(*req.method(), Method::GET | Method::POST) {
        return plain(StatusCode::METHOD_NOT_ALLOWED, "use GET or POST\n")
            .map(ResponseBody::stream);
    }
    let res = match issuer.call(req).await {
        Ok(res) => res,
        Err(never) => match never {},
    };
    res.map(|body| ResponseBody::stream(body.map_err(|never| match never {}).boxed_unsync()))
}

impl<S, B> Service<Request<B>> for Gateway<S>
where
    S: Store,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = GatewayResponse;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<GatewayResponse, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let this = self.clone();
        // A panic anywhere below answers 500 instead of resetting the
        // connection (the preset's own stack counts it under its name).
        Box::pin(async move { Ok(catching("gateway", this.handle(req)).await) })
    }
}
