//! The Redis stores against the conformance suite every store passes, and
//! several instances sharing one Redis (or Cluster) through storms, outages
//! and restarts.

mod conformance;
mod instances;
