//! `idempotency-gateway send URL --preset NAME`: a realistic notification
//! of the preset's channel, signed as the channel signs it, sent to URL and
//! again for each copy; each reply printed with whether the gateway ran it
//! or replayed it (its `idempotent-replayed` header).

use crate::commands::escape::shown_bytes;
use crate::commands::notification::{self, Channel, ConfiguredPreset, FieldArg, Keys};
use crate::commands::signing::{read_secret, RsaSigner};
use crate::commands::test_keys::{PAYPAL_WEBHOOK_ID, WECHATPAY_V3_API_V3_KEY};
use bytes::Bytes;
use clap::Args;
use http::{header, HeaderName, HeaderValue, Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tower_idempotency::dedup::REPLAYED_HEADER;
use tower_idempotency::Preset;

/// `idempotency-gateway send URL --preset NAME`.
#[derive(Args, Debug, Clone)]
pub(crate) struct Send {
    /// http[s]://HOST:PORT/PATH of the gateway's route
    url: String,
    /// The route's preset: a built-in one (wechatpay-v3, wechatpay-v2, alipay, stripe,
    /// paypal, adyen, standard-webhooks, idempotency-key, client-token) or a [[preset]]
    /// of --config FILE
    #[arg(long, value_name = "NAME")]
    preset: String,
    /// The channel's secret (Stripe's whsec_…, Adyen's hex HMAC key, ...) or, for
    /// wechatpay-v3, alipay and paypal, the RSA private key: `test-keys DIR` writes test
    /// ones
    #[arg(long, value_name = "FILE")]
    secret: Option<PathBuf>,
    /// Send the notification this many times: the channel's retries, each re-signed
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    copies: u32,
    /// Set a field of the body: NAME=TEXT, or NAME:=JSON for a number or an object; a
    /// JSON NAME may be a pointer (/data/object/amount). `id=…` sets the notification's
    /// id, wherever the preset reads its key
    #[arg(long, value_name = "NAME=VALUE", value_parser = notification::field)]
    field: Vec<FieldArg>,
    /// PEM CA certificates trusted for an https:// URL, besides the Mozilla roots (a test
    /// gateway's own --tls-cert)
    #[arg(long, value_name = "FILE")]
    ca: Option<PathBuf>,
}

/// The `[[preset]]` tables of the config file.
#[derive(Deserialize)]
struct PresetTables {
    #[serde(default)]
    preset: Vec<ConfiguredPreset>,
}

/// Runs `send`: exit status 0 when every copy got a 2xx, else 1.
pub(crate) fn run(a: &Send, config: Option<&Path>) -> Result<(), String> {
    let channel = channel(&a.preset, config)?;
    let keys = keys(&channel, a.secret.as_deref())?;
    let mut fields = a.field.clone();
    let id = match fields.iter().position(|f| f.name() == "id") {
        Some(i) => fields.remove(i).text(),
        None => notification::new_id(&channel),
    };
    let n = notification::build(&channel, &id, &fields, &keys)?;
    let mut url = a.url.clone();
    if let Some((k, v)) = &n.query {
        url += if url.contains('?') { "&" } else { "?" };
        url += &crate::commands::client::query(&[(k, Some(v))]);
    }
    let uri: http::Uri = url
        .parse()
        .map_err(|e| format!("{}: not a URL: {e}", a.url))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err(format!("{}: expected an http:// or https:// URL", a.url));
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    let client: HttpsClient =
        Client::builder(TokioExecutor::new()).build(connector(a.ca.as_deref())?);
    let mut out = std::io::stdout().lock();
    let stdout_failed = |e: std::io::Error| format!("cannot write to stdout: {e}");
    writeln!(out, "{} {} (id {id}) to {url}", a.preset, n.content_type).map_err(stdout_failed)?;
    let mut failed = Vec::new();
    let token = match channel {
        Channel::ClientToken => Some(rt.block_on(client_token(&client, &uri))?),
        _ => None,
    };
    for copy in 1..=a.copies {
        let mut req = Request::builder()
            .method(Method::POST)
            .uri(uri.clone())
            .header(header::CONTENT_TYPE, n.content_type)
            .header(header::USER_AGENT, "idempotency-gateway-send");
        let signed = notification::sign_copy(&channel, &n, &keys, &a.url)?;
        for (k, v) in n.headers.iter().chain(&signed) {
            req = req.header(header_name(k)?, header_value(v)?);
        }
        if let Some(t) = &token {
            req = req.header(tower_idempotency::channel::TOKEN_HEADER, header_value(t)?);
        }
        let req = req
            .body(Full::new(Bytes::from(n.body.clone())))
            .map_err(|e| format!("{url}: {e}"))?;
        let (status, replayed, body) = rt.block_on(async {
            let res = tokio::time::timeout(Duration::from_secs(30), client.request(req))
                .await
                .map_err(|_| format!("{url}: no answer within 30s"))?
                .map_err(|e| format!("cannot reach {url}: {}", chain(&e)))?;
            let replayed = res
                .headers()
                .get(REPLAYED_HEADER)
                .is_some_and(|v| v == "true");
            let status = res.status();
            let body = res
                .into_body()
                .collect()
                .await
                .map_err(|e| format!("{url}: {e}"))?
                .to_bytes();
            Ok::<_, String>((status, replayed, body))
        })?;
        let what = match (replayed, copy) {
            _ if !status.is_success() => "not run",
            (true, _) => "replayed",
            (false, 1) => "first run",
            (false, _) => "ran again (no replay marker)",
        };
        let shown = if body.len() > 1024 {
            format!("{} … ({} bytes)", shown_bytes(&body[..1024]), body.len())
        } else {
            shown_bytes(&body)
        };
        writeln!(out, "copy {copy}/{}: {status}, {what}: {shown}", a.copies)
            .map_err(stdout_failed)?;
        if !status.is_success() {
            failed.push((copy, status));
        }
    }
    out.flush().map_err(stdout_failed)?;
    match failed.first() {
        None => Ok(()),
        Some((_, s)) if *s == http::StatusCode::UNAUTHORIZED => Err(format!(
            "the gateway refused the signature ({s}): the route's `verify` keys do not match {}",
            a.secret.as_deref().map_or(
                "the notification (it has no --secret)".to_owned(),
                |p| format!("--secret {}", p.display())
            )
        )),
        Some(_) => Err(format!(
            "{} of {} copies were not answered with a success ({})",
            failed.len(),
            a.copies,
            failed
                .iter()
                .map(|(c, s)| format!("copy {c}: {}", s.as_u16()))
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

/// The preset named `name`: built in, or a `[[preset]]` of `config`.
fn channel(name: &str, config: Option<&Path>) -> Result<Channel, String> {
    if let Some(c) = Channel::builtin(name) {
        return Ok(c);
    }
    let known = || {
        format!(
            "the built-in presets are {}",
            Preset::builtin_names().join(", ")
        )
    };
    let Some(path) = config else {
        return Err(format!(
            "no preset `{name}`: {}; a [[preset]] of a config file needs --config FILE",
            known()
        ));
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let tables: PresetTables =
        toml::from_str(&text).map_err(|e| format!("{}: {}", path.display(), e.message()))?;
    tables
        .preset
        .into_iter()
        .find(|p| p.name == name)
        .map(|p| Channel::Configured(Box::new(p)))
        .ok_or_else(|| {
            format!(
                "no preset `{name}`: {}, and {} has no [[preset]] of that name",
                known(),
                path.display()
            )
        })
}

/// The keys `--secret` names (and, beside a WeChat Pay v3 or PayPal private
/// key, the APIv3 key and the webhook id `test-keys` writes there).
fn keys(channel: &Channel, secret: Option<&Path>) -> Result<Keys, String> {
    let Some(path) = secret else {
        if channel.signs() {
            return Err(
                "this preset signs its notifications: give the secret (or private key) with \
                 --secret FILE (`idempotency-gateway test-keys DIR` writes test ones)"
                    .into(),
            );
        }
        return Ok(Keys::default());
    };
    if !channel.signs_with_rsa() {
        return Ok(Keys {
            secret: Some(read_secret(path)?),
            ..Keys::default()
        });
    }
    let beside = |name: &str| path.parent().unwrap_or(Path::new(".")).join(name);
    let optional = |name: &str| {
        let p = beside(name);
        p.exists().then(|| read_secret(&p)).transpose()
    };
    Ok(Keys {
        rsa: Some(RsaSigner::read(path)?),
        api_v3_key: match channel {
            Channel::WechatPayV3 => optional(WECHATPAY_V3_API_V3_KEY)?.map(String::into_bytes),
            _ => None,
        },
        webhook_id: match channel {
            Channel::PayPal => optional(PAYPAL_WEBHOOK_ID)?,
            _ => None,
        },
        ..Keys::default()
    })
}

/// The client `send` sends with: HTTP, or HTTPS.
type HttpsClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// `GET URL/idempotency-token`: the one-time token a `client-token` route
/// issues under its prefix (URL is the prefix).
async fn client_token(client: &HttpsClient, uri: &http::Uri) -> Result<String, String> {
    let path = uri.path().trim_end_matches('/');
    let at = format!(
        "{}://{}{path}/idempotency-token",
        uri.scheme_str().unwrap_or("http"),
        uri.authority().map_or("", |a| a.as_str())
    );
    let req = Request::get(&at)
        .body(Full::new(Bytes::new()))
        .map_err(|e| format!("{at}: {e}"))?;
    let res = client
        .request(req)
        .await
        .map_err(|e| format!("cannot reach {at}: {e}"))?;
    let status = res.status();
    let body = res
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("{at}: {e}"))?
        .to_bytes();
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    json["token"].as_str().map(str::to_owned).ok_or_else(|| {
        format!(
            "{at} answered {status} without a token (a client-token route issues them at \
             PREFIX/idempotency-token: give the route's prefix as URL)"
        )
    })
}

/// An error and its sources (`client error (Connect): invalid peer
/// certificate: UnknownIssuer`).
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out += &format!(": {s}");
        source = s.source();
    }
    out
}

fn header_name(k: &str) -> Result<HeaderName, String> {
    HeaderName::from_bytes(k.as_bytes()).map_err(|_| format!("`{k}` is not a header name"))
}

fn header_value(v: &str) -> Result<HeaderValue, String> {
    HeaderValue::from_str(v).map_err(|_| format!("{v:?} is not a header value"))
}

/// HTTP, or HTTPS trusting the Mozilla roots and the certificates of `ca`.
fn connector(ca: Option<&Path>) -> Result<HttpsConnector<HttpConnector>, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = ca {
        crate::commands::client::add_certificates(&mut roots, path)?;
    }
    crate::commands::client::https_connector(roots)
}
