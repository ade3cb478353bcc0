//! `idempotency-gateway reconcile --bill FILE --channel wechatpay|alipay`: the channel's
//! downloaded trade bill against the running gateway's journal (read
//! through its admin API, like `idempotency-gateway journal`). Exit 0 when every paid
//! transaction ran exactly once with the bill's amount, 1 when some did not
//! (each printed), 2 when the bill or the journal cannot be read.

use crate::commands::client::{call_ok, Format, Target};
use clap::{Args, ValueEnum};
use http::Method;
use idempotency_gateway::journal::{format_yuan, JournalRecord};
use idempotency_gateway::reconcile::{
    channel_presets, parse_alipay_bill, parse_wechatpay_bill, reconcile, Bill, BillChannel, Finding,
};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// `idempotency-gateway reconcile`.
#[derive(Args, Debug, Clone)]
pub(crate) struct Reconcile {
    /// The trade bill as downloaded from the channel (WeChat Pay 交易账单 CSV, Alipay
    /// 业务明细 CSV in GBK or UTF-8)
    #[arg(long, value_name = "FILE")]
    bill: PathBuf,
    /// The channel that wrote the bill
    #[arg(long, value_enum)]
    channel: Channel,
    /// Only journal records whose last copy came at or after T (RFC 3339, or ms since the epoch)
    #[arg(long, value_name = "T")]
    since: Option<String>,
    /// Only journal records whose first copy came at or before T
    #[arg(long, value_name = "T")]
    until: Option<String>,
    /// The most journal records read
    #[arg(long, value_name = "N", default_value_t = 1_000_000)]
    limit: usize,
    #[command(flatten)]
    target: Target,
}

/// `--channel`: clap parses it (its `--help` lists the values), the
/// library's [`BillChannel`] is what it means.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum Channel {
    Wechatpay,
    Alipay,
}

impl From<Channel> for BillChannel {
    fn from(channel: Channel) -> Self {
        match channel {
            Channel::Wechatpay => Self::Wechatpay,
            Channel::Alipay => Self::Alipay,
        }
    }
}

/// Reads the bill and the journal, prints what does not match.
pub(crate) fn run(
    a: &Reconcile,
    token_file: &Path,
    metrics_listen: &crate::commands::client::AdminAt,
) -> ExitCode {
    let unreadable = |msg: String| {
        eprintln!("idempotency-gateway: {msg}");
        ExitCode::from(2)
    };
    let bill = match read_bill(a) {
        Ok(bill) => bill,
        Err(msg) => return unreadable(msg),
    };
    let records = match journal(a, token_file, metrics_listen) {
        Ok(records) => records,
        Err(msg) => return unreadable(format!("cannot read the journal: {msg}")),
    };
    let findings = reconcile(&bill, &records, channel_presets(a.channel.into()));
    if let Err(e) = print(a, &bill, &findings) {
        return unreadable(format!("cannot write to stdout: {e}"));
    }
    if findings.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn read_bill(a: &Reconcile) -> Result<Bill, String> {
    let bytes = std::fs::read(&a.bill)
        .map_err(|e| format!("cannot read the bill {}: {e}", a.bill.display()))?;
    let parsed = match a.channel {
        Channel::Wechatpay => parse_wechatpay_bill(&bytes),
        Channel::Alipay => parse_alipay_bill(&bytes),
    };
    parsed.map_err(|e| {
        format!(
            "the bill {} is not a readable {} bill: {e}",
            a.bill.display(),
            BillChannel::from(a.channel),
        )
    })
}

fn journal(
    a: &Reconcile,
    token_file: &Path,
    metrics_listen: &crate::commands::client::AdminAt,
) -> Result<Vec<JournalRecord>, String> {
    let token = crate::admin::listener::read_token(token_file)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    let target = a.target.resolve(metrics_listen);
    // A page of at most 1,000 records at a time, each kept once parsed; a
    // record that got a copy while the pages were read comes again later
    // (the later one is newer).
    let mut by_key: HashMap<String, JournalRecord> = HashMap::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut q = form_urlencoded::Serializer::new(String::new());
        q.append_pair("limit", &crate::admin::api::MAX_LIMIT.to_string());
        if let Some(since) = &a.since {
            q.append_pair("since", since);
        }
        if let Some(until) = &a.until {
            q.append_pair("until", until);
        }
        if let Some(cursor) = &cursor {
            q.append_pair("cursor", cursor);
        }
        let path = format!("/admin/journal?{}", q.finish());
        let (_, mut json) = rt.block_on(call_ok(&target, &token, Method::GET, &path))?;
        let records = match json["records"].take() {
            Value::Array(records) => records,
            _ => Vec::new(),
        };
        for r in records {
            let record: JournalRecord =
                serde_json::from_value(r).map_err(|e| format!("a journal record: {e}"))?;
            by_key.insert(record.key.clone(), record);
        }
        if by_key.len() > a.limit {
            return Err(format!(
                "the journal has more than --limit {} records: raise it, or narrow with --since/--until",
                a.limit
            ));
        }
        cursor = json["next_cursor"].as_str().map(str::to_owned);
        if cursor.is_none() {
            let mut records: Vec<JournalRecord> = by_key.into_values().collect();
            records.sort_by(|a, b| (a.first_seen_ms, &a.key).cmp(&(b.first_seen_ms, &b.key)));
            return Ok(records);
        }
    }
}

fn finding_json(f: &Finding) -> Value {
    let mut v = serde_json::to_value(f).unwrap_or(Value::Null);
    v["bill_amount"] = json!(format_yuan(f.bill_amount_minor));
    v
}

fn print(a: &Reconcile, bill: &Bill, findings: &[Finding]) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    if a.target.format == Format::Json {
        let findings: Vec<Value> = findings.iter().map(finding_json).collect();
        let report = json!({
            "channel": BillChannel::from(a.channel).as_str(),
            "paid": bill.lines.len(),
            "skipped": bill.skipped,
            "findings": findings,
        });
        return writeln!(out, "{report}");
    }
    if !findings.is_empty() {
        writeln!(
            out,
            "{:<20} {:>6}  {:<32} {:<32} {:>10} {:>10} {:>4}",
            "FINDING", "LINE", "TRANSACTION", "ORDER", "BILL", "JOURNAL", "RUNS"
        )?;
    }
    for f in findings {
        let journal: Vec<String> = f
            .journal_amounts_minor
            .iter()
            .map(|m| format_yuan(*m))
            .collect();
        let journal = if journal.is_empty() {
            "-".to_owned()
        } else {
            journal.join("/")
        };
        writeln!(
            out,
            "{:<20} {:>6}  {:<32} {:<32} {:>10} {:>10} {:>4}",
            f.kind.as_str(),
            f.line,
            crate::commands::escape::shown(&f.transaction_id),
            crate::commands::escape::shown(&f.out_trade_no),
            format_yuan(f.bill_amount_minor),
            journal,
            f.runs
        )?;
    }
    match findings.len() {
        0 => writeln!(
            out,
            "clean: each of the bill's {} paid transactions ran once with its amount ({} other rows skipped)",
            bill.lines.len(),
            bill.skipped
        ),
        n => writeln!(
            out,
            "{n} findings in the bill's {} paid transactions ({} other rows skipped)",
            bill.lines.len(),
            bill.skipped
        ),
    }
}
