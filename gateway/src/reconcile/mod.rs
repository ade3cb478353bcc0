//! Reconciliation: a channel's bill (WeChat Pay's trade bill, Alipay's
//! business detail) read by [`parse_wechatpay_bill`] or
//! [`parse_alipay_bill`], against the [journal](crate::journal)'s records.

mod bill;

pub use self::bill::{parse_alipay_bill, parse_wechatpay_bill, Bill, BillError, BillLine};

use crate::journal::{JournalOutcome, JournalRecord};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::str::FromStr;
use tower_idempotency::Outcome;

/// What is wrong with one transaction of the bill.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
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
#[non_exhaustive]
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

/// A channel whose trade bill is reconciled with the journal.
///
/// Parsed from its name (`wechatpay`, `alipay`) once, where a program reads
/// it:
///
/// ```
/// use idempotency_gateway::reconcile::{channel_presets, BillChannel};
///
/// let channel: BillChannel = "wechatpay".parse().unwrap();
/// assert_eq!(channel, BillChannel::Wechatpay);
/// assert_eq!(channel_presets(channel), ["wechatpay-v2", "wechatpay-v3"]);
/// let unknown = "paypal".parse::<BillChannel>().unwrap_err();
/// assert_eq!(
///     unknown.to_string(),
///     "unknown channel `paypal`: bills are read for wechatpay and alipay"
/// );
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BillChannel {
    /// WeChat Pay: its trade bill (交易账单, [`parse_wechatpay_bill`]),
    /// for the `wechatpay-v2` and `wechatpay-v3` presets.
    Wechatpay,
    /// Alipay: its business detail (业务明细, [`parse_alipay_bill`]),
    /// for the `alipay` preset.
    Alipay,
}

impl BillChannel {
    /// Its name: `wechatpay` or `alipay`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Wechatpay => "wechatpay",
            Self::Alipay => "alipay",
        }
    }
}

impl fmt::Display for BillChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for BillChannel {
    type Err = UnknownChannel;

    fn from_str(name: &str) -> Result<Self, UnknownChannel> {
        match name {
            "wechatpay" => Ok(Self::Wechatpay),
            "alipay" => Ok(Self::Alipay),
            _ => Err(UnknownChannel(name.into())),
        }
    }
}

/// A name that is no [`BillChannel`]'s.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownChannel(Box<str>);

impl fmt::Display for UnknownChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown channel `{}`: bills are read for wechatpay and alipay",
            self.0
        )
    }
}

impl std::error::Error for UnknownChannel {}

/// The presets whose notifications a bill of `channel` accounts for.
pub fn channel_presets(channel: BillChannel) -> &'static [&'static str] {
    match channel {
        BillChannel::Wechatpay => &["wechatpay-v2", "wechatpay-v3"],
        BillChannel::Alipay => &["alipay"],
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
    let count = |outcome: JournalOutcome| r.outcomes.get(outcome.as_str()).copied().unwrap_or(0);
    let layer = |outcome: Outcome| count(JournalOutcome::Layer(outcome));
    let n = if r.attempts > 0 {
        // On an acknowledge-then-deliver route `executed` is the copy
        // queued: it ran when a delivery attempt reached the upstream.
        count(JournalOutcome::Delivered)
    } else {
        // Copies answered 2xx ran to the end; an `executed` copy answered
        // otherwise (the upstream failed, the channel retries) is one run
        // only when none completed (records written before `completed`).
        r.completed.max(layer(Outcome::Executed).min(1))
    };
    // The first copy's call outlived the reply deadline, finished in the
    // background, and a retry was answered from its record.
    let late =
        layer(Outcome::ReplyDeadline) > 0 && layer(Outcome::Replayed) + layer(Outcome::Waited) > 0;
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
