//! The gateway's entrance: the one form of a request's path, and the
//! answers given before any route's stack runs (a bad path, a method a
//! channel route does not take, a preset verified elsewhere).

use super::gateway::{GatewayResponse, RoutedPreset, Target};
use super::RouteOptions;
use bytes::Bytes;
use http::uri::PathAndQuery;
use http::{header, HeaderValue, StatusCode, Uri};
use std::sync::Arc;
use tower_idempotency::__private::{text_response, text_response_owned};
use tower_idempotency::normalize::Reply;
use tower_idempotency::Outcome;
use tower_idempotency::Preset;

/// A built-in preset that some route verifies.
pub(super) struct Verified {
    /// Its name in [`Preset::builtin_names`].
    pub(super) name: &'static str,
    /// The prefixes of the routes that verify it.
    routes: String,
    reply: Reply,
}

/// Every built-in preset that one of `routes` verifies.
pub(super) fn verified_presets<'a>(
    routes: impl Iterator<Item = (&'a str, &'a (Target, RouteOptions))>,
) -> Arc<[Verified]> {
    let mut verified: Vec<Verified> = Vec::new();
    for (prefix, (target, options)) in routes {
        let Target::Preset(preset) = target else {
            continue;
        };
        let Some(name) = Preset::builtin_names()
            .iter()
            .find(|n| **n == preset.name())
        else {
            continue;
        };
        if !options.verifies() {
            continue;
        }
        match verified.iter_mut().find(|v| v.name == *name) {
            Some(v) => {
                v.routes.push_str(", ");
                v.routes.push_str(prefix);
            }
            None => verified.push(Verified {
                name,
                routes: prefix.to_owned(),
                reply: preset.reply().clone(),
            }),
        }
    }
    verified.into()
}

/// `uri` with another path, its query kept.
pub(super) fn with_path(uri: &Uri, path: &str) -> Option<Uri> {
    let pq = match uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path.to_owned(),
    };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(PathAndQuery::from_maybe_shared(Bytes::from(pq)).ok()?);
    Uri::from_parts(parts).ok()
}

/// 400 for a path with no safe normal form, counted for `preset` (`None`:
/// an `auto` route or none), in `reply`'s form (a channel's).
pub(super) fn bad_path(
    preset: Option<&Arc<str>>,
    reply: Option<&Reply>,
    why: &str,
) -> GatewayResponse {
    match preset {
        Some(name) => Outcome::RejectedBadInput.count(name),
        None => Outcome::RejectedBadInput.count(&Arc::from("auto")),
    }
    let msg = Bytes::from(format!("bad request path: {why}\n"));
    let mut res: GatewayResponse = text_response_owned(StatusCode::BAD_REQUEST, msg);
    res.extensions_mut().insert(Outcome::RejectedBadInput);
    if let Some(name) = preset {
        res.extensions_mut().insert(RoutedPreset(name.clone()));
    }
    match reply {
        Some(reply) => reply.apply(res),
        None => res,
    }
}

/// 405 for a channel route (of `preset`): channels only POST.
pub(super) fn method_not_allowed(preset: &Arc<str>) -> GatewayResponse {
    Outcome::RejectedBadInput.count(preset);
    let mut res: GatewayResponse = text_response(
        StatusCode::METHOD_NOT_ALLOWED,
        "this route takes notifications: use POST\n",
    );
    res.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static("POST"));
    res.extensions_mut().insert(Outcome::RejectedBadInput);
    res.extensions_mut().insert(RoutedPreset(preset.clone()));
    res
}

/// 401 in the channel's failure form: a request on the `auto` route `route`
/// that looks like a preset another route verifies.
pub(super) fn refuse_verified_elsewhere(v: &Verified, route: &str, path: &str) -> GatewayResponse {
    Outcome::Unverified.count(&Arc::from(v.name));
    tracing::warn!(
        preset = v.name,
        route,
        path,
        verified_by = %v.routes,
        "a request that looks like a verified channel came to an `auto` route: refused \
         unverified (send it to the route that verifies it)"
    );
    let _ = (route, path);
    let mut res: GatewayResponse = text_response(StatusCode::UNAUTHORIZED, "signature invalid\n");
    res.extensions_mut().insert(Outcome::Unverified);
    let mut res = v.reply.apply(res);
    res.extensions_mut().insert(RoutedPreset(Arc::from(v.name)));
    res
}
