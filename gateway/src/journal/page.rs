//! Which records a query returns, and how its answer is paged: the filter,
//! the cursor a page ends at, and the page each backend fills.

use super::{JournalError, JournalErrorKind, JournalRecord};
use std::fmt;

/// Which records [`Journal::query`](super::Journal::query) returns: all of them by default, newest
/// last, at most 1,000.
#[derive(Debug, Clone)]
pub struct JournalFilter {
    pub(super) since_ms: u64,
    until_ms: u64,
    route: Option<String>,
    outcome: Option<String>,
    key_suffix: Option<String>,
    max_records: usize,
    pub(super) after: Option<JournalCursor>,
    scan: usize,
}

impl Default for JournalFilter {
    fn default() -> Self {
        Self {
            since_ms: 0,
            until_ms: u64::MAX,
            route: None,
            outcome: None,
            key_suffix: None,
            max_records: 1000,
            after: None,
            scan: usize::MAX,
        }
    }
}

/// Where a page of [`Journal::page`](super::Journal::page) ended: the next page starts after it.
/// Written as text (`Display`, `FromStr`) for a paged API's `cursor`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalCursor {
    last_seen_ms: u64,
    key: String,
}

impl JournalCursor {
    pub(super) fn of(record: &JournalRecord) -> Self {
        Self {
            last_seen_ms: record.last_seen_ms,
            key: record.key.clone(),
        }
    }
}

impl fmt::Display for JournalCursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use base64::Engine as _;
        let key = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&self.key);
        write!(f, "{}.{key}", self.last_seen_ms)
    }
}

impl std::str::FromStr for JournalCursor {
    type Err = JournalError;

    fn from_str(s: &str) -> Result<Self, JournalError> {
        use base64::Engine as _;
        let bad = || JournalError::new(JournalErrorKind::Invalid, "not a journal cursor");
        let (ms, key) = s.split_once('.').ok_or_else(bad)?;
        let key = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(key)
            .map_err(|_| bad())?;
        Ok(Self {
            last_seen_ms: ms.parse().map_err(|_| bad())?,
            key: String::from_utf8(key).map_err(|_| bad())?,
        })
    }
}

/// One page of records ([`Journal::page`](super::Journal::page)) and where the next one starts
/// (`None`: this was the last).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct JournalPage {
    /// The records, oldest last copy first.
    pub records: Vec<JournalRecord>,
    /// Give it to [`JournalFilter::after`] for the next page.
    pub next: Option<JournalCursor>,
}

impl JournalFilter {
    /// Records whose last copy came at or after `ms` (since the Unix epoch).
    pub fn since_ms(mut self, ms: u64) -> Self {
        self.since_ms = ms;
        self
    }

    /// Records whose first copy came at or before `ms`.
    pub fn until_ms(mut self, ms: u64) -> Self {
        self.until_ms = ms;
        self
    }

    /// Records of this route only.
    pub fn route(mut self, route: impl Into<String>) -> Self {
        self.route = Some(route.into());
        self
    }

    /// Records with at least one copy that got this outcome.
    pub fn outcome(mut self, outcome: impl Into<String>) -> Self {
        self.outcome = Some(outcome.into());
        self
    }

    /// Records whose stored key ends with `suffix` (`:ID`: the keys of a
    /// channel's id on every route).
    pub fn key_suffix(mut self, suffix: impl Into<String>) -> Self {
        self.key_suffix = Some(suffix.into());
        self
    }

    /// At most this many records (a page's size: an admin API's `limit`).
    /// Defaults to 1,000.
    pub fn max_records(mut self, max: usize) -> Self {
        self.max_records = max;
        self
    }

    /// Records after the page that ended at `cursor` ([`JournalPage::next`]).
    pub fn after(mut self, cursor: JournalCursor) -> Self {
        self.after = Some(cursor);
        self
    }

    /// Looks at most this many records for a [`Journal::page`](super::Journal::page) (the page
    /// ends there, with a cursor), so that a selective filter answers in
    /// bounded time. Unbounded by default.
    pub fn scan(mut self, records: usize) -> Self {
        self.scan = records.max(1);
        self
    }

    /// Where the scan starts: the time index's first entry at or after it.
    pub(super) fn start(&self) -> (u64, &str) {
        match &self.after {
            Some(c) if c.last_seen_ms >= self.since_ms => (c.last_seen_ms, c.key.as_str()),
            _ => (self.since_ms, ""),
        }
    }

    /// Whether the entry at (`ms`, `key`) of the time index is at or
    /// before the cursor (already returned).
    pub(super) fn seen(&self, ms: u64, key: &str) -> bool {
        self.after
            .as_ref()
            .is_some_and(|c| (ms, key) <= (c.last_seen_ms, c.key.as_str()))
    }

    pub(super) fn matches(&self, r: &JournalRecord) -> bool {
        self.key_suffix
            .as_deref()
            .is_none_or(|s| r.key.ends_with(s))
            && r.last_seen_ms >= self.since_ms
            && r.first_seen_ms <= self.until_ms
            && self.route.as_deref().is_none_or(|p| r.route == p)
            && self
                .outcome
                .as_deref()
                .is_none_or(|o| r.outcomes.get(o).is_some_and(|n| *n > 0))
    }
}

/// A page being filled by a backend's scan: each record read goes through
/// [`push`](Self::push), which says when the page is full.
pub(super) struct PageBuilder<'a> {
    filter: &'a JournalFilter,
    records: Vec<JournalRecord>,
    scanned: usize,
}

impl<'a> PageBuilder<'a> {
    pub(super) fn new(filter: &'a JournalFilter) -> Self {
        Self {
            filter,
            records: Vec::new(),
            scanned: 0,
        }
    }

    /// Takes `record` if the filter matches it; the page, ending at
    /// `record`, once it holds the most records asked for or the scan has read its bound.
    pub(super) fn push(&mut self, record: JournalRecord) -> Option<JournalPage> {
        self.scanned += 1;
        let next = JournalCursor::of(&record);
        if self.filter.matches(&record) {
            self.records.push(record);
        }
        (self.records.len() >= self.filter.max_records || self.scanned >= self.filter.scan).then(
            || JournalPage {
                records: std::mem::take(&mut self.records),
                next: Some(next),
            },
        )
    }

    /// The last page: the scan found no more records.
    pub(super) fn last(self) -> JournalPage {
        JournalPage {
            records: self.records,
            next: None,
        }
    }
}
