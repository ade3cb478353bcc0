//! The README's and the `docs/` pages' config blocks as a user copies them:
//! every ```toml block passes `--check-config` (the test's certificates and
//! keys in place of the `/etc/...` files), and the README's main example's
//! `verify` table of each built-in channel verifies that channel's real
//! notification.

use crate::gateway_support;
use test_support::verify_support::{cases, fixture, meta, through};

use gateway_support::docs::{page, PAGES};
use gateway_support::{gateway_bin, temp_path};
use http::StatusCode;
use idempotency_gateway::config::VerifyConfig;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The ```toml blocks of every page, each with its page and the line it
/// starts on.
fn toml_blocks() -> Vec<(&'static str, usize, String)> {
    PAGES
        .iter()
        .flat_map(|&(name, text)| {
            toml_blocks_of(text)
                .into_iter()
                .map(move |(line, block)| (name, line, block))
        })
        .collect()
}

/// The ```toml blocks of one page, each with the line it starts on.
fn toml_blocks_of(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut block: Option<(usize, String)> = None;
    for (n, line) in text.lines().enumerate() {
        match &mut block {
            None if line.trim_start() == "```toml" => block = Some((n + 2, String::new())),
            None => {}
            Some(_) if line.trim_start() == "```" => out.push(block.take().unwrap()),
            Some((_, text)) => {
                text.push_str(line);
                text.push('\n');
            }
        }
    }
    out
}

/// A folder with every file the README's config names, under the names it
/// gives them: the channels' test keys (the vectors' own), a TLS pair, an
/// admin token readable by its owner only.
fn etc() -> PathBuf {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = temp_path("readme-etc");
    std::fs::create_dir_all(&dir).unwrap();
    let text = |m: &str, field: &str| meta(m)[field].as_str().unwrap().to_owned().into_bytes();
    let tls = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let files: Vec<(&str, Vec<u8>)> = vec![
        (
            "wechatpay_platform.pem",
            fixture("wechatpay_v3_platform_cert.pem"),
        ),
        (
            "wechatpay_apiv3.key",
            text("wechatpay_v3_notify_wechatpay-go.meta.json", "apiv3_key"),
        ),
        (
            "wechatpay_v2.key",
            text("wechatpay_v2_notify_SYNTHESIZED.meta.json", "api_v2_key"),
        ),
        (
            "alipay_public_key.pem",
            fixture("alipay_public_key_trade_status_sync.pem"),
        ),
        (
            "stripe.secret",
            text(
                "stripe_webhook_SYNTHESIZED_stripe-go_testPayload.meta.json",
                "secret",
            ),
        ),
        (
            "paypal_cert.pem",
            fixture("paypal_cert_ValidateCertTest.pem"),
        ),
        (
            "adyen.hmac",
            text("adyen_notify_adyen-python_items.meta.json", "hmac_key_hex"),
        ),
        (
            "webhooks.secret",
            text(
                "standard_webhooks_standard-webhooks_go_test.meta.json",
                "secret",
            ),
        ),
        ("cert.pem", tls.cert.pem().into_bytes()),
        ("key.pem", tls.signing_key.serialize_pem().into_bytes()),
        ("admin-token", b"readme-admin-token-0123456789\n".to_vec()),
    ];
    for (name, bytes) in files {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    std::fs::create_dir_all(dir.join("data")).unwrap();
    dir
}

/// A block with the test's folder in place of `/etc/idempotency-gateway/`
/// (and of the data directory), and a listen address and an upstream when
/// the block has none.
fn localized(block: &str, dir: &Path) -> String {
    let dir = dir.to_str().unwrap();
    let text = block
        .replace("/etc/idempotency-gateway/", &format!("{dir}/"))
        .replace("/var/lib/idempotency-gateway", &format!("{dir}/data"));
    let mut out = String::new();
    // A fragment (a route's keys) in a file with what it lacks to start.
    for (key, value) in [
        ("listen", "\"127.0.0.1:0\""),
        ("upstream", "\"http://127.0.0.1:1\""),
    ] {
        if !text.lines().any(|l| l.starts_with(&format!("{key} ="))) {
            out.push_str(&format!("{key} = {value}\n"));
        }
    }
    out + &text
}

/// The variables a block's secrets name (`{ env = "NAME" }`).
fn env_secrets(block: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = block;
    while let Some(at) = rest.find("env = \"") {
        rest = &rest[at + "env = \"".len()..];
        if let Some(end) = rest.find('"') {
            out.push(&rest[..end]);
        }
    }
    out
}

#[test]
fn every_config_block_of_the_readme_passes_check_config() {
    let dir = etc();
    let blocks = toml_blocks();
    // The main example, the configured presets, several upstreams, the
    // admin commands' keys, pacing, the caps and the adaptive limit.
    assert!(blocks.len() >= 8, "{blocks:?}");
    // Each page that shows a config shows it in a block this test reads.
    for name in [
        "README.md",
        "docs/configuration.md",
        "docs/channels.md",
        "docs/operating.md",
        "docs/queues.md",
    ] {
        assert!(
            blocks.iter().any(|(page, _, _)| *page == name),
            "no ```toml block in {name}"
        );
    }
    for (name, line, block) in &blocks {
        let file = dir.join(format!("{}-{line}.toml", name.replace('/', "-")));
        std::fs::write(&file, localized(block, &dir)).unwrap();
        let mut cmd = Command::new(gateway_bin());
        cmd.args(["--check-config", "--config"])
            .arg(&file)
            .env("RUST_LOG", "off")
            .env_remove("IDEMPOTENCY_GATEWAY_UPSTREAM");
        // A secret the block reads from the environment (`{ env = "NAME" }`),
        // as the operator's service sets it.
        for name in env_secrets(block) {
            cmd.env(name, "readme-test-secret-0123456789abcdef");
        }
        let out = cmd.output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(0),
            "{name} line {line}:\n{block}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The main example verifies every built-in channel: each channel route
/// has a `verify` table, and the table verifies the channel's real
/// notification (and refuses it tampered).
#[tokio::test]
async fn the_readme_verify_tables_verify_each_channel() {
    let dir = etc();
    // The first screen's config, in the README itself.
    let (_, main) = toml_blocks_of(page("README.md"))
        .into_iter()
        .find(|(_, b)| b.starts_with("# /etc/idempotency-gateway.toml\n"))
        .expect("the main config example, in the README");
    let config: toml::Table = toml::from_str(&localized(&main, &dir)).unwrap();
    let routes = config["route"].as_array().unwrap();
    let mut verified = Vec::new();
    for route in routes {
        let preset = route["preset"].as_str().unwrap();
        if preset == "idempotency-key" || preset == "client-token" {
            continue;
        }
        let table = route
            .get("verify")
            .unwrap_or_else(|| panic!("the {preset} route has no `verify` table"));
        let verify: VerifyConfig = table.clone().try_into().unwrap();
        let layer = verify.layer(preset, &dir).unwrap();
        let case = cases()
            .into_iter()
            .find(|c| c.name.split(' ').next() == Some(preset) && !c.name.contains("servicemarket"))
            .unwrap_or_else(|| panic!("a vector of {preset}"));
        let (status, _, ran) =
            through(layer.clone(), case.now, &case.headers, case.body.clone()).await;
        assert_eq!(
            (status, ran),
            (StatusCode::OK, true),
            "{preset}: {}",
            case.name
        );
        let tampered = String::from_utf8(case.body.clone())
            .unwrap()
            .replace(case.tamper.0, case.tamper.1);
        let (status, _, _) = through(layer, case.now, &case.headers, tampered.into_bytes()).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{preset} tampered");
        verified.push(preset.to_owned());
    }
    verified.sort();
    let mut builtin: Vec<String> = [
        "adyen",
        "alipay",
        "paypal",
        "standard-webhooks",
        "stripe",
        "wechatpay-v2",
        "wechatpay-v3",
    ]
    .map(str::to_owned)
    .to_vec();
    builtin.sort();
    assert_eq!(verified, builtin);
    let _ = std::fs::remove_dir_all(&dir);
}
