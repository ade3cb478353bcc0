//! The README's and the `docs/` pages' config blocks as a user copies them:
//! every ```toml block passes `--check-config` (the test's certificates and
//! keys in place of the `/etc/...` files), and the README's main example's
//! `verify` table of each built-in channel verifies that channel's real
//! notification. Then the pages themselves: every flag of `--help` is in
//! `docs/reference.md`, every relative link finds its file and heading,
//! and every page of `docs/` is one the tests read.

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

/// The option names (`--flag`) of a `--help` text: the words that start
/// with `--` on the lines that list an option.
fn flags_of_help(help: &str) -> Vec<String> {
    help.lines()
        .map(str::trim_start)
        .filter(|l| l.starts_with('-'))
        .filter_map(|l| {
            l.split([' ', ',', '='])
                .find(|w| w.starts_with("--") && w.len() > 2)
                .map(|w| {
                    w.trim_end_matches(|c: char| !c.is_ascii_alphanumeric())
                        .to_owned()
                })
        })
        .collect()
}

/// The subcommands a `--help` text lists under `Commands:`.
fn commands_of_help(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with(' '))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_owned)
        .collect()
}

fn help(args: &[&str]) -> String {
    let out = Command::new(gateway_bin())
        .args(args)
        .arg("--help")
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{args:?} --help");
    String::from_utf8(out.stdout).unwrap()
}

/// `docs/reference.md` names every flag `--help` lists, the gateway's and
/// each subcommand's (`dlq list`, `reconcile`, ...), as `` `--flag``.
#[test]
fn reference_lists_every_flag_of_help() {
    let reference = page("docs/reference.md");
    let top = help(&[]);
    let flags = flags_of_help(&top);
    // The parse found the flags (a change of clap's layout must not make
    // this test pass on nothing).
    for known in [
        "--listen",
        "--upstream",
        "--config",
        "--check-config",
        "--help",
    ] {
        assert!(flags.iter().any(|f| f == known), "{known} in {flags:?}");
    }
    let mut missing = Vec::new();
    let mut commands: Vec<Vec<String>> = commands_of_help(&top)
        .into_iter()
        .map(|c| vec![c])
        .collect();
    assert!(commands.len() >= 5, "{commands:?}");
    for flag in &flags {
        if !reference.contains(&format!("`{flag}")) {
            missing.push(flag.clone());
        }
    }
    while let Some(command) = commands.pop() {
        let args: Vec<&str> = command.iter().map(String::as_str).collect();
        let text = help(&args);
        let name = command.join(" ");
        if !reference.contains(&format!("`idempotency-gateway {name}")) {
            missing.push(format!("idempotency-gateway {name}"));
        }
        for flag in flags_of_help(&text) {
            if !reference.contains(&format!("`{flag}")) {
                missing.push(format!("{name} {flag}"));
            }
        }
        for sub in commands_of_help(&text) {
            let mut deeper = command.clone();
            deeper.push(sub);
            commands.push(deeper);
        }
    }
    assert!(missing.is_empty(), "not in docs/reference.md: {missing:?}");
}

/// GitHub's anchor of a heading: lowercase, spaces to `-`, punctuation
/// other than `-` and `_` dropped; a repeated one gets `-1`, `-2`, ...
fn anchors(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut seen = std::collections::HashMap::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if fenced || hashes == 0 || hashes > 6 || !line[hashes..].starts_with(' ') {
            continue;
        }
        let slug: String = line[hashes..]
            .trim()
            .chars()
            .flat_map(char::to_lowercase)
            .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let n = seen.entry(slug.clone()).or_insert(0);
        *n += 1;
        let n = *n - 1;
        out.push(if n == 0 { slug } else { format!("{slug}-{n}") });
    }
    out
}

/// The relative link targets of a page (`[text](target)` outside code),
/// each with its line.
fn relative_links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fenced = false;
    for (n, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Code spans hold no links.
        let prose: String = line
            .split('`')
            .enumerate()
            .map(|(i, part)| if i % 2 == 0 { part } else { "" })
            .collect();
        let mut rest = prose.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let Some(end) = rest.find(')') else { break };
            let target = &rest[..end];
            if !target.contains("://") && !target.starts_with("mailto:") {
                out.push((n + 1, target.to_owned()));
            }
            rest = &rest[end..];
        }
    }
    out
}

#[test]
fn anchors_follow_githubs_rules() {
    let text = "# A `b` c\n## Several upstreams: `[[upstreams]]`\n```toml\n# not a heading\n```\n## The upstream's connections\n### `max_in_flight = \"auto\"`: x\n## Metrics\n## Metrics\n";
    assert_eq!(
        anchors(text),
        [
            "a-b-c",
            "several-upstreams-upstreams",
            "the-upstreams-connections",
            "max_in_flight--auto-x",
            "metrics",
            "metrics-1",
        ]
    );
    assert_eq!(
        relative_links("[a](b.md#c) `[x](y)` [l](https://e.org) [d](#e)\n```\n[f](g)\n```\n"),
        [(1, "b.md#c".to_owned()), (1, "#e".to_owned())]
    );
}

/// Every relative link of the README and the `docs/` pages finds its file,
/// and its `#anchor` a heading of that file.
#[test]
fn every_relative_link_of_the_docs_resolves() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut broken = Vec::new();
    let mut checked = 0;
    for (name, text) in PAGES {
        let dir = root.join(name).parent().unwrap().to_owned();
        for (line, target) in relative_links(text) {
            let (file, anchor) = target.split_once('#').unwrap_or((&target, ""));
            let path = if file.is_empty() {
                root.join(name)
            } else {
                dir.join(file)
            };
            checked += 1;
            if !path.exists() {
                broken.push(format!("{name}:{line}: {target}: no such file"));
                continue;
            }
            if anchor.is_empty() {
                continue;
            }
            let linked = std::fs::read_to_string(&path).unwrap_or_default();
            if !anchors(&linked).iter().any(|a| a == anchor) {
                broken.push(format!("{name}:{line}: {target}: no such heading"));
            }
        }
    }
    assert!(checked >= 50, "{checked} links");
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

/// Every page of `docs/` is among the pages the tests read, and the README
/// links each of them.
#[test]
fn every_docs_page_is_listed() {
    let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs");
    let mut on_disk: Vec<String> = std::fs::read_dir(&docs)
        .unwrap()
        .map(|e| format!("docs/{}", e.unwrap().file_name().to_str().unwrap()))
        .collect();
    on_disk.sort();
    let mut listed: Vec<String> = PAGES[1..].iter().map(|(p, _)| (*p).to_owned()).collect();
    listed.sort();
    assert_eq!(on_disk, listed);
    let readme = page("README.md");
    for page in listed {
        assert!(
            readme.contains(&format!("]({page})")),
            "the README links {page}"
        );
    }
}

/// The top-level keys the config file's parser takes, from its own error
/// for a key it does not know (``expected one of `listen`, ...``).
fn config_keys() -> Vec<String> {
    let dir = temp_path("readme-keys");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("unknown.toml");
    std::fs::write(
        &file,
        "listen = \"127.0.0.1:0\"\nupstream = \"http://127.0.0.1:1\"\nnot_a_key_of_the_reference = 1\n",
    )
    .unwrap();
    let out = Command::new(gateway_bin())
        .args(["--check-config", "--config"])
        .arg(&file)
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8(out.stderr).unwrap();
    let list = stderr
        .split_once("expected one of ")
        .unwrap_or_else(|| panic!("{stderr}"))
        .1;
    let list = list.lines().next().unwrap();
    list.split(", ")
        .map(|k| k.trim_matches('`').to_owned())
        .collect()
}

/// The config-key column of `docs/reference.md`'s flags table is the
/// parser's: each key named there is one the file takes, and each key the
/// file takes is on the page.
#[test]
fn reference_config_keys_are_the_parsers() {
    let reference = page("docs/reference.md");
    let keys = config_keys();
    assert!(keys.len() >= 50, "{keys:?}");
    for key in ["listen", "upstream", "route", "preset", "upstreams"] {
        assert!(keys.iter().any(|k| k == key), "{key} in {keys:?}");
    }
    let named: Vec<&str> = reference
        .split("\n## Flags\n")
        .nth(1)
        .expect("a ## Flags section")
        .lines()
        .filter(|l| l.starts_with("| `--"))
        .filter_map(|l| l.split(" | ").nth(1))
        .filter_map(|cell| cell.strip_prefix('`')?.strip_suffix('`'))
        // A key, not a sentence (`mode = "ack-then-deliver"` in a `[[route]]`).
        .filter(|key| {
            key.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        })
        .collect();
    assert!(named.len() >= 45, "{named:?}");
    for key in &named {
        assert!(
            keys.iter().any(|k| k == key),
            "docs/reference.md names `{key}`, which the config file refuses"
        );
    }
    let missing: Vec<&String> = keys
        .iter()
        .filter(|k| {
            !reference.contains(&format!("`{k}`")) && !reference.contains(&format!("`[[{k}]]`"))
        })
        .collect();
    assert!(missing.is_empty(), "not in docs/reference.md: {missing:?}");
}
