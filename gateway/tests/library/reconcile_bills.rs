//! The channels' trade bills as their bill-download APIs serve them
//! (fixtures in `tests/fixtures/`, sources in its README), malformed copies
//! of them, and the comparison with journal records.

use idempotency_gateway::journal::JournalRecord;
use idempotency_gateway::reconcile::{
    parse_alipay_bill, parse_wechatpay_bill, reconcile, Bill, BillLine, FindingKind,
};

use test_support::verify_support::fixture;

const WECHAT: &str = "wechatpay_tradebill_wechatpay-go_TestDownloadForClient.csv";
const ALIPAY: &str = "alipay_tradebill_detail_SYNTHESIZED_gbk.csv";

#[test]
fn wechatpay_trade_bill_reads_every_paid_row() {
    let bill = parse_wechatpay_bill(&fixture(WECHAT)).unwrap();
    assert_eq!(bill.skipped, 0);
    assert_eq!(bill.lines.len(), 3);
    assert_eq!(
        bill.lines[0],
        BillLine::new(
            2,
            "4200000925202101284997714292",
            "S20210128170702357723",
            1
        )
    );
    assert_eq!(bill.lines[2].transaction_id, "4200000926202101281412639609");
    // With a BOM and CRLF line ends, as some downloads have them.
    let text = String::from_utf8(fixture(WECHAT))
        .unwrap()
        .replace('\n', "\r\n");
    let bom = [b"\xEF\xBB\xBF".as_slice(), text.as_bytes()].concat();
    assert_eq!(parse_wechatpay_bill(&bom).unwrap(), bill);
}

#[test]
fn wechatpay_refund_rows_are_skipped() {
    let text = String::from_utf8(fixture(WECHAT)).unwrap();
    let refund = text.replacen("`NATIVE,`SUCCESS,", "`NATIVE,`REFUND,", 1);
    let bill = parse_wechatpay_bill(refund.as_bytes()).unwrap();
    assert_eq!((bill.lines.len(), bill.skipped), (2, 1));
}

#[test]
fn malformed_wechatpay_bills_are_refused_with_their_line() {
    let text = String::from_utf8(fixture(WECHAT)).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let cases: Vec<(String, &str)> = vec![
        (String::new(), "empty"),
        // Cut before the summary: a truncated download.
        (lines[..3].join("\n"), "truncated"),
        // A row missing a field.
        (
            text.replacen(",`for testing,`cipher code", ",`for testing", 1),
            "line 2: 26 fields, the header has 27",
        ),
        // A row without the backticks.
        (
            text.replacen("`2021-01-28 15:35:18,", "2021-01-28 15:35:18,", 1),
            "line 3",
        ),
        // An amount that is no amount.
        (
            text.replacen("`0.00000,`1.00%,`0.01,", "`0.00000,`1.00%,`0.0x,", 1),
            "`订单金额` is not an amount",
        ),
        (
            text.replacen("`0.00000,`1.00%,`0.01,", "`0.00000,`1.00%,`0.001,", 1),
            "line 2",
        ),
        // Not a trade bill at all.
        ("a,b,c\n1,2,3\n".to_owned(), "no `微信订单号` column"),
    ];
    for (bill, expected) in cases {
        let e = parse_wechatpay_bill(bill.as_bytes())
            .unwrap_err()
            .to_string();
        assert!(e.contains(expected), "{expected:?} not in {e:?}");
    }
    // Alipay's bill given as WeChat Pay's (GBK bytes).
    let e = parse_wechatpay_bill(&fixture(ALIPAY))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no `微信订单号` column"), "{e}");
    // Arbitrary bytes: an error, never a panic.
    for cut in 0..text.len() {
        let _ = parse_wechatpay_bill(&text.as_bytes()[..cut]);
    }
}

#[test]
fn alipay_business_detail_reads_gbk_and_skips_refunds() {
    let bytes = fixture(ALIPAY);
    assert!(std::str::from_utf8(&bytes).is_err(), "the fixture is GBK");
    let bill = parse_alipay_bill(&bytes).unwrap();
    assert_eq!(bill.skipped, 1);
    assert_eq!(
        bill.lines,
        vec![
            BillLine::new(
                6,
                "2019091622001458860515315453",
                "service_1568601259302",
                1
            ),
            BillLine::new(
                8,
                "2019091622001458860515329811",
                "service_1568601555317",
                1250
            ),
        ]
    );
    // The same bill in UTF-8 with ASCII parentheses in the header.
    let (text, _, _) = encoding_rs::GBK.decode(&bytes);
    let utf8 = text.replace("订单金额（元）", "订单金额(元)");
    assert_eq!(parse_alipay_bill(utf8.as_bytes()).unwrap(), bill);
}

#[test]
fn malformed_alipay_bills_are_refused_with_their_line() {
    let raw = fixture(ALIPAY);
    let text = encoding_rs::GBK.decode(&raw).0.into_owned();
    let lines: Vec<&str> = text.lines().collect();
    let cases: Vec<(String, &str)> = vec![
        (String::new(), "no header line"),
        ("#支付宝业务明细查询\n".to_owned(), "no header line"),
        // Cut before the footer.
        (lines[..7].join("\n"), "truncated"),
        // A short row.
        (text.replacen(",0.01,0.01,0.00,", ",", 1), "line 6:"),
        (
            text.replacen("\t,0.01,0.01,", "\t,1.2.3,0.01,", 1),
            "line 6: `订单金额（元）` is not an amount",
        ),
        (
            "#支付宝账务明细查询\n账务流水号,业务流水号,商户订单号,商品名称\n#end\n".to_owned(),
            "account log (账务明细)",
        ),
        (
            String::from_utf8(fixture(WECHAT)).unwrap(),
            "no `支付宝交易号` column",
        ),
    ];
    for (bill, expected) in cases {
        let e = parse_alipay_bill(bill.as_bytes()).unwrap_err().to_string();
        assert!(e.contains(expected), "{expected:?} not in {e:?}");
    }
    for cut in 0..raw.len() {
        let _ = parse_alipay_bill(&raw[..cut]);
    }
}

/// Fields as CSV quotes them: a product name (商品名称) in double quotes
/// with a comma and a doubled quote in it is one field, and a stray `\r`
/// white space of its field, so no column moves; blank lines between rows
/// are skipped, and a row keeps its line in the file.
#[test]
fn alipay_quoted_fields_and_blank_lines_keep_columns_and_lines() {
    let raw = fixture(ALIPAY);
    let text = encoding_rs::GBK.decode(&raw).0.into_owned();
    let bill = parse_alipay_bill(&raw).unwrap();
    for name in [
        r#""下单,""测试""""#,
        "\"下单,测试\"",
        "下单\r测试",
        "下\"单",
    ] {
        let changed = text.replacen("下单测试", name, 1);
        assert_ne!(changed, text);
        assert_eq!(
            parse_alipay_bill(changed.as_bytes()).unwrap(),
            bill,
            "{name}"
        );
    }
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    let spaced = [&lines[..7].concat(), " \t\r\n\n", &lines[7..].concat()].concat();
    let got = parse_alipay_bill(spaced.as_bytes()).unwrap();
    assert_eq!(
        (got.lines[0].line, got.lines[1].line, got.skipped),
        (6, 10, 1)
    );
    // A short row after blank lines is refused with its own line.
    let short = spaced.replacen(",12.50,12.50,", ",", 1);
    assert_ne!(short, spaced);
    let e = parse_alipay_bill(short.as_bytes()).unwrap_err().to_string();
    assert!(e.starts_with("line 10: "), "{e}");
}

/// WeChat Pay quotes nothing: a comma in a product's name stays in its
/// field, since every field starts with a backtick.
#[test]
fn wechatpay_commas_inside_a_field_keep_columns() {
    let text = String::from_utf8(fixture(WECHAT)).unwrap();
    let bill = parse_wechatpay_bill(text.as_bytes()).unwrap();
    let commas = text.replace("`for testing,", "`for, \"testing\",");
    assert_ne!(commas, text);
    assert_eq!(parse_wechatpay_bill(commas.as_bytes()).unwrap(), bill);
}

/// A record of the journal: `executed` copies, the business ids.
fn record(
    key: &str,
    preset: &str,
    id: &str,
    amount: i64,
    state: &str,
    executed: u64,
) -> JournalRecord {
    serde_json::from_value(serde_json::json!({
        "key": key, "preset": preset, "route": "/notify", "first_seen_ms": 1,
        "last_seen_ms": 2, "copies": executed + 1,
        "outcomes": { "executed": executed, "replayed": 1 },
        "last_status": 200, "upstream_status": 200, "upstream_ms": 3, "attempts": 0,
        "verified": true, "completed": executed.min(1),
        "transaction_id": id, "out_trade_no": format!("order-{id}"),
        "amount_minor": amount, "trade_state": state,
    }))
    .unwrap()
}

fn line(n: usize, id: &str, amount: i64) -> BillLine {
    BillLine::new(n, id, format!("order-{id}"), amount)
}

#[test]
fn reconcile_finds_what_never_ran_ran_twice_or_ran_with_another_amount() {
    let bill = Bill::new(
        vec![
            line(2, "ok", 100),
            line(3, "missing", 100),
            line(4, "twice", 100),
            line(5, "other-amount", 100),
            line(6, "finished", 100),
            line(7, "refunded", 100),
        ],
        0,
    );
    let alipay = "alipay";
    let records = vec![
        record("k-ok", alipay, "ok", 100, "TRADE_SUCCESS", 1),
        record("k-twice-1", alipay, "twice", 100, "TRADE_SUCCESS", 1),
        record("k-twice-2", alipay, "twice", 100, "TRADE_SUCCESS", 1),
        record("k-other", alipay, "other-amount", 99, "TRADE_SUCCESS", 1),
        // Success then finished: two notifications of one payment.
        record("k-fin-1", alipay, "finished", 100, "TRADE_SUCCESS", 1),
        record("k-fin-2", alipay, "finished", 100, "TRADE_FINISHED", 1),
        // A refund notification is no second run.
        record("k-ref-1", alipay, "refunded", 100, "TRADE_SUCCESS", 1),
        record("k-ref-2", alipay, "refunded", 100, "REFUND", 1),
        // Copies that never ran do not count, nor another channel's records.
        record("k-missing", alipay, "missing", 100, "TRADE_SUCCESS", 0),
        record("k-wx", "wechatpay-v2", "missing", 100, "SUCCESS", 1),
    ];
    let found = reconcile(&bill, &records, &["alipay"]);
    let kinds: Vec<(&str, FindingKind)> = found
        .iter()
        .map(|f| (f.transaction_id.as_str(), f.kind))
        .collect();
    assert_eq!(
        kinds,
        vec![
            ("missing", FindingKind::NeverRan),
            ("twice", FindingKind::RanMoreThanOnce),
            ("other-amount", FindingKind::AmountDiffers),
        ]
    );
    assert_eq!(found[1].runs, 2);
    assert_eq!(found[1].keys, vec!["k-twice-1", "k-twice-2"]);
    assert_eq!(found[2].journal_amounts_minor, vec![99]);
    // Every record as the bill says: clean.
    let clean = Bill::new(vec![line(2, "ok", 100)], 0);
    assert!(reconcile(&clean, &records, &["alipay"]).is_empty());
}

/// On an acknowledge-then-deliver route the copy queued is `executed`; it
/// ran once a delivery reached the upstream.
#[test]
fn a_queued_notification_whose_deliveries_all_failed_never_ran() {
    let bill = Bill::new(vec![line(2, "failed", 100), line(3, "delivered", 100)], 0);
    let with_attempts = |key: &str, id: &str, outcomes: serde_json::Value| {
        let mut r = record(key, "wechatpay-v2", id, 100, "SUCCESS", 1);
        r.outcomes = serde_json::from_value(outcomes).unwrap();
        r.attempts = 3;
        r
    };
    let records = vec![
        with_attempts(
            "k1",
            "failed",
            serde_json::json!({"executed": 1, "delivery_failed": 3}),
        ),
        with_attempts(
            "k2",
            "delivered",
            serde_json::json!({"executed": 1, "delivery_failed": 2, "delivered": 1}),
        ),
    ];
    let found = reconcile(&bill, &records, &["wechatpay-v2"]);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(
        (found[0].kind, found[0].transaction_id.as_str()),
        (FindingKind::NeverRan, "failed")
    );
}

/// A copy whose call outlived the reply deadline got the retryable answer;
/// the call finished in the background and the retry was replayed: it ran.
#[test]
fn a_call_that_outlived_the_reply_deadline_and_was_replayed_ran() {
    let bill = Bill::new(vec![line(2, "late", 100), line(3, "late-lost", 100)], 0);
    let with = |key: &str, id: &str, outcomes: serde_json::Value| {
        let mut r = record(key, "wechatpay-v2", id, 100, "SUCCESS", 0);
        r.outcomes = serde_json::from_value(outcomes).unwrap();
        r
    };
    let records = vec![
        with(
            "k1",
            "late",
            serde_json::json!({"reply_deadline": 1, "replayed": 2}),
        ),
        // Past the deadline and never answered from a record: not known to run.
        with(
            "k2",
            "late-lost",
            serde_json::json!({"reply_deadline": 1, "completion_abandoned": 1}),
        ),
    ];
    let found = reconcile(&bill, &records, &["wechatpay-v2"]);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(
        (found[0].kind, found[0].transaction_id.as_str()),
        (FindingKind::NeverRan, "late-lost")
    );
}

/// A record from a sender nobody verified (an `auto` route) is no proof
/// that the payment ran: reported as `unverified_only`, not as clean, and
/// beside a verified run it changes nothing. One stored key that ran on two
/// instances (`completed` 2) ran twice; one whose first run failed did not.
#[test]
fn unverified_records_are_no_proof_and_a_key_that_completed_twice_ran_twice() {
    let bill = Bill::new(
        vec![
            line(2, "forged", 100),
            line(3, "both", 100),
            line(4, "two-instances", 100),
            line(5, "retried", 100),
        ],
        0,
    );
    let unverified = |key: &str, id: &str| {
        let mut r = record(key, "wechatpay-v2", id, 100, "SUCCESS", 1);
        r.verified = false;
        r.route = "/".into();
        r
    };
    let mut twice = record("k-2i", "wechatpay-v2", "two-instances", 100, "SUCCESS", 2);
    twice.completed = 2;
    let mut retried = record("k-re", "wechatpay-v2", "retried", 100, "SUCCESS", 2);
    retried.completed = 1;
    let records = vec![
        unverified("k-forged", "forged"),
        unverified("k-both-forged", "both"),
        record("k-both", "wechatpay-v2", "both", 100, "SUCCESS", 1),
        twice,
        retried,
    ];
    let found = reconcile(&bill, &records, &["wechatpay-v2"]);
    let kinds: Vec<(&str, FindingKind, usize)> = found
        .iter()
        .map(|f| (f.transaction_id.as_str(), f.kind, f.runs))
        .collect();
    assert_eq!(
        kinds,
        vec![
            ("forged", FindingKind::UnverifiedOnly, 1),
            ("two-instances", FindingKind::RanMoreThanOnce, 2),
        ]
    );
    assert_eq!(found[0].routes, vec!["/"]);
    assert_eq!(FindingKind::UnverifiedOnly.as_str(), "unverified_only");
}

#[test]
fn old_journal_records_without_business_ids_still_read() {
    // A record as journals before business ids wrote it.
    let old = r#"{"key":"k","preset":"stripe","route":"/r","first_seen_ms":1,"last_seen_ms":2,
        "copies":1,"outcomes":{"executed":1},"last_status":200,"upstream_status":200,
        "upstream_ms":3,"attempts":0}"#;
    let r: JournalRecord = serde_json::from_str(old).unwrap();
    assert_eq!(
        (r.transaction_id, r.body, r.body_truncated),
        (None, None, false)
    );
    // Written before the journal knew who was verified: not verified.
    assert!(!r.verified);
}
