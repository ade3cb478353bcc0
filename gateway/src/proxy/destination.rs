//! [`Destination`]: one of the upstreams an acknowledge-then-deliver
//! route delivers its notifications to, and the filter that says which.

use super::Forward;
use bytes::Bytes;
use http::request::Parts;
use std::fmt;
use std::sync::Arc;
use tower_idempotency::key::{Field, FingerprintSpec, KeySpec};

/// One destination of an acknowledge-then-deliver route
/// ([`RouteOptions::deliver_to`](super::RouteOptions::deliver_to)): a named
/// upstream, and optionally which notifications it wants.
///
/// A notification is queued once per destination it matches, and each
/// destination's entry is delivered on its own (attempts, backoff, dead
/// letters), exactly once: the dedup record of a delivery is the
/// destination's own (its own fencing token), while every destination gets
/// the same `idempotency-key` header.
///
/// ```
/// use idempotency_gateway::proxy::{Destination, Forward, Upstream};
/// use tower_idempotency::key::Field;
///
/// let orders = Forward::new("http://127.0.0.1:8081".parse::<Upstream>().unwrap());
/// let d = Destination::new("orders", orders)
///     .only(Field::json("/type"), ["payment_intent.succeeded", "charge.refunded"]);
/// assert_eq!(d.name(), "orders");
/// ```
#[derive(Clone)]
pub struct Destination {
    pub(crate) name: Arc<str>,
    pub(crate) forward: Forward,
    only: Vec<(Field, Vec<String>)>,
    /// The fields of `only`, read in one pass over the body.
    spec: Option<Arc<KeySpec>>,
}

impl Destination {
    /// The destination `name` (letters, digits, `-`, `_`), delivered
    /// through `forward`; every notification of the route goes to it until
    /// [`only`](Self::only) says otherwise.
    pub fn new(name: impl Into<Arc<str>>, forward: Forward) -> Self {
        Self {
            name: name.into(),
            forward,
            only: Vec::new(),
            spec: None,
        }
    }

    /// Only the notifications whose `field` is one of `values`. Several
    /// calls: each of them must hold.
    pub fn only<V: Into<String>>(
        mut self,
        field: Field,
        values: impl IntoIterator<Item = V>,
    ) -> Self {
        self.only
            .push((field, values.into_iter().map(Into::into).collect()));
        let fields = self.only.iter().map(|(f, _)| f.clone());
        self.spec = Some(Arc::new(KeySpec::new(fields, FingerprintSpec::None)));
        self
    }

    /// The destination's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the notification `parts` and `body` is for this destination:
    /// every [`only`](Self::only) field is present with one of its values.
    /// `Err` when the body cannot be read for them.
    pub(crate) fn wants(&self, parts: &Parts, body: &Bytes) -> Result<bool, String> {
        let Some(spec) = &self.spec else {
            return Ok(true);
        };
        let values = spec.values(parts, body).map_err(|e| e.to_string())?;
        Ok(self
            .only
            .iter()
            .zip(values)
            .all(|((_, accepted), got)| got.is_some_and(|got| accepted.contains(&got))))
    }
}

impl fmt::Debug for Destination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let only: Vec<String> = self
            .only
            .iter()
            .map(|(field, values)| format!("{field} in {values:?}"))
            .collect();
        f.debug_struct("Destination")
            .field("name", &self.name)
            .field("only", &only)
            .finish_non_exhaustive()
    }
}

/// The name of the destination `destination` of the route `prefix`
/// (`/stripe@ledger`): its pause (see [`Pauses`](super::Pauses)), its
/// worker lane and its share of its upstream's calls.
///
/// ```
/// use idempotency_gateway::proxy::destination_scope;
/// assert_eq!(destination_scope("/stripe", "ledger"), "/stripe@ledger");
/// ```
pub fn destination_scope(prefix: &str, destination: &str) -> String {
    format!("{}@{destination}", prefix.trim_end_matches('/'))
}

/// The prefix of the stored keys of a destination's deliveries: the
/// layers' `idem` with the destination, so that each destination's
/// delivery of one notification is a claim of its own.
pub(crate) fn store_prefix(destination: &str) -> String {
    format!("idem~{destination}")
}

/// The stored key of the delivery of notification `key` (a stored key, as
/// the journal and `inspect` show it) to `destination`: each destination's
/// delivery is a claim of its own. `None` for a key the gateway's routes do
/// not store.
///
/// ```
/// use idempotency_gateway::proxy::destination_stored_key;
/// assert_eq!(
///     destination_stored_key("idem:stripe:/stripe::evt_1", "ledger").as_deref(),
///     Some("idem~ledger:stripe:/stripe::evt_1")
/// );
/// ```
pub fn destination_stored_key(key: &str, destination: &str) -> Option<String> {
    let rest = key.strip_prefix("idem:")?;
    Some(format!("{}:{rest}", store_prefix(destination)))
}

/// The notification's stored key, put in a destination's delivery: its
/// `idempotency-key` header is this key's hash, the same for every
/// destination (the claim's own key names the destination).
#[derive(Debug, Clone)]
pub(crate) struct NotificationKey(pub(crate) Arc<str>);
