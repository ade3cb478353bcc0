//! The journal's settings: `journal`, `journal_retention`, `journal_max_size`,
//! `journal_body`.

use super::File;
use crate::settings::cli::Args;
use crate::settings::parse;
use crate::settings::spanned::At;
use crate::start::ack;
use std::path::PathBuf;
use std::time::Duration;

/// The body cap when `journal_body` is on.
pub(super) fn body(
    args: &Args,
    file: &File,
    at: &At<'_>,
    journal: bool,
) -> Result<Option<usize>, String> {
    let max = at.pick(
        args.journal_body_max,
        &file.journal_body_max,
        "journal_body_max",
        parse::body_size,
    )?;
    if !(args.journal_body || file.journal_body == Some(true)) {
        return Ok(None);
    }
    if !journal {
        return Err("`journal_body` (--journal-body) needs the journal: add --journal".into());
    }
    Ok(Some(max.unwrap_or(DEFAULT_JOURNAL_BODY_MAX)))
}

/// The most body bytes a journal record keeps unless `journal_body_max` says otherwise.
const DEFAULT_JOURNAL_BODY_MAX: usize = 64 << 10;

/// The most bytes the journal's records take unless `journal_max_size` says otherwise.
const DEFAULT_JOURNAL_MAX_SIZE: u64 = 1 << 30;

/// Where the journal lives, how long it keeps records and how many bytes of them.
#[derive(Debug, Clone)]
pub(crate) struct JournalSettings {
    /// The redb file (`--data-dir/journal.redb`) when no database holds it.
    pub(crate) path: PathBuf,
    pub(crate) retention: Duration,
    pub(crate) max_size: u64,
}

/// Where the journal lives and how long it keeps records, when it is on.
pub(super) fn settings(
    args: &Args,
    file: &File,
    at: &At<'_>,
) -> Result<Option<JournalSettings>, String> {
    let max_size = at.pick(
        args.journal_max_size,
        &file.journal_max_size,
        "journal_max_size",
        parse::body_size,
    )?;
    if !(args.journal || file.journal == Some(true)) {
        return Ok(None);
    }
    let dir = args.data_dir.clone().or(file.data_dir.clone());
    let dir = dir.unwrap_or_else(|| PathBuf::from(ack::DEFAULT_DATA_DIR));
    let retention = at.pick(
        args.journal_retention,
        &file.journal_retention,
        "journal_retention",
        parse::positive_duration,
    )?;
    Ok(Some(JournalSettings {
        path: dir.join("journal.redb"),
        retention: retention.unwrap_or(Duration::from_secs(7 * 24 * 3600)),
        max_size: max_size.map_or(DEFAULT_JOURNAL_MAX_SIZE, |n| n as u64),
    }))
}
