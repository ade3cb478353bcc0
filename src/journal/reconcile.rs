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
}

impl FindingKind {
    /// The kind as written in reports (`never_ran`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NeverRan => "never_ran",
            Self::RanMoreThanOnce => "ran_more_than_once",
            Self::AmountDiffers => "amount_differs",
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
    /// How many distinct notifications of it ran.
    pub runs: usize,
    /// Their stored keys.
    pub keys: Vec<String>,
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
/// also a delivery attempt ended `delivered`, or none was made yet), or when
/// a copy's call outlived the reply deadline (`reply_deadline`) and a later
/// copy was `replayed` or `waited`: the call finished in the background and
/// its success was recorded; it is the transaction's when its
/// `transaction_id` is the bill's (or, lacking one, its `out_trade_no`), and
/// only records of a successful payment count (a refund notification is no
/// second run). Amounts are compared exactly, in minor units. Findings come
/// in the bill's order; a transaction may have several.
pub fn reconcile(bill: &Bill, records: &[JournalRecord], presets: &[&str]) -> Vec<Finding> {
    let mut by_id: HashMap<&str, Vec<&JournalRecord>> = HashMap::new();
    let mut by_order: HashMap<&str, Vec<&JournalRecord>> = HashMap::new();
    for r in records {
        let paid = r
            .trade_state
            .as_deref()
            .is_none_or(|s| matches!(s, "SUCCESS" | "TRADE_SUCCESS" | "TRADE_FINISHED"));
        let count = |outcome: &str| r.outcomes.get(outcome).copied().unwrap_or(0);
        // On an acknowledge-then-deliver route `executed` is the copy
        // queued: it ran once a delivery attempt reached the upstream.
        let ran = count("executed") > 0 && (r.attempts == 0 || count("delivered") > 0)
            // The first copy's call outlived the reply deadline, finished in
            // the background, and a retry was answered from its record.
            || (count("reply_deadline") > 0 && count("replayed") + count("waited") > 0);
        if !(paid && ran && presets.contains(&r.preset.as_str())) {
            continue;
        }
        match (&r.transaction_id, &r.out_trade_no) {
            (Some(id), _) => by_id.entry(id).or_default().push(r),
            (None, Some(order)) => by_order.entry(order).or_default().push(r),
            (None, None) => {}
        }
    }
    let mut findings = Vec::new();
    for line in &bill.lines {
        let mut ran: Vec<&JournalRecord> = by_id
            .get(line.transaction_id.as_str())
            .cloned()
            .unwrap_or_default();
        if let Some(more) = by_order.get(line.out_trade_no.as_str()) {
            ran.extend(more.iter().copied());
        }
        findings.extend(check(line, &ran));
    }
    findings
}

fn check(line: &BillLine, ran: &[&JournalRecord]) -> Vec<Finding> {
    let finding = |kind, of: &[&JournalRecord]| Finding {
        kind,
        line: line.line,
        transaction_id: line.transaction_id.clone(),
        out_trade_no: line.out_trade_no.clone(),
        bill_amount_minor: line.amount_minor,
        journal_amounts_minor: of.iter().filter_map(|r| r.amount_minor).collect(),
        runs: of.len(),
        keys: of.iter().map(|r| r.key.clone()).collect(),
    };
    if ran.is_empty() {
        return vec![finding(FindingKind::NeverRan, ran)];
    }
    let mut out = Vec::new();
    // TRADE_SUCCESS then TRADE_FINISHED are two notifications of one payment.
    let mut by_state: BTreeMap<Option<&str>, usize> = BTreeMap::new();
    for r in ran {
        *by_state.entry(r.trade_state.as_deref()).or_default() += 1;
    }
    if by_state.values().any(|n| *n > 1) {
        out.push(finding(FindingKind::RanMoreThanOnce, ran));
    }
    if ran
        .iter()
        .any(|r| r.amount_minor.is_some_and(|a| a != line.amount_minor))
    {
        out.push(finding(FindingKind::AmountDiffers, ran));
    }
    out
}
