//! The gateway's pieces as a library: acknowledge-then-deliver, hostile senders, verify tables, adaptive shedding, the journal and reconciliation.

mod journal_dropped;
mod journal_sql;
mod proxy_ack;
mod proxy_destinations;
mod reconcile_bills;
mod shed_adaptive;
mod traces;
mod verify_config;
mod verify_hostile;
