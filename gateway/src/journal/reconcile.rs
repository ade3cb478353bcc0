//! Reconciliation: a channel's bill against the journal.

use super::bill::{Bill, BillLine};
use super::JournalRecord;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};

/// What is wrong with one transaction of the bill.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FindingKind {
    /// The channel says it was paid; no notification of it ran.
    NeverRan,
    /// Two distinct notifications of it, with the same trade state, ran.
    RanMoreThanOnce,
    /// A notification of it ran with another amount than the bill's.
    AmountDiffers,
    /// No verified notification of it ran, but records from senders
    /// nobody verified (an `auto` or unverified route) say it did: anyone
    /// can make those, so they are no proof that it ran.
    UnverifiedOnly,
}

impl FindingKind {
    /// The kind as written in reports (`never_ran`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NeverRan => "never_ran",
            Self::RanMoreThanOnce => "ran_more_than_once",
            Self::AmountDiffers => "amount_differs",
            Self::UnverifiedOnly => "unverified_only",
        }
    }
}

/// One transaction the journal does not account for as the bill does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// What is wrong.
    pub kind: FindingKind,
    /// The bill's line.
    pub line: usize,
    /// The channel's transaction id.
    pub transaction_id: String,
    /// The merchant's order number.
    pub out_trade_no: String,
    /// The bill's amount, in minor units.
    pub bill_amount_minor: i64,
    /// The amounts the notifications that ran carried, in minor units.
    pub journal_amounts_minor: Vec<i64>,
    /// How many times notifications of it ran (a stored key that ran on
    /// two instances counts twice).
    pub runs: usize,
    /// Their stored keys.
    pub keys: Vec<String>,
    /// The routes they came in on.
    pub routes: Vec<String>,
}

/// The presets whose notifications a bill of `channel` (`wechatpay` or
/// `alipay`) accounts for.
pub fn channel_presets(channel: &str) -> &'static [&'static str] {
    match channel {
        "wechatpay" => &["wechatpay-v2", "wechatpay-v3"],
        "alipay" => &["alipay"],
        _ => &[],
    }
}

/// Compares `bill` with the journal's `records` of the bill's channel
/// (`presets`, from [`channel_presets`]): every paid transaction must have
/// run exactly once, with the bill's amount. A record "ran" when a copy of
/// it got the outcome `executed` (on an acknowledge-then-deliver route, when
/// a delivery attempt ended `delivered`, or none was made yet), or when
/// a copy's call outlived the reply deadline (`reply_deadline`) and a later
/// copy was `replayed` or `waited`: the call finished in the background and
/// its success was recorded; it ran as many times as it was `executed` (or
/// `delivered`): one stored key that two instances ran is a second run. It
/// is the transaction's when its `transaction_id` is the bill's (or,
/// lacking one, its `out_trade_no`), and only records of a successful
/// payment count (a refund notification is no second run). Only records of
/// a verified sender count; a transaction that only unverified records
/// account for is reported [`FindingKind::UnverifiedOnly`]. Amounts are
/// compared exactly, in minor units. Findings come in the bill's order; a
/// transaction may have several.
pub fn reconcile(bill: &Bill, records: &[JournalRecord], presets: &[&str]) -> Vec<Finding> {
    let mut verified = Index::default();
    let mut unverified = Index::default();
    for r in records {
        let paid = r
            .trade_state
            .as_deref()
            .is_none_or(|s| matches!(s, "SUCCESS" | "TRADE_SUCCESS" | "TRADE_FINISHED"));
        if !(paid && runs(r) > 0 && presets.contains(&r.preset.as_str())) {
            continue;
        }
        let index = if r.verified {
            &mut verified
        } else {
            &mut unverified
        };
        index.add(r);
    }
    let mut findings = Vec::new();
    for line in &bill.lines {
        let ran = verified.of(line);
        if ran.is_empty() {
            let look_alikes = unverified.of(line);
            if !look_alikes.is_empty() {
                findings.push(finding(FindingKind::UnverifiedOnly, line, &look_alikes));
                continue;
            }
        }
        findings.extend(check(line, &ran));
    }
    findings
}

/// How many times the notification of `r` ran.
fn runs(r: &JournalRecord) -> usize {
    let count = |outcome: &str| r.outcomes.get(outcome).copied().unwrap_or(0);
    let n = if r.attempts > 0 {
        // On an acknowledge-then-deliver route `executed` is the copy
        // queued: it ran when a delivery attempt reached the upstream.
        count("delivered")
    } else {
        // Copies answered 2xx ran to the end; an `executed` copy answered
        // otherwise (the upstream failed, the channel retries) is one run
        // only when none completed (records written before `completed`).
        r.completed.max(count("executed").min(1))
    };
    // The first copy's call outlived the reply deadline, finished in the
    // background, and a retry was answered from its record.
    let late = count("reply_deadline") > 0 && count("replayed") + count("waited") > 0;
    let n = if n == 0 && late { 1 } else { n };
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// The records that ran, by transaction id and by order number.
#[derive(Default)]
struct Index<'a> {
    by_id: HashMap<&'a str, Vec<&'a JournalRecord>>,
    by_order: HashMap<&'a str, Vec<&'a JournalRecord>>,
}

impl<'a> Index<'a> {
    fn add(&mut self, r: &'a JournalRecord) {
        match (&r.transaction_id, &r.out_trade_no) {
            (Some(id), _) => self.by_id.entry(id).or_default().push(r),
            (None, Some(order)) => self.by_order.entry(order).or_default().push(r),
            (None, None) => {}
        }
    }

    fn of(&self, line: &BillLine) -> Vec<&'a JournalRecord> {
        let mut ran = (self.by_id.get(line.transaction_id.as_str()))
            .cloned()
            .unwrap_or_default();
        if let Some(more) = self.by_order.get(line.out_trade_no.as_str()) {
            ran.extend(more.iter().copied());
        }
        ran
    }
}

fn finding(kind: FindingKind, line: &BillLine, of: &[&JournalRecord]) -> Finding {
    Finding {
        kind,
        line: line.line,
        transaction_id: line.transaction_id.clone(),
        out_trade_no: line.out_trade_no.clone(),
        bill_amount_minor: line.amount_minor,
        journal_amounts_minor: of.iter().filter_map(|r| r.amount_minor).collect(),
        runs: of.iter().map(|r| runs(r)).sum(),
        keys: of.iter().map(|r| r.key.clone()).collect(),
        routes: of.iter().map(|r| r.route.clone()).collect(),
    }
}

fn check(line: &BillLine, ran: &[&JournalRecord]) -> Vec<Finding> {
    if ran.is_empty() {
        return vec![finding(FindingKind::NeverRan, line, ran)];
    }
    let mut out = Vec::new();
    // TRADE_SUCCESS then TRADE_FINISHED are two notifications of one payment.
    let mut by_state: BTreeMap<Option<&str>, usize> = BTreeMap::new();
    for r in ran {
        *by_state.entry(r.trade_state.as_deref()).or_default() += runs(r);
    }
    if by_state.values().any(|n| *n > 1) {
        out.push(finding(FindingKind::RanMoreThanOnce, line, ran));
    }
    if ran
        .iter()
        .any(|r| r.amount_minor.is_some_and(|a| a != line.amount_minor))
    {
        out.push(finding(FindingKind::AmountDiffers, line, ran));
    }
    out
}
