//! The config file's `[[order]]` tables, and a route's `order`: a built-in
//! order (`stripe`, `alipay`, `paypal`, `wechatpay-v3`) or a table's name.
//!
//! ```toml
//! [[order]]
//! name = "shipments"
//! object = "json:/order_id"
//! version = "json:/seq"                 # optional
//! state = "json:/status"                # optional, with states
//! states = ["created", "paid", "shipped"]
//! ```

use crate::settings::presets::source;
use crate::settings::spanned::{At, Field as Text};
use serde::Deserialize;
use std::collections::BTreeMap;
use toml::Spanned;
use tower_idempotency::order::Order;

/// One `[[order]]` table.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileOrder {
    name: Spanned<String>,
    object: Spanned<String>,
    version: Text,
    state: Text,
    states: Option<Spanned<Vec<String>>>,
}

/// The file's orders by name.
pub(crate) type Orders = BTreeMap<String, Order>;

/// The built-in orders' names, as a route's `order` takes them.
const BUILTIN: [&str; 4] = ["stripe", "alipay", "paypal", "wechatpay-v3"];

/// Reads every `[[order]]` table; an error names its line.
pub(crate) fn from_file(tables: &[Spanned<FileOrder>], at: &At<'_>) -> Result<Orders, String> {
    let mut out = Orders::new();
    for t in tables {
        let t = t.get_ref();
        let name = t.name.get_ref();
        if out.contains_key(name) {
            return Err(at.err(t.name.span(), format!("order `{name}` is defined twice")));
        }
        out.insert(name.clone(), one(t, at)?);
    }
    Ok(out)
}

fn one(t: &FileOrder, at: &At<'_>) -> Result<Order, String> {
    let field = |v: &Spanned<String>, key: &str| {
        source(v.get_ref()).map_err(|e| at.err(v.span(), format!("`{key}`: {e}")))
    };
    let mut order = Order::builder(t.name.get_ref().as_str()).object(field(&t.object, "object")?);
    if let Some(v) = &t.version {
        order = order.version(field(v, "version")?);
    }
    match (&t.state, &t.states) {
        (Some(state), Some(states)) => {
            order = order.state(field(state, "state")?, states.get_ref().iter().cloned());
        }
        (Some(state), None) => {
            return Err(at.err(
                state.span(),
                "`state` needs `states`: the states from first to last, e.g. \
                 states = [\"created\", \"paid\", \"shipped\"]",
            ))
        }
        (None, Some(states)) => {
            return Err(at.err(
                states.span(),
                "`states` needs `state`: where the state is, e.g. state = \"json:/status\"",
            ))
        }
        (None, None) => {}
    }
    // The builder's reasons: the name, neither a version nor a state, an
    // empty or repeated state.
    order.build().map_err(|e| at.err(t.name.span(), e))
}

/// A route's `order`: a built-in order's name or one of `orders`.
pub(crate) fn named(name: &Spanned<String>, orders: &Orders, at: &At<'_>) -> Result<Order, String> {
    let n = name.get_ref();
    if let Some(order) = orders.get(n) {
        return Ok(order.clone());
    }
    if let Some(order) = Order::builtin(n) {
        return Ok(order);
    }
    let configured = if orders.is_empty() {
        String::new()
    } else {
        let names: Vec<&str> = orders.keys().map(String::as_str).collect();
        format!(", or an [[order]] of this file ({})", names.join(", "))
    };
    Err(at.err(
        name.span(),
        format!(
            "`order`: unknown order `{n}`; expected a built-in order ({}){configured}",
            BUILTIN.join(", ")
        ),
    ))
}
