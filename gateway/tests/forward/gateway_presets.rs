//! `[[preset]]` tables through the binary: GitHub, Shopify, Slack, Paddle
//! and Square recipes, each signed as the sender's documentation describes;
//! `--check-config` on bad tables.

use crate::gateway_support;
use test_support::common;

use base64::Engine;
use common::upstream::Upstream;
use common::{all_at_once, client, post, Answer, HttpClient};
use gateway_support::{gateway_bin, get, temp_path, Proc};
use ring::hmac;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

fn mac(secret: &str, msg: &[u8]) -> Vec<u8> {
    hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, secret.as_bytes()), msg)
        .as_ref()
        .to_vec()
}

fn hexed(bytes: Vec<u8>) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

const RECIPES: &str = r#"
[[preset]]
name = "github"
key = "header:x-github-delivery"
fingerprint = "body"
success = { status = 200, body = "thanks" }
failure = { status = 503, body = "again" }
window = "72h"
signature = { scheme = "hmac-sha256", header = "x-hub-signature-256", prefix = "sha256=", encoding = "hex", signed = "{body}" }

[[preset]]
name = "shopify"
key = "header:x-shopify-webhook-id"
signature = { scheme = "hmac-sha256", header = "x-shopify-hmac-sha256", encoding = "base64" }

[[preset]]
name = "slack"
key = "json:/event_id"
without_key = "pass"
signature = { scheme = "hmac-sha256", header = "x-slack-signature", prefix = "v0=", signed = "v0:{timestamp}:{body}", timestamp_header = "x-slack-request-timestamp" }

[[preset]]
name = "paddle"
key = "json:/event_id"
fingerprint = ["json:/event_type"]
signature = { scheme = "hmac-sha256", header = "paddle-signature", signature_field = "h1", timestamp_field = "ts", signed = "{timestamp}:{body}" }

[[preset]]
name = "square"
key = "json:/event_id"
signature = { scheme = "hmac-sha256", header = "x-square-hmacsha256-signature", encoding = "base64", signed = "{url}{body}" }

[[route]]
prefix = "/hooks/github"
preset = "github"
verify = { secrets = [{ env = "GITHUB_SECRET" }, { env = "GITHUB_SECRET_OLD" }] }

[[route]]
prefix = "/hooks/shopify"
preset = "shopify"
verify = { secrets = ["shopify-secret"] }

[[route]]
prefix = "/hooks/slack"
preset = "slack"
verify = { secrets = ["slack-secret"], tolerance = "5m" }

[[route]]
prefix = "/hooks/paddle"
preset = "paddle"
verify = { secrets = ["paddle-new", "paddle-old"] }

[[route]]
prefix = "/hooks/square"
preset = "square"
public_url = "https://example.com/hooks/square"
verify = { secrets = ["square-secret"] }
"#;

const GITHUB: &str = "github-secret";
const GITHUB_OLD: &str = "github-secret-old";

/// A folder holding `gateway.toml`.
fn config_dir(upstream: &str, rest: &str) -> PathBuf {
    let dir = temp_path("presets");
    std::fs::create_dir_all(&dir).unwrap();
    let text = format!("listen = \"127.0.0.1:0\"\nupstream = \"{upstream}\"\n{rest}");
    std::fs::write(dir.join("gateway.toml"), text).unwrap();
    dir
}

/// `gateway --check-config --config DIR/gateway.toml`: exit status, stderr.
fn check(dir: &Path, env: &[(&str, &str)]) -> (i32, String) {
    let mut cmd = Command::new(gateway_bin());
    cmd.arg("--check-config")
        .arg("--config")
        .arg(dir.join("gateway.toml"))
        .stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

async fn storm(
    client: &HttpClient,
    addr: SocketAddr,
    path: &'static str,
    headers: &[(String, String)],
    body: &[u8],
    copies: usize,
) -> Vec<Answer> {
    all_at_once(copies, |_| {
        let (client, headers, body) = (client.clone(), headers.to_vec(), body.to_vec());
        async move {
            let h: Vec<(&str, &str)> = headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            post(&client, addr, path, &h, body).await
        }
    })
    .await
}

fn headers(pairs: &[(&str, String)]) -> Vec<(String, String)> {
    let mut out = vec![("content-type".to_owned(), "application/json".to_owned())];
    out.extend(pairs.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
    out
}

/// Headers of one request.
type Headers = Vec<(String, String)>;

/// One recipe: how a copy is signed, and the copies that must be refused.
struct Recipe {
    path: &'static str,
    body: Vec<u8>,
    genuine: Vec<(String, String)>,
    refused: Vec<(&'static str, Headers, Vec<u8>)>,
}

fn github(secret: &str, id: &str, body: &[u8]) -> Vec<(String, String)> {
    headers(&[
        ("x-github-delivery", id.to_owned()),
        ("x-github-event", "push".to_owned()),
        (
            "x-hub-signature-256",
            format!("sha256={}", hexed(mac(secret, body))),
        ),
    ])
}

fn shopify(secret: &str, id: &str, body: &[u8]) -> Vec<(String, String)> {
    headers(&[
        ("x-shopify-webhook-id", id.to_owned()),
        ("x-shopify-hmac-sha256", b64(&mac(secret, body))),
    ])
}

fn slack(secret: &str, t: u64, body: &[u8]) -> Vec<(String, String)> {
    let mut msg = format!("v0:{t}:").into_bytes();
    msg.extend_from_slice(body);
    headers(&[
        ("x-slack-request-timestamp", t.to_string()),
        (
            "x-slack-signature",
            format!("v0={}", hexed(mac(secret, &msg))),
        ),
    ])
}

fn paddle(secrets: &[&str], t: u64, body: &[u8]) -> Vec<(String, String)> {
    let mut msg = format!("{t}:").into_bytes();
    msg.extend_from_slice(body);
    let mut value = format!("ts={t}");
    for s in secrets {
        value.push_str(&format!(";h1={}", hexed(mac(s, &msg))));
    }
    headers(&[("paddle-signature", value)])
}

fn square(secret: &str, url: &str, body: &[u8]) -> Vec<(String, String)> {
    let mut msg = url.as_bytes().to_vec();
    msg.extend_from_slice(body);
    headers(&[("x-square-hmacsha256-signature", b64(&mac(secret, &msg)))])
}

fn recipes() -> Vec<Recipe> {
    let t = now();
    let gh =
        br#"{"ref":"refs/heads/main","after":"6113728f27ae82c7b1a177c8d03f9e96e0adf246"}"#.to_vec();
    let sh =
        br#"{"id":820982911946154508,"email":"jon@example.com","total_price":"10.00"}"#.to_vec();
    let sl = br#"{"type":"event_callback","event_id":"Ev08MFMKH6","event":{"type":"app_mention"}}"#
        .to_vec();
    let pd =
        br#"{"event_id":"evt_01h8bzakzx3hm2fmen703n5q45","event_type":"transaction.completed"}"#
            .to_vec();
    let sq = br#"{"merchant_id":"6SSW7HV8K2ST5","type":"payment.created","event_id":"13b867cf-db3d-4b1c-90b6-2f32a9d78124"}"#.to_vec();
    let url = "https://example.com/hooks/square";
    let tampered = |b: &[u8]| {
        let mut b = b.to_vec();
        b.insert(1, b' ');
        b
    };
    let mut forged_gh = github(GITHUB, "d-1", &gh);
    forged_gh[3].1 = format!("sha256={}", "0".repeat(64));
    vec![
        Recipe {
            path: "/hooks/github",
            body: gh.clone(),
            genuine: github(GITHUB, "d-1", &gh),
            refused: vec![
                ("forged", forged_gh, gh.clone()),
                ("tampered", github(GITHUB, "d-1", &gh), tampered(&gh)),
                (
                    "unsigned",
                    headers(&[("x-github-delivery", "d-1".into())]),
                    gh.clone(),
                ),
                ("other secret", github("not-it", "d-1", &gh), gh.clone()),
            ],
        },
        Recipe {
            path: "/hooks/shopify",
            body: sh.clone(),
            genuine: shopify("shopify-secret", "w-1", &sh),
            refused: vec![
                (
                    "tampered",
                    shopify("shopify-secret", "w-1", &sh),
                    tampered(&sh),
                ),
                (
                    "unsigned",
                    headers(&[("x-shopify-webhook-id", "w-1".into())]),
                    sh.clone(),
                ),
                ("other secret", shopify("not-it", "w-1", &sh), sh.clone()),
            ],
        },
        Recipe {
            path: "/hooks/slack",
            body: sl.clone(),
            genuine: slack("slack-secret", t, &sl),
            refused: vec![
                ("tampered", slack("slack-secret", t, &sl), tampered(&sl)),
                ("unsigned", headers(&[]), sl.clone()),
                ("other secret", slack("not-it", t, &sl), sl.clone()),
                ("stale", slack("slack-secret", t - 3600, &sl), sl.clone()),
            ],
        },
        Recipe {
            path: "/hooks/paddle",
            body: pd.clone(),
            // The old secret: rotation.
            genuine: paddle(&["paddle-old"], t, &pd),
            refused: vec![
                ("tampered", paddle(&["paddle-new"], t, &pd), tampered(&pd)),
                ("unsigned", headers(&[]), pd.clone()),
                ("other secret", paddle(&["not-it"], t, &pd), pd.clone()),
                ("stale", paddle(&["paddle-new"], t - 3600, &pd), pd.clone()),
            ],
        },
        Recipe {
            path: "/hooks/square",
            body: sq.clone(),
            genuine: square("square-secret", url, &sq),
            refused: vec![
                ("tampered", square("square-secret", url, &sq), tampered(&sq)),
                ("unsigned", headers(&[]), sq.clone()),
                ("other secret", square("not-it", url, &sq), sq.clone()),
                (
                    "other url",
                    square("square-secret", "https://example.com/x", &sq),
                    sq.clone(),
                ),
            ],
        },
    ]
}

fn sample(text: &str, name: &str, want: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .find(|(series, _)| {
            series
                .strip_prefix(name)
                .is_some_and(|r| r.starts_with('{'))
                && want.iter().all(|w| series.contains(w))
        })
        .and_then(|(_, v)| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread")]
async fn each_recipe_runs_copies_once_and_never_forwards_a_forgery() {
    let _storms = gateway_support::beside_storms().await;
    let up = Upstream::start().await;
    let metrics = common::free_addr();
    let dir = config_dir(
        &up.url(),
        &format!("metrics_listen = \"{metrics}\"\n{RECIPES}"),
    );
    let env = [("GITHUB_SECRET", GITHUB), ("GITHUB_SECRET_OLD", GITHUB_OLD)];
    let (code, err) = check(&dir, &env);
    assert_eq!(code, 0, "{err}");
    // GitHub's and Shopify's delivery ids are headers they do not sign.
    assert!(
        err.contains("preset `github`: its key (header:x-github-delivery) is not covered"),
        "{err}"
    );
    assert!(err.contains("preset `shopify`"), "{err}");
    assert!(!err.contains("preset `slack`"), "{err}");
    let gw = Proc::start(
        &["--config", dir.join("gateway.toml").to_str().unwrap()],
        &env,
        Stdio::null(),
    );
    let client = client();
    for r in recipes() {
        for (what, h, body) in &r.refused {
            let a = &storm(&client, gw.addr, r.path, h, body, 2).await;
            for a in a {
                assert_eq!(a.status, 401, "{} {what}: {}", r.path, a.text());
            }
        }
        assert_eq!(
            up.calls(r.path),
            0,
            "{}: a refused copy reached the upstream",
            r.path
        );
        let answers = storm(&client, gw.addr, r.path, &r.genuine, &r.body, 5).await;
        for a in &answers {
            assert_eq!(a.status, 200, "{}: {}", r.path, a.text());
        }
        assert_eq!(up.calls(r.path), 1, "{}: the copies ran once", r.path);
        // A forgery after the genuine copy is refused, not replayed.
        let (what, h, body) = &r.refused[0];
        let a = &storm(&client, gw.addr, r.path, h, body, 1).await[0];
        assert_eq!(a.status, 401, "{} {what} after: {}", r.path, a.text());
        assert_eq!(up.calls(r.path), 1);
    }
    // The preset's own success reply.
    let gh = &recipes()[0];
    let a = &storm(&client, gw.addr, gh.path, &gh.genuine, &gh.body, 1).await[0];
    assert_eq!((a.status, a.text().as_str()), (200, "thanks"));
    // The old GitHub secret verifies (rotation).
    let body = br#"{"ref":"refs/heads/dev"}"#;
    let a = &storm(
        &client,
        gw.addr,
        gh.path,
        &github(GITHUB_OLD, "d-2", body),
        body,
        1,
    )
    .await[0];
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(up.calls(gh.path), 2);
    // fingerprint = "body": the same delivery id with another (signed) body
    // gets the failure reply and never reaches the upstream.
    let other = br#"{"ref":"refs/heads/other"}"#;
    let a = &storm(
        &client,
        gw.addr,
        gh.path,
        &github(GITHUB, "d-1", other),
        other,
        1,
    )
    .await[0];
    assert_eq!((a.status, a.text().as_str()), (503, "again"));
    assert_eq!(up.calls(gh.path), 2);
    // Paddle's fingerprint is the event type: another one with the same
    // event id is a mismatch (the default failure reply, 500).
    let pd = br#"{"event_id":"evt_01h8bzakzx3hm2fmen703n5q45","event_type":"transaction.updated"}"#;
    let a = &storm(
        &client,
        gw.addr,
        "/hooks/paddle",
        &paddle(&["paddle-new"], now(), pd),
        pd,
        1,
    )
    .await[0];
    assert_eq!(a.status, 500, "{}", a.text());
    assert_eq!(up.calls("/hooks/paddle"), 1);

    let (_, text) = get(metrics, "/metrics");
    for preset in ["github", "shopify", "slack", "paddle", "square"] {
        let label = format!("preset=\"{preset}\"");
        let executed = sample(
            &text,
            "idempotency_requests_total",
            &[&label, "outcome=\"executed\""],
        );
        assert!(executed.is_some_and(|n| n >= 1.0), "{preset}: {text}");
        let refused = sample(
            &text,
            "idempotency_requests_total",
            &[&label, "outcome=\"unverified\""],
        );
        assert!(refused.is_some_and(|n| n >= 3.0), "{preset}: {text}");
    }
    assert!(!text.contains("preset=\"custom\""), "{text}");
    let _ = std::fs::remove_dir_all(dir);
}

/// Slack's `url_verification` handshake carries no `event_id`: with
/// `without_key = "pass"` it is verified, then forwarded unguarded, and the
/// upstream's answer (the challenge) goes back as it is.
#[tokio::test(flavor = "multi_thread")]
async fn slack_url_verification_passes_through_to_the_upstream() {
    let _storms = gateway_support::beside_storms().await;
    let up = Upstream::start().await;
    let dir = config_dir(&up.url(), RECIPES);
    let env = [("GITHUB_SECRET", GITHUB), ("GITHUB_SECRET_OLD", GITHUB_OLD)];
    let gw = Proc::start(
        &["--config", dir.join("gateway.toml").to_str().unwrap()],
        &env,
        Stdio::null(),
    );
    let client = client();
    let body = br#"{"token":"Jhj5dZrVaK7ZwHHjRyZWjbDl","challenge":"3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P","type":"url_verification"}"#;
    for n in 1..=2 {
        let a = &storm(
            &client,
            gw.addr,
            "/hooks/slack",
            &slack("slack-secret", now(), body),
            body,
            1,
        )
        .await[0];
        assert_eq!(a.status, 200);
        assert_eq!(a.text(), format!("upstream call {n} for /hooks/slack"));
        assert!(!a.replayed());
    }
    assert_eq!(up.calls("/hooks/slack"), 2);
    assert_eq!(up.last("/hooks/slack").body.as_ref(), body);
    // Unsigned, it never reaches the upstream.
    let a = &storm(&client, gw.addr, "/hooks/slack", &headers(&[]), body, 1).await[0];
    assert_eq!(a.status, 401);
    assert_eq!(up.calls("/hooks/slack"), 2);
    let _ = std::fs::remove_dir_all(dir);
}

/// Bad tables: `FILE:LINE: reason`, exit 2.
#[test]
fn check_config_names_the_line_of_a_bad_table() {
    let preset = |body: &str| format!("[[preset]]\nname = \"acme\"\n{body}\n");
    let route = "[[route]]\nprefix = \"/hooks/acme\"\npreset = \"acme\"\n";
    let cases: Vec<(String, usize, &str)> = vec![
        (preset("key = \"cookie:x\""), 5, "unknown key source `cookie:x`"),
        (
            preset("key = \"header:x-id\"\nsignature = { scheme = \"hmac-sha256\", header = \"x-sig\", signed = \"{bdy}\" }"),
            6,
            "unknown placeholder `{bdy}`",
        ),
        (
            format!(
                "{}[[route]]\nprefix = \"/hooks/acme\"\npreset = \"nope\"\n",
                preset("key = \"header:x-id\"")
            ),
            8,
            "unknown preset `nope`",
        ),
        (
            format!("{}{}", preset("key = \"header:x-id\""), preset("key = \"header:x-id\"")),
            7,
            "preset `acme` is defined twice",
        ),
        (preset("key = \"header:x-id\"").replace("acme", "stripe"), 4, "built-in preset"),
        (
            format!(
                "{}{route}",
                preset("key = \"header:x-id\"\nsignature = { scheme = \"hmac-sha256\", header = \"x-sig\" }")
            ),
            8,
            "route `/hooks/acme`: preset `acme` has a `signature`, but the route has no `verify.secrets`",
        ),
    ];
    for (text, line, reason) in cases {
        let dir = config_dir("http://127.0.0.1:9", &text);
        let (code, err) = check(&dir, &[]);
        assert_eq!(code, 2, "{text}\n{err}");
        let at = format!("gateway.toml:{line}: ");
        assert!(
            err.contains(&at) && err.contains(reason),
            "want {at}{reason}, got {err}\n{text}"
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// A preset whose signature does not sign what the key, the fingerprint or
/// the timestamp is read from would call unsigned bytes signed: a genuine
/// signature over a header would let anyone send any body, and a timestamp
/// the template does not sign proves nothing about staleness. Refused,
/// `FILE:LINE: reason` naming what is unsigned, exit 2.
#[test]
fn check_config_refuses_a_preset_that_calls_unsigned_bytes_signed() {
    let preset = |body: &str| {
        format!(
            "[[preset]]\nname = \"acme\"\n{body}\n[[route]]\nprefix = \"/hooks/acme\"\n\
             preset = \"acme\"\nverify = {{ secrets = [\"s\"] }}\n"
        )
    };
    let cases: Vec<(String, usize, &str)> = vec![
        (
            preset("key = \"json:/id\"\nsignature = { scheme = \"hmac-sha256\", header = \"x-sig\", signed = \"{header:x-id}.{timestamp}\", timestamp_header = \"x-ts\" }"),
            6,
            "preset `acme`: its key json:/id is read from the body, which the signature does not sign",
        ),
        (
            preset("key = [\"header:x-id\", \"form:trade_no\"]\nsignature = { scheme = \"hmac-sha256\", header = \"x-sig\", signed = \"{header:x-id}\" }"),
            6,
            "its key form:trade_no is read from the body, which the signature does not sign",
        ),
        (
            preset("key = \"header:x-id\"\nfingerprint = \"body\"\nsignature = { scheme = \"hmac-sha256\", header = \"x-sig\", signed = \"{header:x-id}\" }"),
            7,
            "its fingerprint (the body) is read from the body, which the signature does not sign",
        ),
        (
            preset("key = \"header:x-id\"\nfingerprint = [\"xml:amount\"]\nsignature = { scheme = \"hmac-sha256\", header = \"x-sig\", signed = \"{header:x-id}\" }"),
            7,
            "its fingerprint xml:amount is read from the body, which the signature does not sign",
        ),
        (
            preset("key = \"json:/id\"\nsignature = { scheme = \"hmac-sha256\", header = \"x-sig\", timestamp_header = \"x-ts\" }"),
            6,
            "its timestamp (header x-ts) is not signed",
        ),
        (
            preset("key = \"json:/id\"\nsignature = { scheme = \"hmac-sha256\", header = \"x-sig\", signature_field = \"h1\", timestamp_field = \"ts\", signed = \"{body}\" }"),
            6,
            "its timestamp (pair ts) is not signed",
        ),
    ];
    for (text, line, reason) in cases {
        let dir = config_dir("http://127.0.0.1:9", &text);
        let (code, err) = check(&dir, &[]);
        assert_eq!(code, 2, "{text}\n{err}");
        let at = format!("gateway.toml:{line}: ");
        assert!(
            err.contains(&at) && err.contains(reason),
            "want {at}{reason}, got {err}\n{text}"
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Square's `{url}` is the URL the request was sent to: the route's
/// `public_url` for its prefix, then the rest of the request's path and its
/// query. A genuine signature made for the route's URL does not verify at
/// another path or query under it (401, the upstream never called), and one
/// made for that path and query does.
#[tokio::test(flavor = "multi_thread")]
async fn square_url_is_the_url_the_request_was_sent_to() {
    let _storms = gateway_support::beside_storms().await;
    let up = Upstream::start().await;
    let dir = config_dir(&up.url(), RECIPES);
    let env = [("GITHUB_SECRET", GITHUB), ("GITHUB_SECRET_OLD", GITHUB_OLD)];
    let gw = Proc::start(
        &["--config", dir.join("gateway.toml").to_str().unwrap()],
        &env,
        Stdio::null(),
    );
    let client = client();
    let body = br#"{"merchant_id":"6SSW7HV8K2ST5","type":"refund.created","event_id":"0d3a2b4e-1f5c-4c9e-9a7b-3e1c2d4f5a6b"}"#;
    let signed_for_route = square("square-secret", "https://example.com/hooks/square", body);
    for path in [
        "/hooks/square/refund?admin=1&amount=999",
        "/hooks/square?admin=1",
        "/hooks/square/refund",
    ] {
        let a = &storm(&client, gw.addr, path, &signed_for_route, body, 1).await[0];
        assert_eq!(a.status, 401, "{path}: {}", a.text());
    }
    let seen = up.seen();
    assert!(
        seen.is_empty(),
        "a signature for another URL was forwarded: {seen:?}"
    );
    // Signed for the path and query it is sent to: verified, forwarded there.
    let url = "https://example.com/hooks/square/refund?admin=1&amount=999";
    let a = &storm(
        &client,
        gw.addr,
        "/hooks/square/refund?admin=1&amount=999",
        &square("square-secret", url, body),
        body,
        1,
    )
    .await[0];
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(up.seen().len(), 1);
    let _ = std::fs::remove_dir_all(dir);
}
