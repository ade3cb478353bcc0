//! What the gateway runs with: the command line ([`cli`]) and the config
//! file ([`config`]) read into one set of settings, and the parsers of each
//! part of a route (its table, upstream, preset, limit, pace and `verify`
//! table). Nothing here opens a socket or a file other than the config
//! file and the files it names.

pub(crate) mod cli;
pub(crate) mod config;
pub(crate) mod deliver;
pub(crate) mod limit;
pub(crate) mod orders;
pub(crate) mod pace;
pub(crate) mod parse;
pub(crate) mod presets;
pub(crate) mod routes;
pub(crate) mod spanned;
pub(crate) mod upstreams;
pub(crate) mod verify;

#[cfg(test)]
mod tests;
