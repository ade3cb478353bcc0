//! Queue metrics through the `metrics` facade (feature `metrics`).

#[cfg(feature = "metrics")]
use super::QueueStats;

/// Counts one delivery attempt: `idempotency_queue_attempts_total{queue,
/// result}`, and `destination` for an entry of one of a notification's
/// destinations.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(super) fn attempt(
    queue: &std::sync::Arc<str>,
    result: &'static str,
    destination: Option<&str>,
) {
    #[cfg(feature = "metrics")]
    match destination {
        None => metrics::counter!(
            "idempotency_queue_attempts_total",
            "queue" => metrics::SharedString::from(queue.clone()),
            "result" => result
        )
        .increment(1),
        Some(d) => metrics::counter!(
            "idempotency_queue_attempts_total",
            "queue" => metrics::SharedString::from(queue.clone()),
            "result" => result,
            "destination" => d.to_owned()
        )
        .increment(1),
    }
}

/// Sets the gauges: `idempotency_queue_depth`,
/// `idempotency_queue_oldest_seconds` and `idempotency_queue_dead_letters`,
/// each labelled `queue`; for a queue that says whether it can write (the
/// embedded one), `idempotency_queue_writable` (1 or 0) and the counter
/// `idempotency_queue_write_errors_total`.
#[cfg(feature = "metrics")]
pub(super) fn stats(queue: &std::sync::Arc<str>, stats: &QueueStats) {
    let label = || metrics::SharedString::from(queue.clone());
    metrics::gauge!("idempotency_queue_depth", "queue" => label()).set(stats.depth as f64);
    metrics::gauge!("idempotency_queue_oldest_seconds", "queue" => label())
        .set(stats.oldest.map_or(0.0, |d| d.as_secs_f64()));
    metrics::gauge!("idempotency_queue_dead_letters", "queue" => label()).set(stats.dead as f64);
    if let Some(writable) = stats.writable {
        metrics::gauge!("idempotency_queue_writable", "queue" => label())
            .set(f64::from(u8::from(writable)));
        metrics::counter!("idempotency_queue_write_errors_total", "queue" => label())
            .absolute(stats.write_errors);
    }
}

/// Sets `idempotency_queue_stranded{queue}`: entries kept because no route
/// delivers their path now.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(super) fn stranded(queue: &std::sync::Arc<str>, n: usize) {
    #[cfg(feature = "metrics")]
    metrics::gauge!(
        "idempotency_queue_stranded",
        "queue" => metrics::SharedString::from(queue.clone())
    )
    .set(n as f64);
}

/// A lane's labels: its route, and the destination of a destination's lane.
type Labels = (std::sync::Arc<str>, Option<std::sync::Arc<str>>);

/// Sets `idempotency_deliveries_in_flight{route}` (and `destination`, for
/// the lane of one destination of a route): a lane's deliveries calling
/// the service now.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(super) fn deliveries_in_flight((route, destination): &Labels, n: usize) {
    #[cfg(feature = "metrics")]
    gauge(
        "idempotency_deliveries_in_flight",
        route,
        destination.as_ref(),
    )
    .set(n as f64);
}

/// Sets `idempotency_upstream_breaker{route}` (and `destination`): 0
/// closed, 1 open, 2 half-open (the probe under way).
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(super) fn breaker((route, destination): &Labels, state: u8) {
    #[cfg(feature = "metrics")]
    gauge("idempotency_upstream_breaker", route, destination.as_ref()).set(f64::from(state));
}

/// The gauge `name` of a lane.
#[cfg(feature = "metrics")]
fn gauge(
    name: &'static str,
    route: &std::sync::Arc<str>,
    destination: Option<&std::sync::Arc<str>>,
) -> metrics::Gauge {
    let route = metrics::SharedString::from(route.clone());
    match destination {
        None => metrics::gauge!(name, "route" => route),
        Some(d) => metrics::gauge!(
            name,
            "route" => route,
            "destination" => metrics::SharedString::from(d.clone())
        ),
    }
}

/// Counts `idempotency_breaker_shared_errors_total{route}`: the breaker
/// shared on the queue could not answer (the worker's own breaker judged
/// alone).
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(super) fn breaker_shared_error(lane: &std::sync::Arc<str>) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "idempotency_breaker_shared_errors_total",
        "route" => metrics::SharedString::from(lane.clone())
    )
    .increment(1);
}
