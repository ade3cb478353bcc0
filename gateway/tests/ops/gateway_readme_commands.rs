//! The operator commands as printed: a gateway started with the config
//! block shown beside them (the test's folder in place of the `/etc/...`
//! files, a free port in place of 9100), one WeChat Pay notification with
//! the pages' id, then every `idempotency-gateway --config
//! /etc/idempotency-gateway.toml …` admin line of the README and of every
//! page of `docs/` (`gateway_support::docs::PAGES`), run as it is: it
//! reaches the admin API and does what it says (`dlq`, `pause` and `resume`
//! too). Without a gateway to reach, a command says so and names the flags.

use crate::gateway_support;
use test_support::common;

use common::upstream::Upstream;
use common::{client, free_addr, post};
use gateway_support::docs::PAGES;
use gateway_support::{gateway_bin, temp_path, Proc};
use std::process::{Command, Stdio};

const CONFIG: &str = "/etc/idempotency-gateway.toml";
const ADMIN: [&str; 7] = [
    "inspect",
    "forget",
    "journal",
    "reconcile",
    "dlq",
    "pause",
    "resume",
];

/// The ``` block of `lang` that starts with `first`, on whichever page
/// holds it (exactly one).
pub(crate) fn block(lang: &str, first: &str) -> String {
    let fence = format!("```{lang}\n{first}");
    let found: Vec<(&str, &str)> = PAGES
        .iter()
        .filter_map(|&(name, text)| text.find(&fence).map(|at| (name, &text[at..])))
        .collect();
    assert_eq!(
        found.len(),
        1,
        "one page with a {lang} block starting {first:?}: {:?}",
        found.iter().map(|(name, _)| name).collect::<Vec<_>>()
    );
    let body = &found[0].1[lang.len() + 4..];
    body[..body.find("\n```").unwrap() + 1].to_owned()
}

/// A command line as a shell reads it: words, `'…'` quoted, `#` to the end
/// of the line a comment.
pub(crate) fn words(line: &str) -> Vec<String> {
    let (mut out, mut word, mut quoted, mut any) = (Vec::new(), String::new(), false, false);
    for c in line.chars() {
        match c {
            '\'' => (quoted, any) = (!quoted, true),
            '#' if !quoted && !any => break,
            c if c.is_whitespace() && !quoted => {
                if any {
                    out.push(std::mem::take(&mut word));
                }
                any = false;
            }
            c => {
                word.push(c);
                any = true;
            }
        }
    }
    if any {
        out.push(word);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_admin_commands_work_as_printed() {
    use std::os::unix::fs::PermissionsExt as _;
    let up = Upstream::start().await;
    let dir = temp_path("readme-ops");
    std::fs::create_dir_all(&dir).unwrap();
    let token = dir.join("admin-token");
    std::fs::write(&token, "readme-admin-token-0123456789\n").unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    let metrics = free_addr();
    let d = dir.to_str().unwrap();
    let config = block(
        "toml",
        "# /etc/idempotency-gateway.toml: the keys the commands read",
    )
    .replace("/etc/idempotency-gateway/", &format!("{d}/"))
    .replace("/var/lib/idempotency-gateway", &format!("{d}/data"))
    .replace("127.0.0.1:9100", &metrics.to_string())
    .replace("http://127.0.0.1:9000", &up.url());
    let file = dir.join("idempotency-gateway.toml");
    std::fs::write(&file, &config).unwrap();
    let gw = Proc::start(
        &[
            "--config",
            file.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
        ],
        &[],
        Stdio::inherit(),
    );

    // WeChat Pay's notification EV-2018022511, sent twice.
    let doc = common::vectors::fixture("wechatpay_v3_notify_official_doc_transaction_success.json");
    let mut v: serde_json::Value = serde_json::from_slice(&doc).unwrap();
    v["id"] = serde_json::Value::String("EV-2018022511".to_owned());
    for _ in 0..2 {
        let a = post(
            &client(),
            gw.addr,
            "/notify/wechat",
            &[("content-type", "application/json")],
            v.to_string(),
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    // The bills the reconcile lines name, in the folder they run in.
    for (name, fixture) in [
        (
            "2026-12-01_tradebill.csv",
            "wechatpay_tradebill_wechatpay-go_TestDownloadForClient.csv",
        ),
        ("bill.csv", "alipay_tradebill_detail_SYNTHESIZED_gbk.csv"),
    ] {
        std::fs::write(dir.join(name), common::vectors::fixture(fixture)).unwrap();
    }

    let lines: Vec<Vec<String>> = PAGES
        .iter()
        .flat_map(|(_, text)| text.lines())
        .filter(|l| l.starts_with(&format!("idempotency-gateway --config {CONFIG} ")))
        .map(words)
        // The admin commands (not the lines that start a gateway).
        .filter(|w| w.get(3).is_some_and(|c| ADMIN.contains(&c.as_str())))
        .collect();
    let ran: Vec<&str> = lines.iter().map(|w| w[3].as_str()).collect();
    for command in ADMIN {
        assert!(
            ran.contains(&command),
            "a line of the pages runs `{command}`: {ran:?}"
        );
    }
    let run = |words: &[String]| {
        Command::new(gateway_bin())
            .args(words[1..].iter().map(|w| {
                if w == CONFIG {
                    file.to_str().unwrap()
                } else {
                    w
                }
            }))
            .current_dir(&dir)
            .env_remove("IDEMPOTENCY_GATEWAY_ADMIN")
            .env_remove("IDEMPOTENCY_GATEWAY_ADMIN_TOKEN_FILE")
            .env_remove("IDEMPOTENCY_GATEWAY_METRICS_LISTEN")
            .env_remove("IDEMPOTENCY_GATEWAY_ADMIN_LISTEN")
            .output()
            .unwrap()
    };
    // The journal is written off the request path: wait for both copies.
    for _ in 0..100 {
        if String::from_utf8_lossy(&run(&lines[0]).stdout).contains("2 copies (") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let mut inspected = 0;
    for words in &lines {
        let out = run(words);
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        let line = words.join(" ");
        assert!(!stderr.contains("cannot reach"), "{line}: {stderr}");
        match words[3].as_str() {
            "inspect" => {
                assert_eq!(out.status.code(), Some(0), "{line}: {stderr}");
                assert!(
                    stdout.contains("key: idem:wechatpay-v3:/notify/wechat::EV-2018022511"),
                    "{line}: {stdout}"
                );
                assert!(
                    stdout.contains("record: completed: status 200"),
                    "{line}: {stdout}"
                );
                assert!(stdout.contains("2 copies ("), "{line}: {stdout}");
                inspected += 1;
            }
            "forget" => {
                assert_eq!(out.status.code(), Some(0), "{line}: {stderr}");
                assert!(
                    stdout.contains("forgotten: idem:wechatpay-v3:/notify/wechat::EV-2018022511"),
                    "{stdout}"
                );
            }
            "journal" => {
                assert_eq!(out.status.code(), Some(0), "{line}: {stderr}");
                let json: serde_json::Value = serde_json::from_str(&stdout).unwrap();
                assert!(json["records"].is_array(), "{json}");
            }
            // Findings (exit 1) or none (0): the bill was read and the
            // journal reached.
            "reconcile" => {
                assert!(matches!(out.status.code(), Some(0 | 1)), "{line}: {stderr}");
                assert!(!stdout.is_empty(), "{line}");
            }
            // Through the admin API (never the queue directly).
            "dlq" => {
                assert_eq!(out.status.code(), Some(0), "{line}: {stderr}");
                assert!(!stderr.contains("working on the queue"), "{line}: {stderr}");
            }
            "pause" | "resume" => {
                assert_eq!(out.status.code(), Some(0), "{line}: {stderr}");
                let word = if words[3] == "pause" {
                    "paused"
                } else {
                    "resumed"
                };
                assert!(
                    stdout.contains(&format!("{word} /notify/wechat")),
                    "{line}: {stdout}"
                );
            }
            other => panic!("a line of the pages runs {other}"),
        }
    }
    assert!(inspected >= 2, "both `inspect` lines");
    // Forgotten: the next copy runs again.
    let a = post(
        &client(),
        gw.addr,
        "/notify/wechat",
        &[("content-type", "application/json")],
        v.to_string(),
    )
    .await;
    assert_eq!(a.status, 200);
    assert_eq!(up.calls("/notify/wechat"), 2);
    drop(gw);
    let _ = std::fs::remove_dir_all(&dir);
}

/// An admin command that finds no gateway says so and names the flags that
/// find one; `dlq` without `--offline` never works on a queue directly
/// (here: no `./gateway-data` appears in the folder it ran in).
#[test]
fn admin_commands_without_a_gateway_name_the_flags() {
    let dir = temp_path("no-gateway");
    std::fs::create_dir_all(&dir).unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(gateway_bin())
            .args(args)
            .current_dir(&dir)
            .env_remove("IDEMPOTENCY_GATEWAY_CONFIG")
            .env_remove("IDEMPOTENCY_GATEWAY_ADMIN")
            .env_remove("IDEMPOTENCY_GATEWAY_ADMIN_TOKEN_FILE")
            .env_remove("IDEMPOTENCY_GATEWAY_METRICS_LISTEN")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for args in [
        &["dlq", "list"][..],
        &["pause", "/notify/wechat", "--reason", "upstream deploy"],
        &["resume", "/notify/wechat"],
        &["inspect", "EV-2018022511"],
        &["journal"],
    ] {
        let (code, stderr) = run(args);
        let line = args.join(" ");
        assert_eq!(code, Some(1), "{line}: {stderr}");
        assert!(
            stderr.contains("admin API") && stderr.contains("--config FILE"),
            "{line}: names the gateway's config: {stderr}"
        );
        assert!(
            stderr.contains("--admin-token-file") && stderr.contains("--admin URL"),
            "{line}: names the flags: {stderr}"
        );
        assert!(!stderr.contains("working on the queue"), "{line}: {stderr}");
    }
    let (_, stderr) = run(&["dlq", "list"]);
    assert!(stderr.contains("--offline"), "{stderr}");
    assert!(
        !dir.join("gateway-data").exists(),
        "dlq without --offline opened no queue"
    );
    // A config whose admin API is not there: a connect error naming the flags.
    let token = dir.join("admin-token");
    std::fs::write(&token, "no-gateway-admin-token-0123456789\n").unwrap();
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let config = dir.join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "upstream = \"http://127.0.0.1:9000\"\nmetrics_listen = \"{}\"\nadmin_token_file = \"{}\"\n",
            common::free_addr(),
            token.display()
        ),
    )
    .unwrap();
    for args in [&["dlq", "list"][..], &["pause", "/notify/wechat"]] {
        let mut all = vec!["--config", config.to_str().unwrap()];
        all.extend_from_slice(args);
        let (code, stderr) = run(&all);
        assert_eq!(code, Some(1), "{all:?}: {stderr}");
        assert!(
            stderr.contains("cannot reach the gateway's admin API")
                && stderr.contains("--config FILE"),
            "{all:?}: {stderr}"
        );
    }
    assert!(!dir.join("gateway-data").exists());
    let _ = std::fs::remove_dir_all(&dir);
}
