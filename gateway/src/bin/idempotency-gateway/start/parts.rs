//! The parts a running gateway is made of, opened once at start from its
//! settings: the store, the queue, the admin API and metrics, the paused
//! routes, the caps on upstream calls, the journal; and the gateways built
//! on them (one per serving thread, one for the queue's deliveries).

use crate::admin::api;
use crate::admin::api::PickStore;
use crate::admin::listener;
use crate::settings::config::{self, Settings};
use crate::settings::pace;
use crate::settings::parse;
use crate::settings::routes::RouteSettings;
use crate::settings::upstreams;
use crate::start::ack::{self, DeliveryQueue, WorkerQueue};
use crate::start::pauses;
use crate::start::store;
use idempotency_gateway::journal::{Journal, JournalOptions};
use idempotency_gateway::proxy::{CallLimit, Destination, Forward, Gateway, Target};
use std::sync::Arc;
use store::GatewayStore;
use tower_idempotency::limit::{BodyBudget, BodyLimitsLayer};
use tower_idempotency::{Preset, TaskTracker};
use tracing::info;
use tracing_appender::non_blocking::ErrorCounter;

/// What every gateway of the process shares.
pub(crate) struct Parts {
    pub(crate) store: GatewayStore,
    pub(crate) admin: Option<listener::Admin>,
    /// The queue routes ingest into and the worker delivers from, sealed
    /// when entries are (none without an `ack-then-deliver` route).
    pub(crate) sealed: Option<DeliveryQueue>,
    /// The same queue, split by how its worker paces.
    delivering: Option<WorkerQueue>,
    /// The metrics and admin listener's task.
    pub(crate) metrics: Option<tokio::task::JoinHandle<()>>,
    pub(crate) keeper: pauses::PauseKeeper,
    /// One tracker for every gateway: the drain waits for all their work.
    pub(crate) tasks: TaskTracker,
    /// One cap for the upstream, across the serving threads and the
    /// queue's deliveries.
    calls: CallLimit,
    /// Each named upstream's cap.
    named_calls: Vec<CallLimit>,
    /// One budget of request bodies being read, across the serving threads.
    bodies: BodyLimitsLayer,
    /// Each route's records in a memory store of its own.
    stores: Option<Arc<PickStore>>,
}

impl Parts {
    /// Opens every part, in the order each needs the others: the store,
    /// the queue (on the store), the metrics listener (the recorder every
    /// later gauge registers with), the paused routes, the caps.
    pub(crate) async fn open(
        settings: &Settings,
        dropped: ErrorCounter,
        admin_tls: Option<crate::serve::tls::Tls>,
    ) -> Result<Self, String> {
        let budgets = store::Budgets {
            max_memory: settings.store.max_memory as u64,
            local_max_memory: settings.store.local_max_memory as u64,
        };
        let store = store::connect(
            &settings.store.spec,
            settings.store.backstop.as_deref(),
            &budgets,
        )
        .await?;
        let admin = settings.admin.token.clone().map(listener::Admin::new);
        let acked = settings
            .routes
            .iter()
            .any(|r| r.options.is_ack_then_deliver());
        ack::warn_unverified(&settings.routes);
        let memory = matches!(store, tower_idempotency::store::Either::Left(_));
        ack::warn_memory_store(&settings.queue, memory);
        let queue = settings.queue.open_for(acked, &store).await?;
        if let (Some(admin), Some(queue)) = (&admin, &queue) {
            admin.set_queue(queue.clone());
        }
        // Routes queue, and the worker delivers, sealed entries.
        let max_age = ack::max_age(&settings.routes);
        let sealed = (queue.clone().map(|q| settings.queue.seal(q)).transpose()?)
            .map(|q| q.map_left(|s| s.max_age(max_age)));
        // A replay through the admin API seals afresh.
        if let (Some(admin), Some(either::Either::Left(s))) = (&admin, &sealed) {
            admin.set_queue_key(s.key().clone());
        }
        // The worker's queue, by how it paces: one that must pace with the
        // other gateways on a queue that cannot is refused here.
        let delivering = (sealed.clone())
            .map(|q| {
                let (pacing, shown) = (settings.queue.pacing(), settings.queue.describe());
                WorkerQueue::new(q, pacing, &shown)
            })
            .transpose()?;
        // `/readyz` says when the embedded queue cannot store notifications.
        let embedded = match (&queue, acked) {
            (Some(either::Either::Left(q)), true) => Some(q.clone()),
            _ => None,
        };
        let metrics = match settings.admin.listen {
            Some(addr) => {
                let presets = route_presets(&settings.routes);
                let acked: Vec<&str> = (settings.routes.iter())
                    .filter(|r| r.options.is_ack_then_deliver())
                    .map(|r| r.prefix.as_str())
                    .collect();
                let series = listener::Series {
                    presets: &presets,
                    acked: &acked,
                };
                let listening = listener::Listening {
                    header_timeout: settings.serve.header_timeout,
                    tls: admin_tls,
                };
                let started = listener::start(
                    addr,
                    store.clone(),
                    embedded,
                    dropped,
                    &series,
                    admin.clone(),
                    listening,
                );
                Some(started.await?)
            }
            None if admin.is_some() => {
                return Err(
                    "--admin-token-file needs --admin-listen (the admin API's listener)".into(),
                )
            }
            None => None,
        };
        if let Some(traces) = &settings.traces {
            if metrics.is_some() {
                crate::serve::otel::register_metrics();
            }
            info!(
                endpoint = %traces.endpoint,
                protocol = ?traces.protocol,
                service = %traces.service,
                sample_ratio = %traces.sampler.describe(),
                "traces exported over OTLP"
            );
        }
        let keeper = paused_routes(settings, &store, memory).await;
        if let Some(admin) = &admin {
            admin.set_routes(
                keeper.clone(),
                route_infos(settings),
                settings.upstream.url.to_string(),
            );
        }
        // Built once the metrics recorder is in, for their gauges.
        let up = &settings.upstream;
        let calls = CallLimit::new(up.max_calls).queue_wait(up.queue_wait);
        let named_calls: Vec<CallLimit> = (up.named.iter())
            .map(|u| u.calls(up.max_calls, up.queue_wait))
            .collect();
        upstreams::running(&up.named, &named_calls);
        let bodies = BodyLimitsLayer::new()
            .timeout(settings.serve.body_timeout)
            .budget(BodyBudget::new(settings.serve.max_buffered));
        // Each route's records in a memory store of its own (shared by
        // every serving thread), so that no route pushes another's out.
        let stores = store::per_route(&settings.store.spec, &settings.routes)
            .map(|pick| Arc::new(pick) as Arc<PickStore>);
        if let (Some(admin), Some(stores)) = (&admin, &stores) {
            admin.set_stores(stores.clone());
        }
        Ok(Self {
            store,
            admin,
            sealed,
            delivering,
            metrics,
            keeper,
            tasks: TaskTracker::new(),
            calls,
            named_calls,
            bodies,
            stores,
        })
    }

    /// A gateway on these parts: its own upstream connections (one pool
    /// per named upstream too), every cap and budget shared.
    pub(crate) fn gateway(&self, settings: &Settings) -> Result<Gateway<GatewayStore>, String> {
        let forward = forward(settings, Some(&self.calls))?;
        let mut builder = Gateway::builder(forward, self.store.clone())
            .task_tracker(self.tasks.clone())
            .body_limits(self.bodies.clone());
        if let Some(stores) = &self.stores {
            let stores = stores.clone();
            builder = builder.stores(move |prefix, preset| stores(prefix, preset));
        }
        let up = &settings.upstream;
        let named = (up.named.iter().zip(&self.named_calls))
            .map(|(u, calls)| {
                let f = u.forward(up.timeout, up.keepalive, up.accept_traceparent, Some(calls))?;
                Ok((u.name.as_str(), f))
            })
            .collect::<Result<Vec<_>, String>>()?;
        for route in &settings.routes {
            let mut options = route.options.clone();
            let name = route.upstream.as_deref();
            if let Some((_, f)) = name.and_then(|n| named.iter().find(|(m, _)| *m == n)) {
                options = options.upstream(f.clone());
            }
            for d in &route.destinations {
                // The names were checked with the settings.
                if let Some((_, f)) = named.iter().find(|(m, _)| *m == d.upstream) {
                    let mut destination = Destination::new(d.upstream.as_str(), f.clone());
                    for (field, values) in &d.only {
                        destination = destination.only(field.clone(), values.iter().cloned());
                    }
                    options = options.deliver_to(destination);
                }
            }
            builder = builder.route_with(&route.prefix, route.target.clone(), options);
        }
        if let Some(queue) = &self.sealed {
            builder = builder.queue(queue.clone());
        }
        builder = builder.pauses(self.keeper.pauses().clone());
        // The journal reads each notification's body for its business ids.
        builder = builder.capture_requests(settings.journal.is_some());
        // The key, the route and the upstream's answer in each response:
        // read by the journal, and by the spans (the request span's route,
        // the library's key hash), which are off below INFO.
        let spans = tracing::level_filters::LevelFilter::current() >= tracing::Level::INFO;
        builder = builder.response_extensions(settings.journal.is_some() || spans);
        builder.build().map_err(|e| e.to_string())
    }

    /// The queue's worker, delivering through `control` (a gateway of its
    /// own), until `stop`; none without a queue.
    pub(crate) fn spawn_worker(
        &mut self,
        settings: &Settings,
        control: &Gateway<GatewayStore>,
        journal: Option<Journal>,
        stop: tokio::sync::oneshot::Receiver<()>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let delivering = self.delivering.take()?;
        let lanes = pace::lanes(&settings.routes);
        let destinations: Vec<ack::DestinationLane> = (settings.routes.iter())
            .flat_map(|route| {
                (route.destinations.iter()).map(|d| ack::DestinationLane {
                    prefix: route.prefix.clone(),
                    destination: d.upstream.clone(),
                    pace: d.pace.clone(),
                })
            })
            .collect();
        let paused = self.keeper.pauses();
        let worker = (settings.queue).spawn_worker(
            delivering,
            control,
            journal,
            (&lanes, &destinations),
            paused,
            stop,
        );
        Some(worker)
    }
}

/// The paused routes, read before the first request and every half second
/// after.
async fn paused_routes(
    settings: &Settings,
    store: &GatewayStore,
    memory: bool,
) -> pauses::PauseKeeper {
    // A route's destinations pause on their own (`pause PREFIX --upstream NAME`).
    let destinations = (settings.routes.iter()).flat_map(|r| {
        (r.destinations.iter())
            .map(|d| idempotency_gateway::proxy::destination_scope(&r.prefix, &d.upstream))
    });
    let prefixes = (settings.routes.iter().map(|r| r.prefix.clone()))
        .chain(destinations)
        .collect();
    let keeper = pauses::PauseKeeper::new(store, memory, settings.data_dir.clone(), prefixes);
    // A route paused where the pauses are kept must not be delivered to
    // before they are read.
    keeper.pauses().hold_deliveries_until_read();
    if let Err(e) = keeper.refresh().await {
        tracing::warn!(error = %crate::redact::redact_text(&e), "cannot read the paused routes yet: every queued delivery is held, and no parked entry woken, until they can be read");
    }
    keeper.spawn_poller();
    keeper
}

/// The routes as the admin API lists them.
fn route_infos(settings: &Settings) -> Vec<api::RouteInfo> {
    (settings.routes.iter())
        .map(|r| api::RouteInfo {
            prefix: r.prefix.clone(),
            preset: match &r.target {
                Target::Preset(preset) => preset.name().to_owned(),
                Target::Auto => "auto".to_owned(),
            },
            acked: r.options.is_ack_then_deliver(),
            upstream: (r.upstream.as_ref())
                .and_then(|name| settings.upstream.named.iter().find(|u| u.name == *name))
                .map(|u| u.upstream.to_string()),
            destinations: (r.destinations.iter())
                .map(|d| d.upstream.clone())
                .collect(),
        })
        .collect()
}

/// The presets the routes guard with: every built-in one on an `auto` route.
fn route_presets(routes: &[RouteSettings]) -> Vec<&str> {
    let mut presets = Vec::new();
    for route in routes {
        match &route.target {
            Target::Preset(p) => presets.push(p.name()),
            Target::Auto => presets.extend_from_slice(Preset::builtin_names()),
        }
    }
    presets.sort_unstable();
    presets.dedup();
    presets
}

/// A forwarder to the upstream; every one shares the cap on upstream calls
/// `calls` (none: a cap of its own, for `--check-config`).
pub(crate) fn forward(settings: &Settings, calls: Option<&CallLimit>) -> Result<Forward, String> {
    let up = &settings.upstream;
    let mut builder = Forward::builder(up.url.clone())
        .timeout(up.timeout)
        .upstream_keepalive(up.keepalive)
        .accept_traceparent(up.accept_traceparent);
    if let Some(calls) = calls {
        builder = builder.call_limit(calls.clone());
    }
    if let Some(ca) = &up.ca {
        let pem = std::fs::read(ca).map_err(|e| format!("cannot read {}: {e}", ca.display()))?;
        builder = builder
            .add_root_certificates_pem(&pem)
            .map_err(|e| format!("{}: {e}", ca.display()))?;
    }
    Ok(builder.build())
}

/// The journal: in the SQL store's database when the store is one (or the
/// SQL `--backstop` behind a Redis store), in Redis with a Redis store,
/// else in `js.path` (the data directory's redb file, created readable by
/// its owner only).
pub(crate) async fn open_journal(
    store: &parse::StoreSpec,
    backstop: Option<&str>,
    js: &config::journal::JournalSettings,
) -> Result<Journal, String> {
    let retention = js.retention;
    let options = JournalOptions::new()
        .retention(retention)
        .max_size(js.max_size);
    let database = match store {
        parse::StoreSpec::Sql(url) => Some(url.as_str()),
        _ => backstop,
    };
    let journal = if let Some(url) = database {
        let opened = Journal::connect(url, options).await;
        let (journal, writer) = opened.map_err(|e| crate::redact::redact_text(&e.to_string()))?;
        tokio::spawn(writer);
        info!(
            table = "idempotency_journal",
            ?retention,
            "journal of notifications on, in the SQL database (shared by every instance)"
        );
        journal
    } else if let parse::StoreSpec::Redis(url) = store {
        let opened = Journal::connect_redis(url, options).await;
        let (journal, writer) = opened.map_err(|e| crate::redact::redact_text(&e.to_string()))?;
        tokio::spawn(writer);
        info!(
            ?retention,
            "journal of notifications on, in Redis (shared by every instance)"
        );
        journal
    } else {
        let path = &js.path;
        if let Some(dir) = path.parent() {
            ack::create_private_dir(dir)?;
        }
        let (journal, writer) = Journal::open(path, options).map_err(|e| e.to_string())?;
        tokio::spawn(writer);
        info!(path = %path.display(), ?retention, max_size = js.max_size, "journal of notifications on");
        journal
    };
    // At zero from the start, for `increase()` in alert rules.
    metrics::counter!("idempotency_journal_dropped_total").increment(0);
    for reason in ["retention", "size"] {
        metrics::counter!("idempotency_journal_pruned_total", "reason" => reason).increment(0);
    }
    Ok(journal)
}
