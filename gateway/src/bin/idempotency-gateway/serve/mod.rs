//! Serving requests: accepting connections ([`accept`]) on the serving
//! threads ([`workers`]), TLS, the access log, the logs and the trace
//! export.

pub(crate) mod accept;
pub(crate) mod access;
pub(crate) mod logging;
pub(crate) mod otel;
pub(crate) mod tls;
pub(crate) mod workers;
