//! Operating the gateway binary: the admin API, traces and logs, the journal and reconciliation, SQL and fenced stores, the deploy files.

mod deploy;
mod gateway_admin;
mod gateway_backstop;
mod gateway_fencing;
mod gateway_ops;
mod gateway_readme_commands;
mod gateway_reconcile;
mod gateway_send;
mod gateway_sql_store;
#[path = "../gateway_support/mod.rs"]
mod gateway_support;
