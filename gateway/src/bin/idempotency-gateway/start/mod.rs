//! Start-up: the parts a running gateway is made of, opened once from its
//! settings ([`parts`]): the store, the queue and its worker
//! (acknowledge-then-deliver), and where the paused routes are kept.

pub(crate) mod ack;
pub(crate) mod parts;
pub(crate) mod pauses;
pub(crate) mod store;
