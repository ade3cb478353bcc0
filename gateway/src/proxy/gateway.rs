//! [`Gateway`]: routing, `auto` detection and one idempotency stack per
//! route and preset, in front of a [`Forward`].

use super::detect::{detect, looks_like};
use super::entrance::{
    bad_path, method_not_allowed, refuse_verified_elsewhere, with_path, Verified,
};
use super::ingest::Ingest;
use super::panic::catching;
use super::route::RouteTable;
use super::{plain, Forward, ProxyBody};
use crate::proxy::path::{self, Unsafe};
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use std::borrow::Cow;
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tower::BoxError;
use tower_idempotency::__private::is_guarded_method;
use tower_idempotency::key::Key;
use tower_idempotency::limit::BodyLimitsLayer;
use tower_idempotency::normalize::{Normalize, Reply};
use tower_idempotency::store::Store;
use tower_idempotency::token::IssueToken;
use tower_idempotency::verify::Verify;
use tower_idempotency::{Idempotency, Preset, ResponseBody, TaskTracker};
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

/// The name of the preset that guarded a request, or whose route refused it
/// (a method other than POST on a channel route, a bad path), in the
/// response's extensions (absent for a request no preset guarded): a
/// built-in preset's name or a configured one's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutedPreset(pub Arc<str>);

/// The prefix of the route that took a request, in the response's
/// extensions (absent for an unrouted request, and for every request when
/// the gateway is built without them, see
/// [`GatewayBuilder::response_extensions`](super::GatewayBuilder::response_extensions)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MatchedRoute(pub Arc<str>);

/// The response of a [`Gateway`].
pub type GatewayResponse = Response<ResponseBody<ProxyBody>>;

/// Under a `client-token` route, the path that issues tokens.
const TOKEN_PATH: &str = "/idempotency-token";

pub(super) type Stack<S> = Idempotency<super::order::ToUpstream<S>, S>;

/// An acknowledge-then-deliver route's pipeline: the same layers in front
/// of the queue as a synchronous route has in front of its dedup layer.
pub(super) type AckStack = Normalize<Verify<Key<Ingest>>>;

/// One preset's stack on a route.
pub(super) struct Guard<S> {
    /// The preset's name (metrics, [`RoutedPreset`]).
    pub(super) name: Arc<str>,
    pub(super) stack: Stack<S>,
}

/// One route of the table: its preset (or `auto`), its stacks and what its
/// entrance checks. New per-route state is a new named field here.
pub(super) struct Route<S> {
    /// The route's prefix, for [`MatchedRoute`].
    pub(super) prefix: Arc<str>,
    /// The preset's name, or `auto`.
    pub(super) preset: Arc<str>,
    /// Where the route forwards unguarded requests when it has an upstream
    /// of its own (else the gateway's).
    pub(super) unguarded: Option<Forward>,
    /// Whether its responses carry a [`MatchedRoute`] (see
    /// [`GatewayBuilder::response_extensions`](super::GatewayBuilder::response_extensions)).
    pub(super) extensions: bool,
    /// The route's stack (a preset route), or one per built-in preset
    /// (`auto`, in [`Preset::builtin_names`]' order).
    pub(super) stacks: Vec<Guard<S>>,
    /// The reply format of a route's preset (`None` for `auto`).
    pub(super) reply: Option<Reply>,
    /// Whether the route's preset is a channel's (POST only).
    pub(super) channel: bool,
    /// Whether the route verifies its sender (its paths must be ASCII).
    pub(super) verified: bool,
    /// What an `auto` route buffers to detect; `None` for a preset route.
    pub(super) auto_limit: Option<usize>,
    /// The token issuer of a `client-token` route.
    pub(super) issuer: Option<IssueToken<S>>,
    /// The queueing pipeline of an acknowledge-then-deliver route (its
    /// stack in `stacks` delivers).
    pub(super) ack: Option<AckStack>,
    /// The stack that delivers queued notifications when it differs from
    /// the one in `stacks`: the same without verification (a notification
    /// is verified once, when it is queued).
    pub(super) deliver: Option<Stack<S>>,
    /// The stacks that deliver to each destination of an
    /// acknowledge-then-deliver route with several (by name): its
    /// notifications' entries name theirs; and its own pause.
    pub(super) destinations: Vec<(Arc<str>, Stack<S>, Option<super::pause::PauseGate>)>,
    /// What a queued delivery reads again before the order places it (the
    /// decrypted WeChat Pay v3 resource), on a route that verifies and has
    /// an order: the signature is not checked again.
    pub(super) reopen: Option<tower_idempotency::verify::VerifyLayer>,
    /// The route's pause, asked before a queued delivery runs.
    pub(super) pause: Option<super::pause::PauseGate>,
}

/// A whole idempotency gateway as one tower service: each request goes to
/// the route with the longest matching prefix, and on to the upstream
/// through that route's idempotency stack; unrouted requests, requests
/// with a safe method on `auto` routes and requests `auto` does not
/// recognise are forwarded unguarded, their bodies streamed.
///
/// **One path.** The request path is normalised once, at the entrance:
/// escapes of unreserved characters decoded (`%73` is `s`), dot segments
/// resolved, repeated and trailing slashes dropped. That one form is routed
/// (prefixes match regardless of ASCII case, see [`RouteTable`]), verified,
/// scoped and forwarded: the upstream gets `/notify/stripe` for
/// `//notify/./%73tripe/`. A path with no safe normal form (a `;` in a
/// segment, `%2F`, `\`, `%5C`, an escaped control character such as `%00`,
/// escapes that are not UTF-8, a `%` that is not an escape) is answered 400 if
/// it, or the way a lenient server reads it (path parameters dropped, `%2F`
/// taken as `/`), falls on a guarded route; otherwise it is forwarded as
/// written, escapes upper-cased.
///
/// **Every spelling of a prefix.** Prefixes are matched with every escape
/// decoded, as an upstream that decodes the path before routing (Spring,
/// Django, Go, ASP.NET, Rails) reads it: `/hooks/pay%3Astripe` is on the
/// `/hooks/pay:stripe` route. A path that a lenient server could read as
/// another guarded route gets 400: escapes decoded twice, cut at `%00`,
/// segments trimmed of white space, control characters and trailing dots,
/// letters folded as Java and .NET fold them (`ſ` is `s`), the suffix of the
/// last segment dropped as Spring's suffix matching does
/// (`/notify/stripe.json`). On a route that verifies its sender, a path with
/// a character that is not ASCII (written or escaped) gets 400.
///
/// **Channel routes take POST only**: any other method gets 405 with
/// `Allow: POST` and is never forwarded. A route's principal (see
/// [`RouteOptions::principal_header`](super::RouteOptions::principal_header)) scopes client-API presets only.
///
/// **A verified preset is never accepted unverified**: when a route verifies
/// a preset (see [`RouteOptions::verify`](super::RouteOptions::verify)), a request on an `auto` route that
/// looks like that preset (by [`detect`]'s table, whatever else it looks
/// like) gets 401 in the channel's failure form, counted as `unverified` and
/// logged with the route that verifies it.
///
/// The route part of every stored key is the matched route's prefix, never
/// the client's spelling of the path: every spelling of a route shares its
/// records. A `client-token` route also answers `GET` or `POST
/// PREFIX/idempotency-token` with a one-time token, scoped like its keys. An
/// `auto` route buffers the body up to the largest body limit of its presets
/// (413 past it) to detect the sender.
///
/// On a guarded route the [`Forward`]'s timeout is the reply deadline
/// (unless the route sets its own, [`RouteOptions::reply_timeout`](super::RouteOptions::reply_timeout)): past it
/// the caller gets the channel's failure reply while the upstream call goes
/// on in the background until it answers or the route's run limit
/// ([`RouteOptions::max_run`](super::RouteOptions::max_run)) ends, and its success is recorded for the
/// next retry. Unguarded requests keep the timeout as a plain one (504).
///
/// Every route's background work runs on one [`TaskTracker`]
/// ([`Gateway::tasks`]); at shutdown, once no request is in flight, close it
/// and wait for it so that no success is lost.
///
/// Clones share everything. Build one with [`Gateway::builder`].
pub struct Gateway<S> {
    /// One reference count per request, not one per part.
    pub(super) shared: Arc<Shared<S>>,
}

/// What every clone of a [`Gateway`] shares.
pub(super) struct Shared<S> {
    pub(super) routes: RouteTable<Route<S>>,
    pub(super) forward: Forward,
    pub(super) tasks: TaskTracker,
    pub(super) bodies: BodyLimitsLayer,
    pub(super) verified: Arc<[Verified]>,
}

impl<S> Shared<S> {
    /// Whether clients' `traceparent` are followed.
    fn accepts_traceparent(&self) -> bool {
        self.forward.accepts_traceparent()
    }
}

impl<S> Clone for Gateway<S> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<S> fmt::Debug for Gateway<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let routes: Vec<&str> = self.shared.routes.iter().map(|(p, _)| p).collect();
        f.debug_struct("Gateway")
            .field("routes", &routes)
            .field("forward", &self.shared.forward)
            .finish()
    }
}

impl<S: Store> Gateway<S> {
    /// The tracker every route's background work runs on. At shutdown, stop
    /// accepting, let the requests in flight finish, then `close()` it and
    /// `wait()` for it.
    pub fn tasks(&self) -> &TaskTracker {
        &self.shared.tasks
    }

    /// Every routed prefix and what it does (`auto` or the preset's name),
    /// longest first.
    pub fn routes(&self) -> impl Iterator<Item = (&str, &str)> {
        self.shared
            .routes
            .iter()
            .map(|(prefix, route)| (prefix, route.preset_name()))
    }

    async fn handle<B>(self, mut req: Request<B>) -> GatewayResponse
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let normal = match path::strict(req.uri().path()) {
            Ok(Cow::Borrowed(_)) => None,
            Ok(Cow::Owned(normal)) => Some(normal),
            Err(why) => return self.unsafe_path(req, why).await,
        };
        if let Some(normal) = normal {
            match with_path(req.uri(), &normal) {
                Some(uri) => *req.uri_mut() = uri,
                None => return bad_path(None, None, "the path cannot be normalised"),
            }
        }
        let found = self.shared.routes.find_entry(req.uri().path());
        let found = found.map(|(prefix, route, rest)| (prefix, route, rest == TOKEN_PATH));
        if path::has_other_readings(req.uri().path()) {
            let on = found.map(|(prefix, route, _)| (prefix, route));
            if let Some(refused) = self.read_otherwise(&req, on) {
                return refused;
            }
        }
        let Some((prefix, route, is_token_path)) = found else {
            return self.pass_through(req).await;
        };
        if route.channel && req.method() != Method::POST {
            return method_not_allowed(&route.preset);
        }
        if let (Some(issuer), true) = (&route.issuer, is_token_path) {
            return issue_token(issuer.clone(), req).await;
        }
        let Some(limit) = route.auto_limit else {
            let req = req.map(|body| self.shared.bodies.wrap(body));
            if let Some(ack) = &route.ack {
                return queued(ack.clone(), route, req).await;
            }
            return guarded(route, 0, req).await;
        };
        if !is_guarded_method(req.method()) {
            return self.pass_through_on(route, req).await;
        }
        let (parts, body) = req.into_parts();
        let body = self.shared.bodies.wrap(body);
        let body = match Limited::new(body, limit).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
                return plain(StatusCode::PAYLOAD_TOO_LARGE, "request body too large\n")
                    .map(ResponseBody::stream)
            }
            Err(e) => return unreadable(&*e),
        };
        let elsewhere = self
            .shared
            .verified
            .iter()
            .find(|v| looks_like(v.name, &parts.headers, &body));
        if let Some(v) = elsewhere {
            return refuse_verified_elsewhere(v, prefix, parts.uri.path());
        }
        let at = detect(&parts.headers, &body)
            .and_then(|name| route.stacks.iter().position(|g| &*g.name == name));
        let req = Request::from_parts(parts, Full::new(body));
        match at {
            Some(at) => guarded(route, at, req).await,
            None => self.pass_through_on(route, req).await,
        }
    }

    /// A path without a safe normal form: 400 where any reading of it is
    /// guarded, otherwise forwarded in its lenient normal form.
    async fn unsafe_path<B>(self, mut req: Request<B>, why: Unsafe) -> GatewayResponse
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let written = path::normalize(req.uri().path()).into_owned();
        // The lenient readings first: they find the route a lenient
        // upstream would serve (`/notify/stripe` for `/notify/stripe;x`).
        let mut readings = path::variants(path::lenient(req.uri().path()));
        readings.push(written.clone());
        for reading in readings {
            let Some((prefix, route, _)) = self.shared.routes.find_entry(&reading) else {
                continue;
            };
            if route.guards(req.method()) {
                return refuse_path(prefix, route, req.uri().path(), why);
            }
        }
        match with_path(req.uri(), &written) {
            Some(uri) => *req.uri_mut() = uri,
            None => return bad_path(None, None, "the path cannot be normalised"),
        }
        self.pass_through(req).await
    }

    /// For a path that has a safe normal form, on route `on` (if any): 400
    /// when a lenient server could read it as another guarded route
    /// (`/notify/stripe.json`, `/notify/ſtripe`, `/notify/stripe%00` for
    /// `/notify/stripe`), or when `on` verifies its sender and the path has a
    /// character that is not ASCII (written or escaped).
    fn read_otherwise<B>(
        &self,
        req: &Request<B>,
        on: Option<(&str, &Route<S>)>,
    ) -> Option<GatewayResponse> {
        let path = req.uri().path();
        if let Some((prefix, route)) = on.filter(|(_, route)| route.verified)
            && !path::decoded(path).is_ascii()
        {
            return Some(refuse_path(prefix, route, path, Unsafe::NotAscii));
        }
        for reading in path::variants(path::lenient(path)) {
            let Some((prefix, route, _)) = self.shared.routes.find_entry(&reading) else {
                continue;
            };
            let same = on.is_some_and(|(on, _)| on == prefix);
            if !same && route.guards(req.method()) {
                return Some(refuse_path(prefix, route, path, Unsafe::Ambiguous));
            }
        }
        None
    }

    /// Forwards `req` unguarded to `route`'s upstream.
    async fn pass_through_on<B>(&self, route: &Route<S>, req: Request<B>) -> GatewayResponse
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let forward = route.unguarded.as_ref().unwrap_or(&self.shared.forward);
        match forward.clone().call(req).await {
            Ok(res) => res.map(ResponseBody::stream),
            Err(never) => match never {},
        }
    }

    async fn pass_through<B>(self, req: Request<B>) -> GatewayResponse
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        match self.shared.forward.clone().call(req).await {
            Ok(res) => res.map(ResponseBody::stream),
            Err(never) => match never {},
        }
    }
}

/// 400 for `path`, which falls (in some reading) on the guarded route
/// `prefix`, in that route's form; logged with `why`.
fn refuse_path<S>(prefix: &str, route: &Route<S>, path: &str, why: Unsafe) -> GatewayResponse {
    tracing::warn!(route = prefix, path, reason = %why, "request path refused");
    let _ = (prefix, path);
    let preset = route.auto_limit.is_none().then_some(&route.preset);
    let reply = route.reply.as_ref().filter(|_| route.channel);
    bad_path(preset, reply, &why.to_string())
}

/// The answer to an `auto` route's body that could not be read: 408 or the
/// shed answer past a body limit, 400 otherwise.
fn unreadable(e: &(dyn std::error::Error + 'static)) -> GatewayResponse {
    match tower_idempotency::limit::BodyLimitError::find(e) {
        Some(limit) => {
            let res: GatewayResponse = limit.response();
            if let Some(outcome) = res.extensions().get::<tower_idempotency::Outcome>() {
                outcome.count(&Arc::from("auto"));
            }
            res
        }
        None => plain(StatusCode::BAD_REQUEST, "could not read the request body\n")
            .map(ResponseBody::stream),
    }
}

impl<S> Route<S> {
    /// Whether a request with `method` goes through one of this route's
    /// stacks: every method on a channel route (it answers 405 to all but
    /// POST), the unsafe ones elsewhere.
    fn guards(&self, method: &Method) -> bool {
        self.channel || is_guarded_method(method)
    }

    /// The preset's name of a preset route (`auto` for an `auto` route).
    fn preset_name(&self) -> &str {
        &self.preset
    }
}

/// Queues `req` through an acknowledge-then-deliver route's pipeline.
async fn queued<S, B>(mut ack: AckStack, route: &Route<S>, req: Request<B>) -> GatewayResponse
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let name = route.preset.clone();
    let mut res = catching(
        &*name,
        Box::pin(async move {
            match ack.call(req).await {
                Ok(res) => res,
                Err(never) => match never {},
            }
        }),
    )
    .await;
    res.extensions_mut().insert(RoutedPreset(name));
    if route.extensions {
        res.extensions_mut()
            .insert(MatchedRoute(route.prefix.clone()));
    }
    res
}

/// Runs `req` through the route's stack number `at`.
pub(super) async fn guarded<S, B>(route: &Route<S>, at: usize, req: Request<B>) -> GatewayResponse
where
    S: Store,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let guard = &route.stacks[at];
    let name = guard.name.clone();
    // Boxed: the stack's future is large, and every future around it
    // (the panic boundaries, the gateway's own) would copy it as it is
    // built and moved (memcpy was a quarter of a first delivery's
    // instructions, callgrind). The stack's clone is a temporary of this
    // statement: a local moved into the box would keep its room (1.9 KB)
    // in this future across the await all the same.
    let fut = Box::pin(run_stack(guard.stack.clone(), req));
    let mut res = catching(&*name, fut).await;
    res.extensions_mut().insert(RoutedPreset(name));
    if route.extensions {
        res.extensions_mut()
            .insert(MatchedRoute(route.prefix.clone()));
    }
    res
}

/// Runs `req` through `stack`.
///
/// A [`Oneshot`](tower::util::Oneshot): the stack and the request, then in
/// the same room the stack's future (an `async fn` would keep the stack
/// beside its future until the answer).
pub(super) fn run_stack<S, B>(
    stack: Stack<S>,
    req: Request<B>,
) -> impl Future<Output = GatewayResponse>
where
    S: Store,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    use futures_util::FutureExt;
    tower::ServiceExt::oneshot(stack, req).map(|answer| match answer {
        Ok(res) => res,
        Err(never) => match never {},
    })
}

/// The gateway's request under its panic boundary (a plain function: an
/// `async fn` would hold the request's future twice, see `catching`).
fn catch_gateway<S, B>(
    gateway: Gateway<S>,
    req: Request<B>,
) -> impl Future<Output = Result<GatewayResponse, Infallible>>
where
    S: Store,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    use futures_util::FutureExt;
    catching("gateway", gateway.handle(req)).map(Ok)
}

/// The future `make` builds, in the client's trace: under its context
/// unless a span with a context is current when it starts (a server's
/// request span, which then takes the client's context itself). Given the
/// maker, not the future, so that the future is held once.
async fn in_client_trace<F: Future>(
    client: opentelemetry::Context,
    make: impl FnOnce() -> F,
) -> F::Output {
    use opentelemetry::context::FutureExt;
    if super::trace::in_span() {
        make().await
    } else {
        make().with_context(client).await
    }
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
        if this.shared.accepts_traceparent()
            && let Some(client) = super::trace::client_context(req.headers())
        {
            return Box::pin(in_client_trace(client, move || catch_gateway(this, req)));
        }
        // A panic anywhere below answers 500 instead of resetting the
        // connection (the preset's own stack counts it under its name).
        Box::pin(catch_gateway(this, req))
    }
}
