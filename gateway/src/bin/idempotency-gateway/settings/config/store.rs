//! Where records live: `store`, `backstop`, `max_memory`,
//! `local_max_memory`.

use super::File;
use crate::settings::cli::Args;
use crate::settings::parse::{self, StoreSpec};
use crate::settings::spanned::At;

/// Where records live, and the memory they may take.
#[derive(Debug)]
pub(crate) struct StoreSettings {
    pub(crate) spec: StoreSpec,
    /// The SQL database behind the Redis store (`--backstop`).
    pub(crate) backstop: Option<String>,
    /// The memory store's budget (split between the routes).
    pub(crate) max_memory: usize,
    /// The Redis store's local tier budget.
    pub(crate) local_max_memory: usize,
}

/// The memory store's budget when `--max-memory` is not given.
pub(crate) const DEFAULT_MAX_MEMORY: usize = 256 << 20;

/// The Redis store's local tier budget when `--local-max-memory` is not given.
pub(crate) const DEFAULT_LOCAL_MAX_MEMORY: usize = 64 << 20;

/// The store's settings; a backstop goes behind a Redis store only.
pub(super) fn settings(args: &Args, file: &File, at: &At<'_>) -> Result<StoreSettings, String> {
    let spec = at.pick(args.store.clone(), &file.store, "store", parse::store)?;
    let backstop = at.pick(
        args.backstop.clone(),
        &file.backstop,
        "backstop",
        parse::backstop,
    )?;
    let max_memory = at
        .pick(
            args.max_memory,
            &file.max_memory,
            "max_memory",
            parse::body_size,
        )?
        .unwrap_or(DEFAULT_MAX_MEMORY);
    let spec = spec.unwrap_or(StoreSpec::Memory);
    if backstop.is_some() && !matches!(spec, StoreSpec::Redis(_) | StoreSpec::Cluster(_)) {
        return Err(
            "`--backstop` goes behind a Redis store: give `--store redis://HOST:PORT` \
                    or `--store redis+cluster://…` with it"
                .into(),
        );
    }
    Ok(StoreSettings {
        spec,
        backstop,
        max_memory,
        local_max_memory: at
            .pick(
                args.local_max_memory,
                &file.local_max_memory,
                "local_max_memory",
                parse::size,
            )?
            .unwrap_or(DEFAULT_LOCAL_MAX_MEMORY),
    })
}
