//! `gateway reconcile` as an operator runs it: signed WeChat Pay v2 and
//! Alipay notifications through the gateway binary with `--journal`, then
//! the channel's downloaded bill against the journal: what never ran, what
//! ran twice, what ran with another amount is reported (exit 1); a clean
//! bill exits 0, an unreadable one 2. And `--journal-body`: the raw body in
//! the journal record, capped and marked when truncated.

use crate::gateway_support;
use test_support::common;
use test_support::support_redis;
use test_support::verify_support;

use common::upstream::Upstream;
use common::{client, free_addr, post};
use gateway_support::{gateway_bin, temp_path, Proc};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use verify_support::fixture;
use verify_support::signed::{alipay_body, wechat_sign, xml, FORM, WECHAT_KEY};

const TOKEN: &str = "s3cret-admin-token-0123456789";

struct Ops {
    gw: Proc,
    metrics: SocketAddr,
    dir: PathBuf,
}

impl Drop for Ops {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The token file, readable by its owner only (the gateway refuses others).
fn write_token(path: &Path) {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::write(path, format!("{TOKEN}\n")).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// The gateway with two WeChat Pay v2 routes (the old notify URL still
/// routed beside the new one) and an Alipay route, each verifying, and the
/// journal on.
fn start(upstream: &str, extra: &[&str]) -> Ops {
    let dir = temp_path("reconcile");
    std::fs::create_dir_all(&dir).unwrap();
    write_token(&dir.join("token"));
    std::fs::write(
        dir.join("alipay.pem"),
        fixture("alipay_gbk_test_public_key.pem"),
    )
    .unwrap();
    let wx = format!("verify = {{ api_keys = [\"{WECHAT_KEY}\"] }}");
    let config = format!(
        "listen = \"127.0.0.1:0\"\nupstream = \"{upstream}\"\n\
         [[route]]\nprefix = \"/notify/wx\"\npreset = \"wechatpay-v2\"\n{wx}\n\
         [[route]]\nprefix = \"/notify/wx-old\"\npreset = \"wechatpay-v2\"\n{wx}\n\
         [[route]]\nprefix = \"/notify/alipay\"\npreset = \"alipay\"\n\
         verify = {{ public_keys = [\"alipay.pem\"] }}\n\
         [[route]]\nprefix = \"/notify/v3\"\npreset = \"wechatpay-v3\"\n\
         verify = {{ platform_keys = {{ \"{V3_SERIAL}\" = \"alipay.pem\" }}, api_v3_key = \"{V3_KEY}\" }}\n\
         [[route]]\nprefix = \"/notify/v3-nokey\"\npreset = \"wechatpay-v3\"\n\
         verify = {{ platform_keys = {{ \"{V3_SERIAL}\" = \"alipay.pem\" }} }}\n"
    );
    start_config(&dir, &config, extra)
}

/// The gateway with the config file `config` (written into `dir`, which
/// holds the token), the journal on.
fn start_config(dir: &Path, config: &str, extra: &[&str]) -> Ops {
    let dir = dir.to_path_buf();
    std::fs::write(dir.join("gateway.toml"), config).unwrap();
    let metrics = free_addr().to_string();
    let data = dir.join("data");
    let token = dir.join("token");
    let mut args = vec![
        "--config",
        dir.join("gateway.toml").to_str().unwrap().to_owned().leak(),
        "--journal",
        "--data-dir",
        data.to_str().unwrap().to_owned().leak(),
        "--metrics-listen",
        metrics.clone().leak(),
        "--admin-token-file",
        token.to_str().unwrap().to_owned().leak(),
    ];
    args.extend_from_slice(extra);
    let gw = Proc::start(&args, &[], Stdio::inherit());
    Ops {
        gw,
        metrics: metrics.parse().unwrap(),
        dir,
    }
}

/// `gateway ARGS` against the running gateway: exit code, stdout, stderr.
fn gateway(ops: &Ops, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(gateway_bin())
        .args(args)
        .arg("--admin-token-file")
        .arg(ops.dir.join("token"))
        .arg("--admin")
        .arg(format!("http://{}", ops.metrics))
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn reconcile(ops: &Ops, bill: &Path, channel: &str, json: bool) -> (i32, String, String) {
    let bill = bill.to_str().unwrap();
    let mut args = vec!["reconcile", "--bill", bill, "--channel", channel];
    if json {
        args.extend(["--format", "json"]);
    }
    gateway(ops, &args)
}

/// A WeChat Pay v2 payment notification, signed (MD5) with the doc key.
fn wechat(transaction: &str, order: &str, fen: u32) -> String {
    let mut fields: Vec<(String, String)> = [
        ("appid", "wx2421b1c4370ec43b"),
        ("mch_id", "10000100"),
        ("nonce_str", "5d2b6c2a8db53831f7eda20af46e531c"),
        ("openid", "oUpF8uMEb4qRXf22hE3X68TekukE"),
        ("result_code", "SUCCESS"),
        ("return_code", "SUCCESS"),
        ("time_end", "20140903131540"),
        ("trade_type", "JSAPI"),
    ]
    .iter()
    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
    .collect();
    fields.push(("transaction_id".into(), transaction.into()));
    fields.push(("out_trade_no".into(), order.into()));
    fields.push(("total_fee".into(), fen.to_string()));
    let sign = wechat_sign(&fields);
    fields.push(("sign".into(), sign));
    xml(&fields)
}

/// An Alipay trade notification, signed (RSA2) with the test key.
fn alipay(notify_id: &str, trade_no: &str, order: &str, yuan: &str) -> String {
    let fields = [
        ("app_id", "2019073166072302"),
        ("charset", "utf-8"),
        ("notify_id", notify_id),
        ("notify_type", "trade_status_sync"),
        ("out_trade_no", order),
        ("subject", "测试"),
        ("total_amount", yuan),
        ("trade_no", trade_no),
        ("trade_status", "TRADE_SUCCESS"),
    ];
    alipay_body(&fields, encoding_rs::UTF_8)
}

/// The serial and APIv3 key of the WeChat Pay v3 routes; their "platform
/// key" is the public half of the Alipay test key, which signs here.
const V3_SERIAL: &str = verify_support::signed::WECHAT_V3_SERIAL;
const V3_KEY: &str = verify_support::signed::WECHAT_V3_KEY;

/// A WeChat Pay v3 payment notification: the transaction encrypted with
/// AES-256-GCM under the APIv3 key, the body signed (RSA-SHA256 over
/// `timestamp\nnonce\nbody\n`) now. Returns the headers and the body.
fn wechat_v3(
    event: &str,
    transaction: &str,
    order: &str,
    fen: u32,
) -> (Vec<(String, String)>, String) {
    let plain = format!(
        r#"{{"mchid":"1230000109","appid":"wxd678efh567hg6787","out_trade_no":"{order}","transaction_id":"{transaction}","trade_type":"JSAPI","trade_state":"SUCCESS","trade_state_desc":"支付成功","success_time":"2018-06-08T10:34:56+08:00","payer":{{"openid":"oUpF8uMuAJO_M2pxb1Q9zNjWeS6o"}},"amount":{{"total":{fen},"payer_total":{fen},"currency":"CNY","payer_currency":"CNY"}}}}"#
    );
    verify_support::signed::wechat_v3(event, &plain)
}

async fn send_v3(ops: &Ops, path: &str, (headers, body): (Vec<(String, String)>, String)) {
    let h: Vec<(&str, &str)> = headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let a = post(&client(), ops.gw.addr, path, &h, body).await;
    assert_eq!(a.status, 200, "{path}: {}", a.text());
}

async fn send(ops: &Ops, path: &str, content_type: &str, body: String) {
    let headers = [("content-type", content_type)];
    let a = post(&client(), ops.gw.addr, path, &headers, body).await;
    assert_eq!(a.status, 200, "{path}: {}", a.text());
}

/// A WeChat Pay trade bill (交易账单) with these (transaction, order, yuan) rows.
fn wechat_bill(rows: &[(&str, &str, &str)]) -> String {
    let header = "交易时间,公众账号ID,商户号,特约商户号,设备号,微信订单号,商户订单号,用户标识,\
                  交易类型,交易状态,付款银行,货币种类,应结订单金额,代金券金额,微信退款单号,\
                  商户退款单号,退款金额,充值券退款金额,退款类型,退款状态,商品名称,商户数据包,\
                  手续费,费率,订单金额,申请退款金额,费率备注";
    let mut out = format!("{header}\n");
    for (id, order, yuan) in rows {
        out += &format!(
            "`2014-09-03 13:15:40,`wx2421b1c4370ec43b,`10000100,`0,`,`{id},`{order},`oUpF8uM,\
             `JSAPI,`SUCCESS,`CFT,`CNY,`{yuan},`0.00,`0,`0,`0.00,`0.00,`,`,`测试,`,\
             `0.00000,`0.60%,`{yuan},`0.00,`\n"
        );
    }
    out += "总交易单数,应结订单总金额,退款总金额,充值券退款总金额,手续费总金额,订单总金额,申请退款总金额\n";
    out += &format!("`{},`0.00,`0.00,`0.00,`0.00000,`0.00,`0.00\n", rows.len());
    out
}

/// An Alipay business detail bill (业务明细), GBK, with these rows.
fn alipay_bill(rows: &[(&str, &str, &str)]) -> Vec<u8> {
    let mut out = String::from(
        "#支付宝业务明细查询\n#账号：[20885318916687390156]\n\
         #-----------------------------------------业务明细列表----------------------------------------\n\
         支付宝交易号,商户订单号,业务类型,商品名称,创建时间,完成时间,门店编号,门店名称,操作员,终端号,\
         对方账户,订单金额（元）,商家实收（元）,支付宝红包（元）,集分宝（元）,支付宝优惠（元）,商家优惠（元）,\
         券核销金额（元）,券名称,商家红包消费金额（元）,卡消费金额（元）,退款批次号/请求号,服务费（元）,分润（元）,备注\n",
    );
    for (id, order, yuan) in rows {
        out += &format!(
            "{id}\t,{order}\t,交易\t,测试,2019-08-15 15:56:22,2019-08-15 15:56:24,\t,\t,\t,\t,\
             xud***@126.com\t,{yuan},{yuan},0.00,0.00,0.00,0.00,0.00,,0.00\t,0.00,\t,0.00,0.00,\n"
        );
    }
    out += "#-----------------------------------------业务明细列表结束------------------------------------\n";
    out += "#导出时间：[2019年08月16日 05:00:00]\n";
    encoding_rs::GBK.encode(&out).0.into_owned()
}

fn finding<'a>(out: &'a str, kind: &str, id: &str) -> Option<&'a str> {
    out.lines().find(|l| l.starts_with(kind) && l.contains(id))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_reports_what_never_ran_ran_twice_or_ran_with_another_amount() {
    let up = Upstream::start().await;
    let ops = start(&up.url(), &[]);
    let pid = std::process::id();
    let w = |n: u32| format!("42000{pid}{n:04}");
    let (w1, w2, w3, w4) = (w(1), w(2), w(3), w(4));
    // W1 ran once (its retry replayed), W2 ran with 2 fen, W3 never came,
    // W4 came on both the new and the old notify URL: it ran twice.
    for _ in 0..2 {
        send(&ops, "/notify/wx", "text/xml", wechat(&w1, "O1", 1)).await;
    }
    send(&ops, "/notify/wx", "text/xml", wechat(&w2, "O2", 2)).await;
    send(&ops, "/notify/wx", "text/xml", wechat(&w4, "O4", 4)).await;
    send(&ops, "/notify/wx-old", "text/xml", wechat(&w4, "O4", 4)).await;
    assert_eq!(up.calls("/notify/wx") + up.calls("/notify/wx-old"), 4);

    let bill = ops.dir.join("wechat.csv");
    let rows = [
        (w1.as_str(), "O1", "0.01"),
        (w2.as_str(), "O2", "0.03"),
        (w3.as_str(), "O3", "0.03"),
        (w4.as_str(), "O4", "0.04"),
    ];
    std::fs::write(&bill, wechat_bill(&rows)).unwrap();
    let (code, out, err) = reconcile(&ops, &bill, "wechatpay", false);
    assert_eq!(code, 1, "findings exit 1: {out} {err}");
    let line = finding(&out, "amount_differs", &w2).unwrap_or_else(|| panic!("{out}"));
    assert!(line.contains("0.03") && line.contains("0.02"), "{line}");
    assert!(finding(&out, "never_ran", &w3).is_some(), "{out}");
    let line = finding(&out, "ran_more_than_once", &w4).unwrap_or_else(|| panic!("{out}"));
    assert!(line.trim_end().ends_with(" 2"), "two runs: {line}");
    assert!(!out.contains(&w1), "W1 ran once with its amount: {out}");
    assert!(
        out.contains("3 findings in the bill's 4 paid transactions"),
        "{out}"
    );

    // The same as JSON.
    let (code, out, _) = reconcile(&ops, &bill, "wechatpay", true);
    assert_eq!(code, 1);
    let json: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let kinds: Vec<(&str, &str)> = json["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["kind"].as_str().unwrap(),
                f["transaction_id"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        kinds,
        vec![
            ("amount_differs", w2.as_str()),
            ("never_ran", w3.as_str()),
            ("ran_more_than_once", w4.as_str())
        ]
    );
    assert_eq!(json["findings"][0]["bill_amount_minor"], 3);
    assert_eq!(json["findings"][0]["journal_amounts_minor"][0], 2);

    // A bill of what ran once with its amount: clean.
    std::fs::write(&bill, wechat_bill(&rows[..1])).unwrap();
    let (code, out, err) = reconcile(&ops, &bill, "wechatpay", false);
    assert_eq!(code, 0, "{out} {err}");
    assert!(out.starts_with("clean"), "{out}");

    // Alipay: two notifications (two notify ids) of A2 ran, A3 never came,
    // A4 ran with another amount.
    let a = |n: u32| format!("2019081522001{pid}{n:04}");
    let (a1, a2, a3, a4) = (a(1), a(2), a(3), a(4));
    let alipay_path = "/notify/alipay";
    send(
        &ops,
        alipay_path,
        FORM,
        alipay(&format!("N1-{pid}"), &a1, "P1", "0.10"),
    )
    .await;
    send(
        &ops,
        alipay_path,
        FORM,
        alipay(&format!("N2-{pid}"), &a2, "P2", "5.00"),
    )
    .await;
    send(
        &ops,
        alipay_path,
        FORM,
        alipay(&format!("N2b-{pid}"), &a2, "P2", "5.00"),
    )
    .await;
    send(
        &ops,
        alipay_path,
        FORM,
        alipay(&format!("N4-{pid}"), &a4, "P4", "7.00"),
    )
    .await;
    let bill = ops.dir.join("alipay.csv");
    let rows = [
        (a1.as_str(), "P1", "0.10"),
        (a2.as_str(), "P2", "5.00"),
        (a3.as_str(), "P3", "1.00"),
        (a4.as_str(), "P4", "7.01"),
    ];
    std::fs::write(&bill, alipay_bill(&rows)).unwrap();
    let (code, out, err) = reconcile(&ops, &bill, "alipay", false);
    assert_eq!(code, 1, "{out} {err}");
    assert!(finding(&out, "ran_more_than_once", &a2).is_some(), "{out}");
    assert!(finding(&out, "never_ran", &a3).is_some(), "{out}");
    assert!(finding(&out, "amount_differs", &a4).is_some(), "{out}");
    assert!(!out.contains(&a1), "{out}");
    std::fs::write(&bill, alipay_bill(&rows[..1])).unwrap();
    let (code, out, err) = reconcile(&ops, &bill, "alipay", false);
    assert_eq!(code, 0, "{out} {err}");

    // An unreadable bill: exit 2 with the reason, nothing compared.
    let mut cut = wechat_bill(&[(w1.as_str(), "O1", "0.01")]);
    cut.truncate(cut.find("总交易单数").unwrap());
    std::fs::write(&bill, cut).unwrap();
    let (code, out, err) = reconcile(&ops, &bill, "wechatpay", false);
    assert_eq!(code, 2, "{out}");
    assert!(err.contains("truncated"), "{err}");
    let (code, _, err) = reconcile(&ops, &ops.dir.join("absent.csv"), "alipay", false);
    assert_eq!(code, 2);
    assert!(err.contains("cannot read the bill"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn journal_body_keeps_the_raw_body_capped_and_marked() {
    let up = Upstream::start().await;
    let ops = start(&up.url(), &["--journal-body", "--journal-body-max", "64"]);
    let id = format!("42000{}9999", std::process::id());
    let body = wechat(&id, "O9", 9);
    assert!(body.len() > 64);
    send(&ops, "/notify/wx", "text/xml", body.clone()).await;
    let (code, out, err) = gateway(&ops, &["journal", "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    let json: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let record = json["records"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["transaction_id"] == id.as_str())
        .unwrap_or_else(|| panic!("no record of {id}: {out}"));
    use base64::Engine as _;
    let kept = base64::engine::general_purpose::STANDARD
        .decode(record["body_base64"].as_str().unwrap())
        .unwrap();
    assert_eq!(kept, body.as_bytes()[..64]);
    assert_eq!(record["body_bytes"], body.len());
    assert_eq!(record["body_truncated"], true);
    assert_eq!(record["out_trade_no"], "O9");
    assert_eq!(record["amount_minor"], 9);
    // The admin API's answer (what `--format json` prints) is as its OpenAPI file says.
    let spec_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/openapi/admin.json");
    let spec: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(spec_path).unwrap()).unwrap();
    let schema = &spec["paths"]["/admin/journal"]["get"]["responses"]["200"]["content"]
        ["application/json"]["schema"];
    let mut root = serde_json::json!({ "components": spec["components"].clone() });
    root["allOf"] = serde_json::json!([schema]);
    let validator = jsonschema::validator_for(&root).unwrap();
    let errors: Vec<String> = validator
        .iter_errors(&json)
        .map(|e| e.to_string())
        .collect();
    assert!(errors.is_empty(), "{errors:?} in {json}");
    let (code, out, err) = gateway(&ops, &["inspect", "--id", &id]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&format!("body: {}", &body[..64])), "{out}");
    assert!(out.contains("truncated"), "{out}");
}

/// Without `--journal-body` no body is kept; the flag needs the journal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_stay_out_of_the_journal_by_default() {
    let up = Upstream::start().await;
    let ops = start(&up.url(), &[]);
    let id = format!("42000{}8888", std::process::id());
    send(&ops, "/notify/wx", "text/xml", wechat(&id, "O8", 8)).await;
    let (_, out, _) = gateway(&ops, &["journal", "--format", "json"]);
    let json: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let record = json["records"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["transaction_id"] == id.as_str())
        .unwrap_or_else(|| panic!("no record of {id}: {out}"))
        .clone();
    assert!(record.get("body").is_none(), "{record}");
    // Events the journal could not take are counted on /metrics.
    let (status, metrics) = gateway_support::get(ops.metrics, "/metrics");
    assert_eq!(status, 200);
    assert!(
        metrics.contains("idempotency_journal_dropped_total 0"),
        "{metrics}"
    );
    let out = Command::new(gateway_bin())
        .args([
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:9",
        ])
        .args(["--journal-body", "--check-config"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("needs the journal"));
}

/// WeChat Pay v3 encrypts the transaction: on a route with the APIv3 key the
/// journal reads it from the decrypted resource and the bill reconciles;
/// without the key there is nothing to match, and the bill says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wechatpay_v3_reconciles_where_the_route_decrypts() {
    let up = Upstream::start().await;
    let ops = start(&up.url(), &[]);
    let pid = std::process::id();
    let (t1, t2) = (format!("42001{pid}0001"), format!("42001{pid}0002"));
    send_v3(
        &ops,
        "/notify/v3",
        wechat_v3(&format!("EV-{pid}-1"), &t1, "S1", 100),
    )
    .await;
    send_v3(
        &ops,
        "/notify/v3-nokey",
        wechat_v3(&format!("EV-{pid}-2"), &t2, "S2", 200),
    )
    .await;
    assert_eq!(up.calls("/notify/v3") + up.calls("/notify/v3-nokey"), 2);
    let bill = ops.dir.join("v3.csv");
    std::fs::write(&bill, wechat_bill(&[(t1.as_str(), "S1", "1.00")])).unwrap();
    let (code, out, err) = reconcile(&ops, &bill, "wechatpay", false);
    assert_eq!(code, 0, "decrypted, so reconciled: {out} {err}");
    std::fs::write(
        &bill,
        wechat_bill(&[(t1.as_str(), "S1", "1.00"), (t2.as_str(), "S2", "2.00")]),
    )
    .unwrap();
    let (code, out, _) = reconcile(&ops, &bill, "wechatpay", false);
    assert_eq!(code, 1, "{out}");
    assert!(finding(&out, "never_ran", &t2).is_some(), "{out}");
    assert!(!out.contains(&t1), "{out}");
}

/// With a SQL store the journal lives in its database (the table
/// `idempotency_journal`), not in the data directory: the commands and
/// reconciliation read it the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_sql_store_the_journal_is_in_its_database() {
    let up = Upstream::start().await;
    let db = temp_path("reconcile-sql.db");
    let store = format!("sqlite:{}", db.display());
    let ops = start(&up.url(), &["--store", store.clone().leak()]);
    let id = format!("42002{}0001", std::process::id());
    for _ in 0..2 {
        send(&ops, "/notify/wx", "text/xml", wechat(&id, "Q1", 5)).await;
    }
    let bill = ops.dir.join("sql.csv");
    std::fs::write(&bill, wechat_bill(&[(id.as_str(), "Q1", "0.05")])).unwrap();
    let (code, out, err) = reconcile(&ops, &bill, "wechatpay", false);
    assert_eq!(code, 0, "{out} {err}");
    let (code, out, err) = gateway(&ops, &["inspect", "--id", &id]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("2 copies (executed 1, replayed 1)"), "{out}");
    assert!(
        !ops.dir.join("data/journal.redb").exists(),
        "no redb journal beside a SQL store"
    );
    let pool = sqlx::SqlitePool::connect(&store).await.unwrap();
    let (n,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM idempotency_journal")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 1, "one row per stored key");
    pool.close().await;
    let _ = std::fs::remove_file(&db);
}

/// On an acknowledge-then-deliver route the copy queued is `executed`; a
/// notification whose every delivery failed (dead-lettered) never ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_notification_whose_deliveries_failed_never_ran() {
    let replies = common::upstream::Replies::default().status(|seen| {
        if String::from_utf8_lossy(&seen.body).contains("FAILME") {
            500
        } else {
            200
        }
    });
    let up = Upstream::with(replies).await;
    let ack = [
        "--ack-then-deliver",
        "/notify/wx",
        "--max-attempts",
        "1",
        "--retry-backoff",
        "100ms",
    ];
    let ops = start(&up.url(), &ack);
    let pid = std::process::id();
    let (ok, failed) = (format!("42003{pid}0001"), format!("42003{pid}0002"));
    send(&ops, "/notify/wx", "text/xml", wechat(&ok, "D1", 1)).await;
    send(&ops, "/notify/wx", "text/xml", wechat(&failed, "FAILME", 2)).await;
    // Both are acknowledged at once; wait for their deliveries.
    let attempted = |out: &str, id: &str| {
        let json: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        json["records"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["transaction_id"] == id && r["attempts"].as_u64().is_some_and(|n| n > 0))
    };
    let mut delivered = false;
    for _ in 0..200 {
        let (_, out, _) = gateway(&ops, &["journal", "--format", "json"]);
        if attempted(&out, &ok) && attempted(&out, &failed) {
            delivered = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(delivered, "both deliveries were attempted");
    // Each record has what the upstream answered its delivery.
    let (_, out, _) = gateway(&ops, &["journal", "--format", "json"]);
    let json: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let upstream_status = |id: &str| {
        json["records"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["transaction_id"] == id)
            .map(|r| r["upstream_status"].clone())
    };
    assert_eq!(upstream_status(&ok), Some(200.into()), "{out}");
    assert_eq!(upstream_status(&failed), Some(500.into()), "{out}");
    let bill = ops.dir.join("ack.csv");
    let rows = [
        (ok.as_str(), "D1", "0.01"),
        (failed.as_str(), "FAILME", "0.02"),
    ];
    std::fs::write(&bill, wechat_bill(&rows)).unwrap();
    let (code, out, err) = reconcile(&ops, &bill, "wechatpay", false);
    let (_, journal, _) = gateway(&ops, &["journal", "--format", "json"]);
    assert_eq!(code, 1, "{out} {err} {journal}");
    assert!(finding(&out, "never_ran", &failed).is_some(), "{out}");
    assert!(!out.contains(&ok), "{out}");
}

/// A WeChat Pay v2 notification that nobody signed, posted to an `auto`
/// route (the `/notify/wechat` route verifies WeChat Pay v3 only): it runs,
/// and its record has the sender's transaction id, amount and `SUCCESS`,
/// but it is no proof that the payment ran. The bill's rows are reported
/// `unverified_only`, and exit 1; a verified notification still reconciles.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_look_alikes_on_an_auto_route_are_unverified_only() {
    let up = Upstream::start().await;
    let dir = temp_path("reconcile-forged");
    std::fs::create_dir_all(&dir).unwrap();
    write_token(&dir.join("token"));
    std::fs::write(
        dir.join("alipay.pem"),
        fixture("alipay_gbk_test_public_key.pem"),
    )
    .unwrap();
    let config = format!(
        "listen = \"127.0.0.1:0\"\nupstream = \"{}\"\n\
         [[route]]\nprefix = \"/notify/wechat\"\npreset = \"wechatpay-v3\"\n\
         verify = {{ platform_keys = {{ \"{V3_SERIAL}\" = \"alipay.pem\" }}, api_v3_key = \"{V3_KEY}\" }}\n\
         [[route]]\nprefix = \"/\"\npreset = \"auto\"\n",
        up.url()
    );
    let ops = start_config(&dir, &config, &[]);
    let pid = std::process::id();
    let forged: Vec<String> = (1..=3).map(|n| format!("42004{pid}{n:04}")).collect();
    for (n, id) in forged.iter().enumerate() {
        // The signature is made up: nobody checks it on `auto`.
        let body = wechat(id, &format!("F{n}"), 100).replace("<sign><![CDATA[", "<sign><![CDATA[X");
        send(&ops, "/shop/anything", "text/xml", body).await;
    }
    assert_eq!(up.calls("/shop/anything"), 3, "the forged bodies ran");
    let genuine = format!("42004{pid}0009");
    send_v3(
        &ops,
        "/notify/wechat",
        wechat_v3(&format!("EV-{pid}-9"), &genuine, "G9", 100),
    )
    .await;
    let bill = ops.dir.join("forged.csv");
    let rows: Vec<(&str, &str, &str)> = vec![
        (&forged[0], "F0", "1.00"),
        (&forged[1], "F1", "1.00"),
        (&forged[2], "F2", "1.00"),
    ];
    std::fs::write(&bill, wechat_bill(&rows)).unwrap();
    let (code, out, err) = reconcile(&ops, &bill, "wechatpay", false);
    assert_eq!(code, 1, "forged records are no proof: {out} {err}");
    for id in &forged {
        let line = finding(&out, "unverified_only", id).unwrap_or_else(|| panic!("{out}"));
        assert!(
            line.trim_end().ends_with(" 1"),
            "one unverified run: {line}"
        );
    }
    let (_, out, _) = reconcile(&ops, &bill, "wechatpay", true);
    let json: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(json["findings"][0]["kind"], "unverified_only", "{json}");
    assert_eq!(json["findings"][0]["routes"][0], "/", "{json}");
    // The journal says which records were verified, and their route.
    let (_, out, _) = gateway(&ops, &["journal", "--format", "json"]);
    let json: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let records = json["records"].as_array().unwrap();
    let of = |id: &str| {
        records
            .iter()
            .find(|r| r["transaction_id"] == id)
            .unwrap_or_else(|| panic!("no record of {id}: {out}"))
            .clone()
    };
    assert_eq!(of(&forged[0])["verified"], false, "{out}");
    assert_eq!(of(&forged[0])["route"], "/", "{out}");
    assert_eq!(of(&genuine)["verified"], true, "{out}");
    assert_eq!(of(&genuine)["route"], "/notify/wechat", "{out}");
    // The verified notification reconciles.
    std::fs::write(&bill, wechat_bill(&[(genuine.as_str(), "G9", "1.00")])).unwrap();
    let (code, out, err) = reconcile(&ops, &bill, "wechatpay", false);
    assert_eq!(code, 0, "{out} {err}");
}

/// Two gateways on one Redis share one journal (in Redis): a notification
/// handled by each is seen by reconcile through either, and a key that ran
/// on both (forgotten on one, then sent to the other) ran twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_on_one_redis_share_one_journal() {
    if !support_redis::redis_available() {
        eprintln!("SKIPPED: no redis-server on this machine");
        return;
    }
    let redis = support_redis::RedisServer::start();
    let up = Upstream::start().await;
    let url = redis.url();
    let a = start(&up.url(), &["--store", url.clone().leak()]);
    let b = start(&up.url(), &["--store", url.clone().leak()]);
    let pid = std::process::id();
    let (w1, w2, w3) = (
        format!("42005{pid}0001"),
        format!("42005{pid}0002"),
        format!("42005{pid}0003"),
    );
    send(&a, "/notify/wx", "text/xml", wechat(&w1, "R1", 1)).await;
    send(&b, "/notify/wx", "text/xml", wechat(&w2, "R2", 2)).await;
    // A copy of W1 to the other instance is a replay: still one run.
    send(&b, "/notify/wx", "text/xml", wechat(&w1, "R1", 1)).await;
    assert_eq!(up.calls("/notify/wx"), 2);
    let bill = a.dir.join("shared.csv");
    let rows = [(w1.as_str(), "R1", "0.01"), (w2.as_str(), "R2", "0.02")];
    std::fs::write(&bill, wechat_bill(&rows)).unwrap();
    for ops in [&a, &b] {
        let (code, out, err) = reconcile(ops, &bill, "wechatpay", false);
        assert_eq!(code, 0, "each instance sees both: {out} {err}");
    }
    let (code, out, err) = gateway(&a, &["inspect", "--id", &w1]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("2 copies (executed 1, replayed 1)"), "{out}");
    // W3 runs on A, is forgotten, and runs again on B: ran twice.
    send(&a, "/notify/wx", "text/xml", wechat(&w3, "R3", 3)).await;
    let key = out
        .lines()
        .find_map(|l| l.strip_prefix("key: "))
        .unwrap()
        .replace(&w1, &w3);
    let (code, _, err) = gateway(&a, &["forget", &key]);
    assert_eq!(code, 0, "{key}: {err}");
    send(&b, "/notify/wx", "text/xml", wechat(&w3, "R3", 3)).await;
    assert_eq!(up.calls("/notify/wx"), 4);
    std::fs::write(&bill, wechat_bill(&[(w3.as_str(), "R3", "0.03")])).unwrap();
    let (code, out, err) = reconcile(&a, &bill, "wechatpay", false);
    assert_eq!(code, 1, "{out} {err}");
    let line = finding(&out, "ran_more_than_once", &w3).unwrap_or_else(|| panic!("{out}"));
    assert!(
        line.trim_end().ends_with(" 2"),
        "two runs of one key: {line}"
    );
    assert!(
        !a.dir.join("data/journal.redb").exists(),
        "no file of its own beside a shared journal"
    );
}

/// With a SQL `--backstop` behind Redis the journal is in the database
/// (shared by every instance), not in Redis nor in a file of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_a_sql_backstop_the_journal_is_in_the_database() {
    if !support_redis::redis_available() {
        eprintln!("SKIPPED: no redis-server on this machine");
        return;
    }
    let redis = support_redis::RedisServer::start();
    let up = Upstream::start().await;
    let db = temp_path("reconcile-backstop.db");
    let backstop = format!("sqlite:{}", db.display());
    let url = redis.url();
    let store = [
        "--store",
        url.clone().leak(),
        "--backstop",
        backstop.clone().leak(),
    ];
    let a = start(&up.url(), &store);
    let b = start(&up.url(), &store);
    let id = format!("42006{}0001", std::process::id());
    send(&a, "/notify/wx", "text/xml", wechat(&id, "B1", 1)).await;
    send(&b, "/notify/wx", "text/xml", wechat(&id, "B1", 1)).await;
    let (code, out, err) = gateway(&b, &["inspect", "--id", &id]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("2 copies (executed 1, replayed 1)"), "{out}");
    let pool = sqlx::SqlitePool::connect(&backstop).await.unwrap();
    let (n,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM idempotency_journal")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 1, "one row per stored key, in the backstop's database");
    pool.close().await;
    assert!(!a.dir.join("data/journal.redb").exists());
    let _ = std::fs::remove_file(&db);
}
