//! [`Gateway`]: routing, `auto` detection and one idempotency stack per
//! route and preset, in front of a [`Forward`].

use super::detect::detect;
use super::route::{RouteError, RouteTable};
use super::{plain, BoxError, Forward, ProxyBody, RouteOptions};
use crate::channel::PRESET_NAMES;
use crate::key::{is_guarded_method, HeaderPrincipal};
use crate::store::Store;
use crate::token::IssueToken;
use crate::{Idempotency, Preset, ResponseBody};
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

/// The response of a [`Gateway`].
pub type GatewayResponse = Response<ResponseBody<ProxyBody>>;

/// Under a `client-token` route, the path that issues tokens.
const TOKEN_PATH: &str = "/idempotency-token";

type Stack<S> = Idempotency<Forward, S>;

/// One route: its stacks, indexed like [`PRESET_NAMES`].
struct Route<S> {
    stacks: Vec<Option<Stack<S>>>,
    /// What an `auto` route buffers to detect; `None` for a preset route.
    auto_limit: Option<usize>,
    /// The token issuer of a `client-token` route.
    issuer: Option<IssueToken<S>>,
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
/// Clones share everything. Build one with [`Gateway::builder`].
pub struct Gateway<S> {
    routes: Arc<RouteTable<Route<S>>>,
    forward: Forward,
}

impl<S> Clone for Gateway<S> {
    fn clone(&self) -> Self {
        Self {
            routes: self.routes.clone(),
            forward: self.forward.clone(),
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

    /// The gateway, or the first bad route.
    pub fn build(self) -> Result<Gateway<S>, RouteError> {
        if let Some(e) = self.error {
            return Err(e);
        }
        let (forward, store) = (self.forward, self.store);
        let routes = self.routes.map(|_, (target, options)| {
            let stack =
                |preset: Preset| options.layer(preset, store.clone()).layer(forward.clone());
            let mut stacks: Vec<Option<Stack<S>>> = PRESET_NAMES.iter().map(|_| None).collect();
            let mut issuer = None;
            let mut auto_limit = None;
            match target {
                Target::Preset(preset) => {
                    if preset.consumes_token() {
                        let mut i = IssueToken::new(store.clone());
                        if let Some(name) = options.get_principal_header() {
                            i = i.principal(HeaderPrincipal(name.clone()));
                        }
                        issuer = Some(i);
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
                stacks,
                auto_limit,
                issuer,
            }
        });
        Ok(Gateway {
            routes: Arc::new(routes),
            forward,
        })
    }
}

impl<S: Store> Gateway<S> {
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
        let path = req.uri().path().to_owned();
        let Some((route, rest)) = self.routes.find(&path) else {
            return self.pass_through(req).await;
        };
        if let Some(issuer) = &route.issuer {
            if rest == TOKEN_PATH {
                return issue_token(issuer.clone(), req).await;
            }
        }
        let Some(limit) = route.auto_limit else {
            let at = route.stacks.iter().position(Option::is_some);
            return guarded(route, at.expect("a preset route has its stack"), req).await;
        };
        if !is_guarded_method(req.method()) {
            return self.pass_through(req).await;
        }
        let (parts, body) = req.into_parts();
        let body = match Limited::new(body, limit).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
                return plain(StatusCode::PAYLOAD_TOO_LARGE, "request body too large\n")
                    .map(ResponseBody::stream)
            }
            Err(_) => {
                return plain(StatusCode::BAD_REQUEST, "could not read the request body\n")
                    .map(ResponseBody::stream)
            }
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

/// Runs `req` through the route's stack number `at`.
async fn guarded<S, B>(route: &Route<S>, at: usize, req: Request<B>) -> GatewayResponse
where
    S: Store,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let mut stack = route.stacks[at].clone().expect("checked by the caller");
    let name = PRESET_NAMES.get(at).copied().unwrap_or("custom");
    let ready = std::future::poll_fn(|cx| Service::<Request<B>>::poll_ready(&mut stack, cx)).await;
    let mut res = match ready.map(|()| stack.call(req)) {
        Ok(fut) => match fut.await {
            Ok(res) => res,
            Err(never) => match never {},
        },
        Err(never) => match never {},
    };
    res.extensions_mut().insert(RoutedPreset(name));
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
        Box::pin(async move { Ok(this.handle(req).await) })
    }
}
