//! The SQL store against the conformance suite every store passes, records
//! completed in the handler's own transaction, round trips per request, the
//! fencing recipe on real databases, the SQLite backstop example, rows whose
//! state only moves forward (and the WeChat Pay example that moves them), and
//! Redis in front of PostgreSQL.

mod complete_in;
mod conformance;
mod fencing_recipe;
mod round_trips;
mod sqlite_backstop;
mod state_moves;
mod tiered_store;
mod wechatpay_state;
