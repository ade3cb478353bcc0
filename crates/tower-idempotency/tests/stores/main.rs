//! Every store against the same rules: memory, Redis and Cluster, SQL, tiered; fencing and the SQL backstop.

mod fencing_recipe;
mod redis_instances;
mod sql_complete_in;
mod sql_round_trips;
mod sqlite_backstop;
mod store_conformance;
mod tiered_store;
