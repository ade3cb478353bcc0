//! [`OrderBuilder`]: an order from parts, for objects of your own.

use super::place::{Inner, Order, Rule};
use crate::key::{Field, FingerprintSpec, KeySpec};
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

/// Why [`OrderBuilder::build`] refused an order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderError(String);

impl fmt::Display for OrderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for OrderError {}

/// Builds an [`Order`] from parts; from [`Order::builder`].
///
/// The sources are [`Field`]s, as a configured preset's key
/// (`"json:/order_id".parse::<Field>()` reads the configuration's form).
///
/// ```
/// use tower_idempotency::key::Field;
/// use tower_idempotency::order::Order;
///
/// let order = Order::builder("shipments")
///     .object("json:/order_id".parse::<Field>().unwrap())
///     .state(Field::json("/status"), ["created", "paid", "shipped"])
///     .build()
///     .unwrap();
/// assert_eq!(order.name(), "shipments");
/// // An object is needed, and a version or a state to order by.
/// assert!(Order::builder("x").version(Field::json("/seq")).build().is_err());
/// assert!(Order::builder("x").object(Field::json("/id")).build().is_err());
/// assert!(Order::builder("x").object(Field::json("/id"))
///     .state(Field::json("/s"), ["a", "a"]).build().is_err());
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct OrderBuilder {
    name: Arc<str>,
    object: Option<Field>,
    version: Option<Field>,
    state: Option<(Field, Vec<String>)>,
}

impl Order {
    /// An order built from parts, named `name` (`[a-z0-9-]`, not a built-in
    /// order's): the name is part of the store key of its objects'
    /// positions, and what metrics show.
    pub fn builder(name: impl Into<Arc<str>>) -> OrderBuilder {
        OrderBuilder {
            name: name.into(),
            object: None,
            version: None,
            state: None,
        }
    }
}

impl OrderBuilder {
    /// Where the id of the object is (required).
    pub fn object(mut self, source: Field) -> Self {
        self.object = Some(source);
        self
    }

    /// Where the version is: a whole number, or an RFC 3339 time.
    /// Optional; an event without one (with an order that has one) is
    /// unplaced.
    pub fn version(mut self, source: Field) -> Self {
        self.version = Some(source);
        self
    }

    /// Where the state is, and the states from first to last: a state's
    /// rank is its place in `states`. Optional; an event whose state is not
    /// in the list is unplaced.
    pub fn state<S: Into<String>>(
        mut self,
        source: Field,
        states: impl IntoIterator<Item = S>,
    ) -> Self {
        self.state = Some((source, states.into_iter().map(Into::into).collect()));
        self
    }

    /// The order, or why not: a name that is not `[a-z0-9-]` or is a
    /// built-in order's, no object, neither a version nor a state, an
    /// empty or repeated state.
    pub fn build(self) -> Result<Order, OrderError> {
        let name = &self.name;
        if name.is_empty()
            || !name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            return Err(OrderError(format!(
                "order name {name:?}: use lower-case letters, digits and `-`"
            )));
        }
        if Order::is_builtin_name(name) {
            return Err(OrderError(format!(
                "order name {name:?} is a built-in order's: name a configured order otherwise"
            )));
        }
        let Some(object) = self.object else {
            return Err(OrderError(format!(
                "order {name}: no object (where the id of what the events are about is)"
            )));
        };
        if self.version.is_none() && self.state.is_none() {
            return Err(OrderError(format!(
                "order {name}: neither a version nor a state to order the events by"
            )));
        }
        let mut fields = vec![object];
        let versioned = self.version.is_some();
        fields.extend(self.version);
        let ranks = match self.state {
            None => None,
            Some((source, states)) => {
                if states.is_empty() {
                    return Err(OrderError(format!("order {name}: a state without states")));
                }
                let mut ranks = HashMap::with_capacity(states.len());
                for (rank, state) in states.into_iter().enumerate() {
                    if state.is_empty() {
                        return Err(OrderError(format!("order {name}: an empty state")));
                    }
                    let rank = u32::try_from(rank).unwrap_or(u32::MAX);
                    if ranks.insert(state.clone(), rank).is_some() {
                        return Err(OrderError(format!(
                            "order {name}: the state {state:?} is listed twice"
                        )));
                    }
                }
                fields.push(source);
                Some(ranks)
            }
        };
        Ok(Order {
            inner: Arc::new(Inner {
                name: self.name,
                reader: KeySpec::new(fields, FingerprintSpec::None),
                rule: Rule::Configured { versioned, ranks },
            }),
        })
    }
}
