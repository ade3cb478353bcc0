//! `send` and `test-keys` through the binary: the routes `test-keys`
//! prints pasted into a gateway's config as they are, then each built-in
//! preset's notification sent to its route with `--copies 3`: it verifies,
//! the upstream is called once, the first copy runs and the others are
//! replayed. A configured preset's signature verifies the same way; a wrong
//! secret gets the 401, and `send` says so and exits 1. The built-in orders
//! place what `send` sends for their channel.

use crate::gateway_support;
use test_support::common;

use common::upstream::Upstream;
use gateway_support::{gateway_bin, temp_path, Proc};
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use tower_idempotency::Preset;

/// `test-keys DIR` run once for the file: the folder and what it printed.
fn test_keys() -> &'static (PathBuf, String) {
    static KEYS: OnceLock<(PathBuf, String)> = OnceLock::new();
    KEYS.get_or_init(|| {
        let dir = temp_path("send-keys");
        let out = Command::new(gateway_bin())
            .args(["test-keys", dir.to_str().unwrap()])
            .output()
            .unwrap();
        let stdout = String::from_utf8(out.stdout).unwrap();
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        (dir, stdout)
    })
}

/// `idempotency-gateway ARGS` in a blocking thread (the upstream runs on
/// the test's runtime meanwhile).
async fn gateway_cli(args: Vec<String>) -> Output {
    tokio::task::spawn_blocking(move || {
        Command::new(gateway_bin())
            .args(&args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    })
    .await
    .unwrap()
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A gateway in front of `up` with `routes` (TOML) in its config file.
fn start(up: &Upstream, routes: &str) -> (Proc, PathBuf) {
    let file = temp_path("send-config.toml");
    let config = format!("upstream = \"{}\"\n\n{routes}", up.url());
    std::fs::write(&file, config).unwrap();
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
    (gw, file)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_verifies_on_every_built_in_preset_and_its_copies_are_replayed() {
    use std::os::unix::fs::PermissionsExt as _;
    let (dir, printed) = test_keys();
    // Private keys and secrets are the owner's alone.
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        let name = path.file_name().unwrap().to_str().unwrap();
        if name.ends_with("-public-key.pem") {
            assert_eq!(mode, 0o644, "{name}");
        } else {
            assert_eq!(mode, 0o600, "{name}");
        }
    }
    // What test-keys prints, pasted as it is, beside the client routes.
    let up = Upstream::start().await;
    let routes = format!(
        "[[route]]\nprefix = \"/api\"\npreset = \"idempotency-key\"\n\n\
         [[route]]\nprefix = \"/orders\"\npreset = \"client-token\"\n\n{printed}"
    );
    let (gw, _file) = start(&up, &routes);
    // `# send URL/PREFIX --preset NAME --secret FILE` above each route.
    let mut sends: Vec<(String, String, Option<String>)> = printed
        .lines()
        .filter_map(|l| l.strip_prefix("# send URL"))
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            assert_eq!((w[1], w[3]), ("--preset", "--secret"), "{l}");
            (w[0].to_owned(), w[2].to_owned(), Some(w[4].to_owned()))
        })
        .collect();
    sends.push(("/api/orders".into(), "idempotency-key".into(), None));
    sends.push(("/orders".into(), "client-token".into(), None));
    let sent: Vec<&str> = sends.iter().map(|(_, p, _)| p.as_str()).collect();
    for name in Preset::builtin_names() {
        assert!(sent.contains(name), "a route for {name}: {sent:?}");
    }
    for (path, preset, secret) in &sends {
        let mut args = vec![
            "send".to_owned(),
            format!("http://{}{path}", gw.addr),
            "--preset".to_owned(),
            preset.clone(),
            "--copies".to_owned(),
            "3".to_owned(),
        ];
        if let Some(s) = secret {
            args.extend(["--secret".to_owned(), s.clone()]);
        }
        let out = gateway_cli(args).await;
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(0), "{preset}: {stdout}{stderr}");
        let copies: Vec<&str> = stdout.lines().filter(|l| l.starts_with("copy ")).collect();
        assert_eq!(copies.len(), 3, "{preset}: {stdout}");
        assert!(
            copies[0].starts_with("copy 1/3: 20") && copies[0].contains(", first run"),
            "{preset}: {stdout}"
        );
        for copy in &copies[1..] {
            assert!(copy.contains(", replayed"), "{preset}: {stdout}");
        }
        assert_eq!(up.calls(path), 1, "{preset}: the upstream ran it once");
    }
    drop(gw);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_signs_a_configured_preset() {
    let up = Upstream::start().await;
    let secret = temp_path("send-shopify-secret");
    std::fs::write(&secret, "shpss_test_secret_0123456789\n").unwrap();
    // A signature over a timestamp pair, a template and a header, base64.
    let routes = format!(
        "[[preset]]\nname = \"acme\"\nkey = \"header:X-Acme-Delivery\"\n\
         signature = {{ scheme = \"hmac-sha512\", header = \"X-Acme-Signature\", encoding = \"base64\", \
         signed = \"{{timestamp}}.{{header:X-Acme-Delivery}}.{{body}}\", signature_field = \"v1\", timestamp_field = \"t\" }}\n\n\
         [[route]]\nprefix = \"/notify/acme\"\npreset = \"acme\"\nverify = {{ secrets = [{{ file = \"{}\" }}] }}\n",
        secret.display()
    );
    let (gw, file) = start(&up, &routes);
    let url = format!("http://{}/notify/acme", gw.addr);
    let out = gateway_cli(vec![
        "--config".into(),
        file.to_str().unwrap().into(),
        "send".into(),
        url.clone(),
        "--preset".into(),
        "acme".into(),
        "--secret".into(),
        secret.to_str().unwrap().into(),
        "--copies".into(),
        "2".into(),
        "--field".into(),
        "id=delivery-42".into(),
    ])
    .await;
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("copy 1/2: 200 OK, first run"), "{stdout}");
    assert!(stdout.contains("copy 2/2: 200 OK, replayed"), "{stdout}");
    assert_eq!(up.calls("/notify/acme"), 1);
    let seen = up.last("/notify/acme");
    assert_eq!(
        seen.headers.get("x-acme-delivery").map(|v| v.as_bytes()),
        Some(&b"delivery-42"[..]),
        "the key where the preset reads it"
    );
    // Without --config the preset is unknown, and `send` says where it looked.
    let out = gateway_cli(vec![
        "send".into(),
        url,
        "--preset".into(),
        "acme".into(),
        "--secret".into(),
        secret.to_str().unwrap().into(),
    ])
    .await;
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("--config FILE"), "{stderr}");
    drop(gw);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_secret_gets_the_401_and_send_says_so() {
    let (dir, _) = test_keys();
    let up = Upstream::start().await;
    let routes = format!(
        "[[route]]\nprefix = \"/notify/stripe\"\npreset = \"stripe\"\n\
         verify = {{ secrets = [{{ file = \"{}\" }}] }}\n\n\
         [[route]]\nprefix = \"/notify/wechat\"\npreset = \"wechatpay-v3\"\n\
         verify = {{ platform_keys = {{ \"{}\" = \"{}\" }} }}\n",
        dir.join("stripe-secret").display(),
        serial_of(test_keys().1.as_str()),
        dir.join("wechatpay-v3-public-key.pem").display()
    );
    let (gw, _file) = start(&up, &routes);
    let wrong = temp_path("send-wrong-secret");
    std::fs::write(&wrong, "whsec_not_the_routes_secret\n").unwrap();
    for (path, preset, secret) in [
        ("/notify/stripe", "stripe", wrong.clone()),
        // Another RSA key under the same serial.
        (
            "/notify/wechat",
            "wechatpay-v3",
            dir.join("alipay-private-key.pem"),
        ),
    ] {
        let out = gateway_cli(vec![
            "send".into(),
            format!("http://{}{path}", gw.addr),
            "--preset".into(),
            preset.into(),
            "--secret".into(),
            secret.to_str().unwrap().into(),
        ])
        .await;
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(1), "{preset}: {stdout}{stderr}");
        assert!(
            stdout.contains("copy 1/1: 401 Unauthorized, not run"),
            "{preset}: {stdout}"
        );
        assert!(
            stderr.contains("the gateway refused the signature (401 Unauthorized)")
                && stderr.contains(&format!("--secret {}", secret.display())),
            "{preset}: {stderr}"
        );
        assert_eq!(up.calls(path), 0, "{preset}: refused before the upstream");
    }
    drop(gw);
}

/// The WeChat Pay v3 serial in test-keys' `platform_keys` line.
fn serial_of(printed: &str) -> String {
    let line = printed
        .lines()
        .find(|l| l.contains("platform_keys = { \""))
        .unwrap();
    let start = line.find("platform_keys = { \"").unwrap() + "platform_keys = { \"".len();
    line[start..].split('"').next().unwrap().to_owned()
}

/// The README's "try it" lines, run as printed in a folder of their own
/// (the upstream and a free port in place of 127.0.0.1:9000 and :8080): a
/// line ending in `&` starts the gateway, the others run in `sh`; each
/// `#   copy …` line shown under a `send` is in what it prints.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_try_it_lines_run_as_printed() {
    use crate::gateway_readme_commands::{block, words};
    let up = Upstream::start().await;
    let listen = common::free_addr();
    let dir = temp_path("try-it");
    std::fs::create_dir_all(&dir).unwrap();
    let script = block("sh", "idempotency-gateway test-keys ./test-keys")
        .replace("127.0.0.1:9000", &up.addr.to_string())
        .replace("127.0.0.1:8080", &listen.to_string());
    let bin_dir = gateway_bin().parent().unwrap().to_owned();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut gateway = None;
    let lines: Vec<&str> = script.lines().collect();
    let mut sent = 0;
    for (i, line) in lines.iter().enumerate() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let w = words(line);
        if w.last().map(String::as_str) == Some("&") {
            let args: Vec<String> = w[1..w.len() - 1]
                .iter()
                .map(|a| match dir.join(a) {
                    p if p.exists() => p.to_str().unwrap().to_owned(),
                    _ => a.clone(),
                })
                .collect();
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            gateway = Some(Proc::start(&args, &[], Stdio::inherit()));
            continue;
        }
        let (run, cwd, path) = (line.to_string(), dir.clone(), path.clone());
        let out = tokio::task::spawn_blocking(move || {
            Command::new("sh")
                .args(["-c", &run])
                .current_dir(&cwd)
                .env("PATH", path)
                .output()
                .unwrap()
        })
        .await
        .unwrap();
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(0), "{line}: {stdout}{stderr}");
        if w[1] == "send" {
            sent += 1;
            let shown: Vec<&str> = lines[i + 1..]
                .iter()
                .take_while(|l| l.starts_with("#   "))
                .filter_map(|l| l.strip_prefix("#   copy "))
                .collect();
            for copy in shown {
                // Up to the reply's body.
                let head = &copy[..copy.find(": {").unwrap_or(copy.len())];
                assert!(stdout.contains(&format!("copy {head}")), "{line}: {stdout}");
            }
            assert!(stdout.contains("first run"), "{line}: {stdout}");
        }
    }
    assert!(gateway.is_some(), "a line starts the gateway");
    assert_eq!(sent, 2, "both send lines ran");
    assert_eq!(up.calls("/notify/wechat"), 1);
    assert_eq!(up.calls("/notify/stripe"), 1);
    drop(gateway);
    let _ = std::fs::remove_dir_all(&dir);
}

/// To a gateway serving HTTPS with a certificate of its own: `--ca` trusts
/// it; without it the handshake fails and `send` says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_over_https_trusts_the_ca_it_is_given() {
    let (dir, _) = test_keys();
    let up = Upstream::start().await;
    let tls = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let cert = temp_path("send-tls-cert.pem");
    let key = temp_path("send-tls-key.pem");
    std::fs::write(&cert, tls.cert.pem()).unwrap();
    std::fs::write(&key, tls.signing_key.serialize_pem()).unwrap();
    let routes = format!(
        "tls_cert = \"{}\"\ntls_key = \"{}\"\n\n[[route]]\nprefix = \"/notify/stripe\"\npreset = \"stripe\"\n\
         verify = {{ secrets = [{{ file = \"{}\" }}] }}\n",
        cert.display(),
        key.display(),
        dir.join("stripe-secret").display()
    );
    let (gw, _file) = start(&up, &routes);
    let url = format!("https://localhost:{}/notify/stripe", gw.addr.port());
    let send = |ca: Option<&PathBuf>| {
        let mut args = vec![
            "send".to_owned(),
            url.clone(),
            "--preset".to_owned(),
            "stripe".to_owned(),
            "--secret".to_owned(),
            dir.join("stripe-secret").to_str().unwrap().to_owned(),
        ];
        if let Some(ca) = ca {
            args.extend(["--ca".to_owned(), ca.to_str().unwrap().to_owned()]);
        }
        gateway_cli(args)
    };
    let out = send(None).await;
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(
        stderr.contains("cannot reach") && stderr.contains("certificate"),
        "{stderr}"
    );
    assert_eq!(up.calls("/notify/stripe"), 0);
    let out = send(Some(&cert)).await;
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("copy 1/1: 200 OK, first run"), "{stdout}");
    assert_eq!(up.calls("/notify/stripe"), 1);
    drop(gw);
}

/// The table "What a refused signature gets" of `docs/channels.md`: preset
/// and the 401's body, one row each.
fn refusal_table() -> Vec<(String, String)> {
    let page = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/channels.md"),
    )
    .unwrap();
    let section = page
        .split("\n### What a refused signature gets\n")
        .nth(1)
        .expect("the section in docs/channels.md");
    section
        .lines()
        .skip_while(|l| !l.starts_with("| preset "))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split(" | ").map(str::trim).collect();
            let unquote = |c: &str| c.trim_matches('`').to_owned();
            (unquote(cells[0]), unquote(cells[2]))
        })
        .collect()
}

/// Every channel route (the built-in presets `test-keys` prints, and a
/// configured one) answers a notification whose signature does not verify
/// with 401 and the body the channels page says, nothing reaches the
/// upstream, and every channel preset has its row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_signature_gets_the_body_the_channels_page_says() {
    let (_, printed) = test_keys();
    let table = refusal_table();
    let up = Upstream::start().await;
    let secret = temp_path("refusal-acme-secret");
    std::fs::write(&secret, "acme-secret-0123456789\n").unwrap();
    let routes = format!(
        "[[preset]]\nname = \"acme\"\nkey = \"json:/id\"\n\
         signature = {{ scheme = \"hmac-sha256\", header = \"X-Acme-Signature\", signed = \"{{body}}\" }}\n\n\
         [[route]]\nprefix = \"/notify/acme\"\npreset = \"acme\"\nverify = {{ secrets = [{{ file = \"{}\" }}] }}\n\n{printed}",
        secret.display()
    );
    let (gw, _file) = start(&up, &routes);
    let mut routes: Vec<(String, String)> = printed
        .lines()
        .filter_map(|l| l.strip_prefix("# send URL"))
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (w[0].to_owned(), w[2].to_owned())
        })
        .collect();
    routes.push(("/notify/acme".into(), "acme".into()));
    for (path, preset) in &routes {
        let want = table
            .iter()
            .find(|(p, _)| p == preset || (p == "a `[[preset]]` table" && preset == "acme"))
            .unwrap_or_else(|| panic!("no row for {preset} in {table:?}"));
        // A notification of the channel's shape whose signature headers
        // are made up.
        let (ct, body) = match preset.as_str() {
            "wechatpay-v2" => (
                "text/xml",
                "<xml><transaction_id>T1</transaction_id><sign>00</sign></xml>",
            ),
            "alipay" => (
                "application/x-www-form-urlencoded",
                "notify_id=N1&trade_status=TRADE_SUCCESS&sign=AAAA&sign_type=RSA2",
            ),
            _ => (
                "application/json",
                r#"{"id":"EV-REFUSED-1","type":"x","event_type":"x"}"#,
            ),
        };
        let headers = [
            ("content-type", ct),
            ("stripe-signature", "t=1,v1=00"),
            ("x-acme-signature", "00"),
            ("wechatpay-serial", "00"),
            ("wechatpay-signature", "AAAA"),
            ("wechatpay-timestamp", "1"),
            ("wechatpay-nonce", "n"),
            ("webhook-id", "msg_1"),
            ("webhook-timestamp", "1"),
            ("webhook-signature", "v1,AAAA"),
        ];
        let answer = common::post(&common::client(), gw.addr, path, &headers, body).await;
        assert_eq!(answer.status, 401, "{preset}: {}", answer.text());
        assert_eq!(
            answer.text().trim(),
            want.1,
            "{preset}: the body docs/channels.md gives"
        );
    }
    for name in Preset::builtin_names() {
        let client_api = ["idempotency-key", "client-token"].contains(name);
        assert!(
            client_api || table.iter().any(|(p, _)| p == name),
            "{name} has no row in docs/channels.md's refusals"
        );
    }
    assert!(
        up.seen().is_empty(),
        "a refused notification reached the upstream"
    );
    drop(gw);
}

/// The built-in orders place what each channel really sends: a route of
/// test-keys with `order` set to its preset, one notification each by
/// `send`, and each is placed (forwarded, its object's position advanced),
/// WeChat Pay v3's from the resource its `verify` decrypted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_built_in_orders_place_what_send_sends() {
    let (_, printed) = test_keys();
    let orders = ["wechatpay-v3", "alipay", "paypal", "stripe"];
    let mut routes = String::new();
    for line in printed.lines() {
        routes.push_str(line);
        routes.push('\n');
        if let Some(name) = orders.iter().find(|o| line == format!("preset = \"{o}\"")) {
            routes.push_str(&format!("order = \"{name}\"\n"));
        }
    }
    let up = Upstream::start().await;
    let admin = common::free_addr();
    let file = temp_path("send-order.toml");
    std::fs::write(&file, format!("upstream = \"{}\"\n\n{routes}", up.url())).unwrap();
    let gw = Proc::start(
        &[
            "--config",
            file.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            &admin.to_string(),
        ],
        &[],
        Stdio::inherit(),
    );
    let sends: Vec<(String, String, String)> = printed
        .lines()
        .filter_map(|l| l.strip_prefix("# send URL"))
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (w[0].to_owned(), w[2].to_owned(), w[4].to_owned())
        })
        .filter(|(_, preset, _)| orders.contains(&preset.as_str()))
        .collect();
    assert_eq!(sends.len(), orders.len(), "{printed}");
    for (path, preset, secret) in &sends {
        let out = gateway_cli(vec![
            "send".into(),
            format!("http://{}{path}", gw.addr),
            "--preset".into(),
            preset.clone(),
            "--secret".into(),
            secret.clone(),
        ])
        .await;
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(0), "{preset}: {stdout}{stderr}");
        assert_eq!(up.calls(path), 1, "{preset}: forwarded");
    }
    let (_, metrics) = gateway_support::get(admin, "/metrics");
    for order in orders {
        let advanced = metrics.lines().any(|l| {
            l.starts_with("idempotency_order_events_total{")
                && l.contains(&format!("order=\"{order}\""))
                && l.contains("result=\"advanced\"")
                && l.ends_with(" 1")
        });
        assert!(advanced, "{order} placed nothing:\n{metrics}");
    }
    drop(gw);
    let _ = std::fs::remove_file(file);
}
