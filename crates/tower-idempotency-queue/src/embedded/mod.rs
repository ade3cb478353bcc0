//! The embedded queue: one redb database on one node, a file
//! ([`RedbQueue`]) or memory for tests ([`MemoryQueue`]). Its group commit,
//! record layouts, dead letters, the free space it keeps on its disk, and
//! how it reopens its file after a failed write live here.

mod dead;
mod group;
mod health;
mod memory;
mod records;
mod redb;
mod reopen;
mod room;
mod store;

pub use self::memory::MemoryQueue;
pub use self::redb::{InMemory, OnDisk, RedbQueue};
