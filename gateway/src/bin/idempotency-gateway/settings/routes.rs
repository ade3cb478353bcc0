//! The config file's `[[route]]` tables: each one's own values over the
//! global ones, its mode, limits, pace and `verify` table.

use crate::settings::parse;
use crate::settings::spanned::{At, Field, SizeValue};
use crate::start::ack;
use http::HeaderName;
use idempotency_gateway::config::VerifyConfig;
use idempotency_gateway::proxy::{RouteOptions, Target};
use serde::Deserialize;
use std::path::Path;
use std::time::Duration;
use toml::Spanned;
use tower_idempotency::key::CookiePrincipal;
use tower_idempotency::order::Order;
use tower_idempotency::OnStoreError;
use tower_idempotency_queue::Pace;

/// One `[[route]]` table. New per-route settings are new fields here.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileRoute {
    prefix: Spanned<String>,
    preset: Spanned<String>,
    pub(crate) window: Field,
    pub(crate) lease: Field,
    pub(crate) wait: Field,
    pub(crate) max_run: Field,
    pub(crate) max_body: Option<Spanned<SizeValue>>,
    pub(crate) principal_header: Field,
    pub(crate) principal_cookie: Field,
    mode: Field,
    verify: Option<Spanned<VerifyConfig>>,
    /// The URL the sender calls, as it signs it (`{url}` of a configured
    /// preset's signature).
    public_url: Field,
    /// A named upstream (`[[upstreams]]`).
    upstream: Field,
    /// The memory store's budget of this route's records.
    max_memory: Option<Spanned<SizeValue>>,
    max_in_flight: Option<Spanned<SizeValue>>,
    /// Tunes `max_in_flight = "auto"`.
    auto_limit: Option<Spanned<crate::settings::limit::AutoLimit>>,
    queue_wait: Field,
    /// How an ack-then-deliver route paces its deliveries (`pace.rs`).
    deliver_concurrency: Option<Spanned<toml::Value>>,
    deliver_rate: Option<Spanned<toml::Value>>,
    retry_schedule: Option<Spanned<toml::Value>>,
    breaker_failures: Option<Spanned<toml::Value>>,
    breaker_cooldown: Option<Spanned<toml::Value>>,
    /// The named upstreams an ack-then-deliver route delivers to, each on
    /// its own (`deliver.rs`).
    deliver: Option<Spanned<Vec<Spanned<crate::settings::deliver::FileDestination>>>>,
    /// The order of the objects its events are about (`orders.rs`).
    order: Field,
}

/// One route as the gateway runs it: everything about it in one place.
#[derive(Debug)]
pub(crate) struct RouteSettings {
    pub(crate) prefix: String,
    pub(crate) target: Target,
    /// The route's options, the global values applied.
    pub(crate) options: RouteOptions,
    /// How its queued deliveries are paced (its own keys; none: the
    /// defaults, for a route of the flags).
    pub(crate) pace: Option<Pace>,
    /// The memory store's budget of its records (a memory store only).
    pub(crate) budget: Option<crate::start::store::RouteBudget>,
    /// The `[[upstreams]]` table it forwards to, by name.
    pub(crate) upstream: Option<String>,
    /// The named upstreams it delivers each notification to (`deliver`),
    /// each on its own; none: its one upstream.
    pub(crate) destinations: Vec<crate::settings::deliver::RouteDestination>,
}

impl RouteSettings {
    /// A route of the flags (or the default `/=auto`): the global values.
    pub(crate) fn new(prefix: String, target: Target, options: RouteOptions) -> Self {
        Self {
            prefix,
            target,
            options,
            pace: None,
            budget: None,
            upstream: None,
            destinations: Vec::new(),
        }
    }
}

/// What the file's routes give the settings.
pub(crate) struct FileRoutes {
    /// Each route, in the file's order.
    pub(crate) routes: Vec<RouteSettings>,
    /// The routes with a memory budget of their own.
    pub(crate) own_memory: Vec<(String, usize)>,
    /// Warnings to log at start (and print with `--check-config`).
    pub(crate) warnings: Vec<String>,
}

/// Reads the file's `routes` over the `global` values (`base`: the
/// directory `verify` files are relative to; `upstreams` and `orders`:
/// the file's named upstreams and orders, which a route may name).
pub(crate) fn from_file(
    file_routes: &[Spanned<FileRoute>],
    global: &Global,
    at: &At<'_>,
    base: &Path,
    presets: &crate::settings::presets::Presets,
    upstreams: &[crate::settings::upstreams::Named],
    orders: &crate::settings::orders::Orders,
) -> Result<FileRoutes, String> {
    let (mut routes, mut own_memory) = (Vec::new(), Vec::new());
    let mut warnings = Vec::new();
    let mut seen = idempotency_gateway::proxy::RouteTable::new();
    for r in file_routes {
        let r = r.get_ref();
        let prefix = parse::prefix(r.prefix.get_ref()).map_err(|e| at.err(r.prefix.span(), e))?;
        let configured = presets.get(r.preset.get_ref().as_str());
        let target = match configured {
            Some(c) => Target::Preset(c.preset.clone()),
            None => parse::target(r.preset.get_ref()).map_err(|e| {
                let e = if presets.is_empty() {
                    e
                } else {
                    let names: Vec<&str> = presets.keys().map(String::as_str).collect();
                    format!("{e}, or a [[preset]] of this file ({})", names.join(", "))
                };
                at.err(r.preset.span(), e)
            })?,
        };
        let mut own = Global {
            window: at.value(&r.window, "window", parse::positive_duration)?,
            lease: at.value(&r.lease, "lease", parse::lease)?,
            wait: at.value(&r.wait, "wait", parse::duration)?,
            max_run: at.value(&r.max_run, "max_run", parse::positive_duration)?,
            max_body: at.value(&r.max_body, "max_body", parse::body_size)?,
            principal_header: at.value(
                &r.principal_header,
                "principal_header",
                parse::header_name,
            )?,
            principal_cookie: at.value(
                &r.principal_cookie,
                "principal_cookie",
                parse::cookie_name,
            )?,
            on_store_error: global.on_store_error,
        };
        // Precedence: the route's value, then the preset's, then the global one.
        if let Some(c) = configured {
            own = own.over(&c.own);
        }
        seen.insert(&prefix, ())
            .map_err(|e| at.err(r.prefix.span(), e))?;
        if let Some(n) = at.value(&r.max_memory, "max_memory", parse::body_size)? {
            own_memory.push((prefix.clone(), n));
        }
        let acked = match &r.mode {
            None => false,
            Some(m) => ack::mode(m.get_ref(), &target).map_err(|e| at.err(m.span(), e))?,
        };
        let mut options = global.options(&own).ack_then_deliver(acked);
        let in_flight = at.checked(
            &r.max_in_flight,
            "max_in_flight",
            crate::settings::limit::max_in_flight,
        )?;
        let auto = r.auto_limit.as_ref();
        options = crate::settings::limit::apply(options, in_flight, auto.map(|a| a.get_ref()))
            .map_err(|e| at.err(auto.map_or(r.prefix.span(), |a| a.span()), e))?;
        if let Some(wait) = at.value(&r.queue_wait, "queue_wait", parse::duration)? {
            options = options.queue_wait(wait);
        }
        if let Some(name) = &r.order {
            if matches!(target, Target::Auto) {
                return Err(at.err(
                    name.span(),
                    "`order` needs the route's preset, not `auto`: give each channel a route",
                ));
            }
            let order = crate::settings::orders::named(name, orders, at)?;
            match &target {
                Target::Preset(p)
                    if Order::is_builtin_name(order.name()) && order.name() != p.name() =>
                {
                    warnings.push(format!(
                        "route `{prefix}`: order `{}` is another channel's: `{}` notifications \
                         are unplaced by it, and forwarded as if there were no order",
                        order.name(),
                        p.name()
                    ));
                }
                _ => {}
            }
            // It reads the resource the verify layer decrypts (again at a
            // queued delivery).
            if order.name() == "wechatpay-v3" && r.verify.is_none() {
                warnings.push(format!(
                    "route `{prefix}`: order `wechatpay-v3` reads the resource the route's \
                     `verify` decrypts, and the route has no `verify` table: its \
                     notifications are unplaced, and forwarded as if there were no order"
                ));
            }
            options = options.order(order);
        }
        let keys = crate::settings::pace::Keys {
            deliver_concurrency: &r.deliver_concurrency,
            deliver_rate: &r.deliver_rate,
            retry_schedule: &r.retry_schedule,
            breaker_failures: &r.breaker_failures,
            breaker_cooldown: &r.breaker_cooldown,
        };
        let pace = crate::settings::pace::route(at, &keys)?;
        let destinations = match &r.deliver {
            Some(deliver) => {
                let route = crate::settings::deliver::RouteKeys {
                    prefix: &prefix,
                    acked,
                    upstream: r.upstream.as_ref(),
                    pace: keys,
                };
                crate::settings::deliver::from_file(deliver, &route, at, |name| {
                    named(&prefix, name, upstreams, at)
                })?
            }
            None => Vec::new(),
        };
        match (configured, &r.verify) {
            (Some(c), verify) => {
                let name = c.preset.name();
                match (&c.signature, verify) {
                    (Some(scheme), Some(v)) => {
                        let mut scheme = scheme.clone();
                        if let Some(url) = &r.public_url {
                            // `{url}`: the public URL of the prefix, then the
                            // request's own path under it and its query.
                            scheme = scheme.url(url.get_ref().clone(), prefix.clone());
                        }
                        let layer = v
                            .get_ref()
                            .hmac_layer(name, scheme, base)
                            .map_err(|e| at.err(v.span(), format!("`verify`: {e}")))?;
                        options = options.verify(layer);
                        if let Some(w) = &c.unsigned_key {
                            warnings.push(format!("route `{prefix}`: {w}"));
                        }
                    }
                    (Some(_), None) => {
                        return Err(at.err(
                            r.prefix.span(),
                            format!(
                                "route `{prefix}`: preset `{name}` has a `signature`, but the route has no `verify.secrets`: nothing could check it; give the route `verify = {{ secrets = [...] }}`"
                            ),
                        ))
                    }
                    (None, Some(v)) => {
                        return Err(at.err(
                            v.span(),
                            format!(
                                "`verify`: preset `{name}` has no `signature` to verify with; describe it in the [[preset]] table"
                            ),
                        ))
                    }
                    (None, None) => {}
                }
            }
            (None, Some(v)) => {
                let layer = crate::settings::verify::layer(v.get_ref(), &target, base)
                    .map_err(|e| at.err(v.span(), e))?;
                options = options.verify(layer);
            }
            (None, None) => {}
        }
        if let (Some(url), None) = (&r.public_url, configured) {
            return Err(at.err(
                url.span(),
                "`public_url` is read by a configured preset's `{url}` signature only",
            ));
        }
        let upstream = match &r.upstream {
            Some(u) => Some(named(&prefix, u, upstreams, at)?),
            None => None,
        };
        routes.push(RouteSettings {
            pace: Some(pace),
            upstream,
            destinations,
            ..RouteSettings::new(prefix, target, options)
        });
    }
    Ok(FileRoutes {
        routes,
        own_memory,
        warnings,
    })
}

/// A route's `upstream`: the name of one of the file's `[[upstreams]]`.
fn named(
    prefix: &str,
    name: &Spanned<String>,
    upstreams: &[crate::settings::upstreams::Named],
    at: &At<'_>,
) -> Result<String, String> {
    let known: Vec<&str> = upstreams.iter().map(|u| u.name.as_str()).collect();
    if !known.contains(&name.get_ref().as_str()) {
        return Err(at.err(
            name.span(),
            format!(
                "route `{prefix}`: unknown upstream `{}`; the file's [[upstreams]] are: {}",
                name.get_ref(),
                if known.is_empty() {
                    "none".to_owned()
                } else {
                    known.join(", ")
                }
            ),
        ));
    }
    Ok(name.get_ref().clone())
}

/// `--route` flags replace the file's routes: refused when one of those
/// verifies its sender (it would be served unverified), else a warning
/// naming them.
pub(crate) fn dropped(
    file_routes: &[Spanned<FileRoute>],
    at: &At<'_>,
) -> Result<Option<String>, String> {
    if let Some(r) = file_routes.iter().find(|r| r.get_ref().verify.is_some()) {
        let prefix = r.get_ref().prefix.get_ref();
        return Err(at.err(
            r.span(),
            format!(
                "`--route` replaces the config file's routes, and route `{prefix}` has a \
                 `verify` table: it would run unverified; put the routes in one place"
            ),
        ));
    }
    let dropped: Vec<&str> = file_routes
        .iter()
        .map(|r| r.get_ref().prefix.get_ref().as_str())
        .collect();
    Ok((!dropped.is_empty()).then(|| {
        format!(
            "`--route` replaces the config file's routes; dropped: {}",
            dropped.join(" ")
        )
    }))
}

/// Route settings at one level (global, or one route's own).
pub(crate) struct Global {
    pub(crate) window: Option<Duration>,
    pub(crate) lease: Option<Duration>,
    pub(crate) wait: Option<Duration>,
    pub(crate) max_run: Option<Duration>,
    pub(crate) max_body: Option<usize>,
    pub(crate) principal_header: Option<HeaderName>,
    pub(crate) principal_cookie: Option<CookiePrincipal>,
    pub(crate) on_store_error: OnStoreError,
}

impl Global {
    pub(crate) const NONE: Global = Global {
        window: None,
        lease: None,
        wait: None,
        max_run: None,
        max_body: None,
        principal_header: None,
        principal_cookie: None,
        on_store_error: OnStoreError::FailClosed,
    };

    /// These values, each one unset taken from `under` (a route's own over
    /// its preset's).
    pub(crate) fn over(self, under: &Global) -> Global {
        Global {
            window: self.window.or(under.window),
            lease: self.lease.or(under.lease),
            wait: self.wait.or(under.wait),
            max_run: self.max_run.or(under.max_run),
            max_body: self.max_body.or(under.max_body),
            principal_header: self.principal_header.or(under.principal_header.clone()),
            principal_cookie: self.principal_cookie.or(under.principal_cookie.clone()),
            on_store_error: self.on_store_error,
        }
    }

    /// The options of a route with its `own` values over these.
    pub(crate) fn options(&self, own: &Global) -> RouteOptions {
        let mut o = RouteOptions::new().on_store_error(self.on_store_error);
        if let Some(d) = own.window.or(self.window) {
            o = o.window(d);
        }
        if let Some(d) = own.lease.or(self.lease) {
            o = o.lease(d);
        }
        if let Some(d) = own.wait.or(self.wait) {
            o = o.wait(d);
        }
        if let Some(d) = own.max_run.or(self.max_run) {
            o = o.max_run(d);
        }
        if let Some(n) = own.max_body.or(self.max_body) {
            o = o.max_body_bytes(n);
        }
        if let Some(h) = own
            .principal_header
            .as_ref()
            .or(self.principal_header.as_ref())
        {
            o = o.principal_header(h.clone());
        }
        if let Some(c) = own
            .principal_cookie
            .as_ref()
            .or(self.principal_cookie.as_ref())
        {
            o = o.principal_cookie(c.clone());
        }
        o
    }
}
