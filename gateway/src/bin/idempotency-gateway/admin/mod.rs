//! The admin listener (`--admin-listen`): `/metrics`, `/healthz` and
//! `/readyz` ([`listener`]); with an admin token, the admin API ([`api`]),
//! the dead letters through it ([`dead`]), the console and the samples its
//! charts read.

pub(crate) mod api;
pub(crate) mod console;
pub(crate) mod dead;
pub(crate) mod listener;
pub(crate) mod samples;
