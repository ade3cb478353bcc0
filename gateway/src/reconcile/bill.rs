//! The channels' downloaded trade bills, as their bill-download APIs
//! document them: WeChat Pay's trade bill (交易账单, `tradebill` /
//! `downloadbill`) and Alipay's business detail (业务明细, the
//! `…_业务明细.csv` of `alipay.data.dataservice.bill.downloadurl.query`
//! with `bill_type=trade`).

use crate::journal::parse_yuan;
use encoding_rs::GBK;
use std::borrow::Cow;
use std::fmt;

/// One paid transaction of a bill.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BillLine {
    /// Its line in the file, from 1.
    pub line: usize,
    /// The channel's transaction id (微信订单号, 支付宝交易号).
    pub transaction_id: String,
    /// The merchant's order number (商户订单号).
    pub out_trade_no: String,
    /// The order's amount in minor units (订单金额, 订单金额（元）).
    pub amount_minor: i64,
}

/// The paid transactions of a bill; refunds and other rows are skipped.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Bill {
    /// The paid transactions, in the file's order.
    pub lines: Vec<BillLine>,
    /// Rows that are no payment (refunds, revoked or closed trades).
    pub skipped: usize,
}

/// Why a bill could not be read: the line (0 for the whole file) and the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BillError {
    /// The line, from 1; 0 when the file as a whole is wrong.
    pub line: usize,
    /// What is wrong.
    pub message: String,
}

impl BillLine {
    /// The bill's line `line` (1-based, as an editor counts): transaction
    /// `transaction_id` of order `out_trade_no`, paid `amount_minor`
    /// (minor units, fen).
    pub fn new(
        line: usize,
        transaction_id: impl Into<String>,
        out_trade_no: impl Into<String>,
        amount_minor: i64,
    ) -> Self {
        Self {
            line,
            transaction_id: transaction_id.into(),
            out_trade_no: out_trade_no.into(),
            amount_minor,
        }
    }
}

impl Bill {
    /// A bill of `lines`, `skipped` other rows not read.
    pub fn new(lines: Vec<BillLine>, skipped: usize) -> Self {
        Self { lines, skipped }
    }
}

impl fmt::Display for BillError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            0 => f.write_str(&self.message),
            n => write!(f, "line {n}: {}", self.message),
        }
    }
}

impl std::error::Error for BillError {}

fn fail(line: usize, message: impl Into<String>) -> BillError {
    BillError {
        line,
        message: message.into(),
    }
}

/// The text of a bill: UTF-8 (a BOM dropped), else GBK as Alipay writes it.
fn text(bytes: &[u8]) -> Cow<'_, str> {
    let bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    match std::str::from_utf8(bytes) {
        Ok(s) => Cow::Borrowed(s),
        Err(_) => GBK.decode_without_bom_handling(bytes).0,
    }
}

/// The columns of a header line, and where the wanted ones are.
struct Columns {
    names: Vec<String>,
}

impl Columns {
    fn new(csv: &mut Csv, header: &str) -> Self {
        let names = csv
            .fields(header)
            .iter()
            .map(|n| n.trim().trim_start_matches('`').to_owned())
            .collect();
        Self { names }
    }

    /// The first of `names` the header has.
    fn find(&self, names: &[&str]) -> Option<usize> {
        names
            .iter()
            .find_map(|want| self.names.iter().position(|n| n == want))
    }

    fn need(&self, line: usize, names: &[&str]) -> Result<usize, BillError> {
        self.find(names)
            .ok_or_else(|| fail(line, format!("the header has no `{}` column", names[0])))
    }
}

/// Reads the fields of one line of a bill with the `csv` crate (RFC 4180:
/// a field in double quotes may hold commas, `""` in it is a quote).
///
/// A line at a time, not the file as one CSV: the bills' comment, header
/// and summary lines are no CSV rows (a quote in a comment would run on
/// into the rows), a row is reported by its line in the file (a record's
/// position from the csv crate is where its read began, before the blank
/// lines it skipped), and a row ends at its line's end.
struct Csv {
    builder: csv::ReaderBuilder,
    record: csv::StringRecord,
}

impl Csv {
    fn new() -> Self {
        let mut builder = csv::ReaderBuilder::new();
        builder
            .has_headers(false)
            .flexible(true)
            // Only `\n` ends a record, and a line has none: a stray `\r` is
            // a field's (white space, trimmed), as it always was.
            .terminator(csv::Terminator::Any(b'\n'));
        Self {
            builder,
            record: csv::StringRecord::new(),
        }
    }

    /// The fields of `line` (one empty field for an empty line).
    fn fields(&mut self, line: &str) -> &csv::StringRecord {
        let mut reader = self
            .builder
            .buffer_capacity(line.len().max(1))
            .from_reader(line.as_bytes());
        // From a `&str` nothing fails (no I/O, and fields cut at ASCII
        // commas and quotes are UTF-8): a failure reads as no fields.
        if !matches!(reader.read_record(&mut self.record), Ok(true)) {
            self.record.clear();
        }
        if self.record.is_empty() {
            self.record.push_field("");
        }
        &self.record
    }
}

fn amount(line: usize, column: &str, raw: &str) -> Result<i64, BillError> {
    parse_yuan(raw).ok_or_else(|| {
        fail(
            line,
            format!("`{column}` is not an amount in yuan: `{raw}`"),
        )
    })
}

/// Reads a WeChat Pay trade bill (交易账单): a header line (交易时间,公众账号ID,
/// …,微信订单号,商户订单号,…,交易状态,…,订单金额,…), one row per trade with
/// every field prefixed with a backtick, then the summary (总交易单数,… and a
/// line of totals). Rows with 交易状态 `SUCCESS` are payments; the amount is
/// 订单金额 (the notification's `total_fee`), or 应结订单金额 in bills
/// without it. A file without the summary is refused as truncated.
pub fn parse_wechatpay_bill(bytes: &[u8]) -> Result<Bill, BillError> {
    let text = text(bytes);
    let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l));
    let Some((at, header)) = lines.by_ref().find(|(_, l)| !l.trim().is_empty()) else {
        return Err(fail(0, "the bill is empty"));
    };
    let columns = Columns::new(&mut Csv::new(), header);
    let id = columns.need(at, &["微信订单号"])?;
    let order = columns.need(at, &["商户订单号"])?;
    let state = columns.need(at, &["交易状态"])?;
    let total = columns.need(at, &["订单金额", "应结订单金额"])?;
    let total_name = columns.names[total].clone();
    let mut bill = Bill::default();
    let mut summary = false;
    for (n, line) in lines.by_ref() {
        if line.trim().is_empty() {
            continue;
        }
        if line.starts_with("总交易单数") {
            summary = true;
            break;
        }
        let Some(row) = line.strip_prefix('`') else {
            return Err(fail(n, "a trade row's fields start with a backtick (`)"));
        };
        // Split by hand, not by the csv crate: WeChat Pay quotes nothing,
        // and the separator is the two bytes ",`" (every field starts with
        // a backtick), so that a comma in a product's name (商品名称) stays
        // in its field; a delimiter of one byte would split it.
        let fields: Vec<&str> = row.split(",`").map(str::trim).collect();
        if fields.len() != columns.names.len() {
            return Err(fail(
                n,
                format!(
                    "{} fields, the header has {}",
                    fields.len(),
                    columns.names.len()
                ),
            ));
        }
        if fields[state] != "SUCCESS" {
            bill.skipped += 1;
            continue;
        }
        if fields[id].is_empty() {
            return Err(fail(n, "a paid row without 微信订单号"));
        }
        bill.lines.push(BillLine {
            line: n,
            transaction_id: fields[id].to_owned(),
            out_trade_no: fields[order].to_owned(),
            amount_minor: amount(n, &total_name, fields[total])?,
        });
    }
    if !summary {
        return Err(fail(
            0,
            "no summary line (总交易单数,…): the bill is truncated or not a WeChat Pay trade bill",
        ));
    }
    Ok(bill)
}

/// Reads an Alipay business detail bill (业务明细), GBK or UTF-8: `#` comment
/// lines around it (#支付宝业务明细查询, #账号, #起始日期, the list's start and
/// end markers, #交易合计, #导出时间), a header line (支付宝交易号,商户订单号,
/// 业务类型,…,订单金额（元）,…), one row per trade, fields padded with tabs.
/// Rows with 业务类型 `交易` are payments. A file whose rows are not followed
/// by a `#` footer line is refused as truncated.
pub fn parse_alipay_bill(bytes: &[u8]) -> Result<Bill, BillError> {
    let text = text(bytes);
    let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l));
    let Some((at, header)) = lines
        .by_ref()
        .find(|(_, l)| !l.trim().is_empty() && !l.starts_with('#'))
    else {
        return Err(fail(
            0,
            "no header line: the bill is empty or not an Alipay bill",
        ));
    };
    let mut csv = Csv::new();
    let columns = Columns::new(&mut csv, header);
    if columns.find(&["支付宝交易号"]).is_none() && columns.find(&["账务流水号"]).is_some()
    {
        return Err(fail(
            at,
            "this is an account log (账务明细); reconcile the business detail \
             (业务明细, bill_type=trade)",
        ));
    }
    let id = columns.need(at, &["支付宝交易号"])?;
    let order = columns.need(at, &["商户订单号"])?;
    let kind = columns.need(at, &["业务类型"])?;
    let total = columns.need(at, &["订单金额（元）", "订单金额(元)"])?;
    let total_name = columns.names[total].clone();
    let mut bill = Bill::default();
    let mut footer = false;
    for (n, line) in lines.by_ref() {
        if line.starts_with('#') {
            footer = true;
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        let fields = csv.fields(line);
        if fields.len() < columns.names.len() {
            return Err(fail(
                n,
                format!(
                    "{} fields, the header has {}",
                    fields.len(),
                    columns.names.len()
                ),
            ));
        }
        let field = |i: usize| fields.get(i).unwrap_or_default().trim();
        if field(kind) != "交易" {
            bill.skipped += 1;
            continue;
        }
        if field(id).is_empty() {
            return Err(fail(n, "a trade row without 支付宝交易号"));
        }
        bill.lines.push(BillLine {
            line: n,
            transaction_id: field(id).to_owned(),
            out_trade_no: field(order).to_owned(),
            amount_minor: amount(n, &total_name, field(total))?,
        });
    }
    if !footer {
        return Err(fail(
            0,
            "no `#` footer after the rows (#----…业务明细列表结束…): the bill is truncated",
        ));
    }
    Ok(bill)
}
