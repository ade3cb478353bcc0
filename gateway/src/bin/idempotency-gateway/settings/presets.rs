//! The config file's `[[preset]]` tables: presets built from parts (key
//! sources, fingerprint, replies, an HMAC signature scheme), read into the
//! library's `Preset::builder` and `HmacScheme::builder`.

use crate::settings::parse;
use crate::settings::spanned::{At, Field as Text, SizeValue};
use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};
use serde::Deserialize;
use std::collections::BTreeMap;
use toml::Spanned;
use tower_idempotency::key::{Field, FingerprintSpec};
use tower_idempotency::normalize::FixedReply;
use tower_idempotency::verify::{
    BodyShape, HmacAlgorithm, HmacScheme, HmacSchemeBuilder, SecretEncoding, SignatureEncoding,
    SignedTemplate,
};
use tower_idempotency::{Preset, WithoutKey};

/// One `[[preset]]` table.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FilePreset {
    name: Spanned<String>,
    key: Spanned<Sources>,
    fingerprint: Option<Spanned<Sources>>,
    success: Option<Spanned<FileReply>>,
    failure: Option<Spanned<FileReply>>,
    without_key: Text,
    signature: Option<Spanned<FileSignature>>,
    pub(crate) window: Text,
    pub(crate) lease: Text,
    pub(crate) wait: Text,
    pub(crate) max_run: Text,
    pub(crate) max_body: Option<Spanned<SizeValue>>,
}

/// A source or a list of sources.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Sources {
    One(String),
    Many(Vec<String>),
}

/// `{ status = 200, body = "", content_type = "…" }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileReply {
    status: u16,
    body: Option<String>,
    content_type: Option<String>,
}

/// `signature = { scheme = "hmac-sha256", header = "…", … }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSignature {
    scheme: String,
    header: String,
    prefix: Option<String>,
    encoding: Option<String>,
    signed: Option<String>,
    timestamp_header: Option<String>,
    signature_field: Option<String>,
    timestamp_field: Option<String>,
    secret_encoding: Option<String>,
}

/// A configured preset, ready for its routes.
pub(crate) struct Configured {
    pub(crate) preset: Preset,
    /// Its signature scheme without secrets (each route gives its own, and
    /// its `public_url`).
    pub(crate) signature: Option<HmacSchemeBuilder>,
    /// A warning for the routes of a preset whose key the signature does
    /// not cover.
    pub(crate) unsigned_key: Option<String>,
    /// The preset's own route settings (precedence: route, preset, global).
    pub(crate) own: crate::settings::routes::Global,
}

/// The file's presets by name.
pub(crate) type Presets = BTreeMap<String, Configured>;

/// Reads every `[[preset]]` table; an error names its line.
pub(crate) fn from_file(tables: &[Spanned<FilePreset>], at: &At<'_>) -> Result<Presets, String> {
    let mut out = Presets::new();
    for t in tables {
        let t = t.get_ref();
        let name = t.name.get_ref();
        if out.contains_key(name) {
            return Err(at.err(t.name.span(), format!("preset `{name}` is defined twice")));
        }
        let configured = one(t, at)?;
        out.insert(name.clone(), configured);
    }
    Ok(out)
}

fn one(t: &FilePreset, at: &At<'_>) -> Result<Configured, String> {
    let name = t.name.get_ref();
    let key = sources(t.key.get_ref()).map_err(|e| at.err(t.key.span(), format!("`key`: {e}")))?;
    if key.is_empty() {
        return Err(at.err(t.key.span(), "`key`: give at least one source"));
    }
    let fingerprint = match &t.fingerprint {
        None => FingerprintSpec::None,
        Some(f) => match f.get_ref() {
            Sources::One(s) if s == "body" => FingerprintSpec::Body,
            Sources::One(s) if s == "none" => FingerprintSpec::None,
            other => FingerprintSpec::Fields(sources(other).map_err(|e| {
                at.err(
                    f.span(),
                    format!("`fingerprint`: {e} (or \"body\", \"none\")"),
                )
            })?),
        },
    };
    let fields: Vec<&Field> = key
        .iter()
        .chain(match &fingerprint {
            FingerprintSpec::Fields(f) => f.as_slice(),
            _ => &[],
        })
        .collect();
    let shape = fields.iter().find_map(|f| match f {
        Field::Json(_) => Some(BodyShape::Json),
        Field::Form(_) => Some(BodyShape::Form),
        Field::Xml(_) => Some(BodyShape::Xml),
        _ => None,
    });
    let own = crate::settings::routes::Global {
        window: at.value(&t.window, "window", parse::positive_duration)?,
        lease: at.value(&t.lease, "lease", parse::lease)?,
        wait: at.value(&t.wait, "wait", parse::duration)?,
        max_run: at.value(&t.max_run, "max_run", parse::positive_duration)?,
        max_body: at.value(&t.max_body, "max_body", parse::body_size)?,
        ..crate::settings::routes::Global::NONE
    };
    let mut builder = Preset::builder(name.clone())
        .key(key.clone())
        .fingerprint(fingerprint.clone());
    if let Some(r) = &t.success {
        builder = builder.success(reply(r.get_ref()).map_err(|e| at.err(r.span(), e))?);
    }
    if let Some(r) = &t.failure {
        builder = builder.failure(reply(r.get_ref()).map_err(|e| at.err(r.span(), e))?);
    }
    if let Some(w) = &t.without_key {
        builder = builder.without_key(match w.get_ref().as_str() {
            "refuse" => WithoutKey::Refuse,
            "pass" => WithoutKey::Pass,
            other => {
                return Err(at.err(
                    w.span(),
                    format!("`without_key`: `{other}`: expected \"refuse\" or \"pass\""),
                ))
            }
        });
    }
    if let Some(w) = own.window {
        builder = builder.window(w);
    }
    if let Some(w) = own.wait {
        builder = builder.wait(w);
    }
    if let Some(n) = own.max_body {
        builder = builder.max_body_bytes(n);
    }
    let preset = builder.build().map_err(|e| at.err(t.name.span(), e))?;
    let (signature, unsigned_key) = match &t.signature {
        None => (None, None),
        Some(s) => {
            let (scheme, template) =
                signature(name, s.get_ref(), shape).map_err(|e| at.err(s.span(), e))?;
            unsigned_reads(s.get_ref(), &template, &key, &fingerprint)
                .map_err(|e| at.err(s.span(), format!("preset `{name}`: {e}")))?;
            let unsigned: Vec<String> = key
                .iter()
                .filter(|f| match f {
                    Field::Header(h) => !template.uses_header(h),
                    Field::Query(_) => true,
                    _ => false,
                })
                .map(Field::to_string)
                .collect();
            let warning = (!unsigned.is_empty()).then(|| {
                format!(
                    "preset `{name}`: its key ({}) is not covered by the signature: a captured \
                     body replayed under a new key verifies and runs again; where the sender \
                     offers one, sign a timestamp (timestamp_header or timestamp_field, checked \
                     against verify.tolerance) or key on a field the sender signs",
                    unsigned.join(", ")
                )
            });
            (Some(scheme), warning)
        }
    };
    Ok(Configured {
        preset,
        signature,
        unsigned_key,
        own,
    })
}

/// Why the signature would call unsigned bytes signed: a key or a
/// fingerprint read from the body when `{body}` is not signed (anyone could
/// send any body under a genuine signature), or a timestamp the template
/// does not sign (any timestamp would pass the tolerance).
fn unsigned_reads(
    s: &FileSignature,
    template: &SignedTemplate,
    key: &[Field],
    fingerprint: &FingerprintSpec,
) -> Result<(), String> {
    let from_body = |f: &&Field| matches!(f, Field::Json(_) | Field::Form(_) | Field::Xml(_));
    if !template.uses_body() {
        let unsigned = |what: &str, read: String| {
            format!(
                "its {what} {read} is read from the body, which the signature does not sign \
                 (`signed` has no {{body}}): anyone could send any body under a genuine \
                 signature; sign {{body}}, or read the {what} from a signed header"
            )
        };
        if let Some(f) = key.iter().find(from_body) {
            return Err(unsigned("key", f.to_string()));
        }
        match fingerprint {
            FingerprintSpec::Body => return Err(unsigned("fingerprint", "(the body)".into())),
            FingerprintSpec::Fields(fields) => {
                if let Some(f) = fields.iter().find(from_body) {
                    return Err(unsigned("fingerprint", f.to_string()));
                }
            }
            _ => {}
        }
    }
    if !template.uses_timestamp() {
        let source = match (&s.timestamp_header, &s.timestamp_field) {
            (Some(h), _) => Some(format!("header {h}")),
            (None, Some(f)) => Some(format!("pair {f}")),
            (None, None) => None,
        };
        if let Some(source) = source {
            return Err(format!(
                "its timestamp ({source}) is not signed (`signed` has no {{timestamp}}): any \
                 timestamp would pass the tolerance; sign {{timestamp}} as the sender does, or \
                 drop the timestamp"
            ));
        }
    }
    Ok(())
}

/// `header:NAME | json:/POINTER | form:FIELD | xml:ELEMENT | query:NAME`.
pub(crate) fn source(s: &str) -> Result<Field, String> {
    let (kind, rest) = s.split_once(':').unwrap_or((s, ""));
    let empty = || format!("`{s}`: the source names nothing after `{kind}:`");
    match kind {
        "header" => HeaderName::from_bytes(rest.as_bytes())
            .map(Field::header)
            .map_err(|_| format!("`{s}`: not a header name")),
        "json" if rest.starts_with('/') => Ok(Field::json(rest.to_owned())),
        "json" => Err(format!("`{s}`: a JSON pointer starts with `/` (json:/id)")),
        "form" | "xml" | "query" if rest.is_empty() => Err(empty()),
        "form" => Ok(Field::form(rest.to_owned())),
        "xml" => Ok(Field::xml(rest.to_owned())),
        "query" => Ok(Field::query(rest.to_owned())),
        _ => Err(format!(
            "unknown key source `{s}`: expected header:NAME, json:/POINTER, form:FIELD, \
             xml:ELEMENT or query:NAME"
        )),
    }
}

fn sources(s: &Sources) -> Result<Vec<Field>, String> {
    match s {
        Sources::One(one) => Ok(vec![source(one)?]),
        Sources::Many(many) => many.iter().map(|s| source(s)).collect(),
    }
}

fn reply(r: &FileReply) -> Result<FixedReply, String> {
    let status = StatusCode::from_u16(r.status)
        .ok()
        .filter(|s| (200..600).contains(&s.as_u16()))
        .ok_or_else(|| format!("`status`: {} is not an HTTP status (200 to 599)", r.status))?;
    let content_type = r
        .content_type
        .as_deref()
        .map(|ct| {
            HeaderValue::from_str(ct)
                .map_err(|_| format!("`content_type`: {ct:?} is not a header value"))
        })
        .transpose()?;
    let body = Bytes::from(r.body.clone().unwrap_or_default());
    Ok(FixedReply::new(status, content_type, Some(body)))
}

fn signature(
    preset: &str,
    s: &FileSignature,
    shape: Option<BodyShape>,
) -> Result<(HmacSchemeBuilder, SignedTemplate), String> {
    let algorithm = HmacAlgorithm::from_name(&s.scheme).ok_or_else(|| {
        format!(
            "`signature.scheme`: `{}`: expected hmac-sha256, hmac-sha1 or hmac-sha512",
            s.scheme
        )
    })?;
    HeaderName::from_bytes(s.header.as_bytes())
        .map_err(|_| format!("`signature.header`: {:?} is not a header name", s.header))?;
    let mut b = HmacScheme::builder(preset.to_owned(), algorithm, &s.header);
    if let Some(p) = &s.prefix {
        b = b.prefix(p.clone());
    }
    if let Some(e) = &s.encoding {
        b = b.encoding(SignatureEncoding::from_name(e).ok_or_else(|| {
            format!("`signature.encoding`: `{e}`: expected \"hex\" or \"base64\"")
        })?);
    }
    let template: SignedTemplate = match &s.signed {
        Some(t) => t.parse().map_err(|e| format!("`signature.signed`: {e}"))?,
        None => SignedTemplate::default(),
    };
    if template.uses_timestamp() && s.timestamp_header.is_none() && s.timestamp_field.is_none() {
        return Err(
            "`signature.signed` holds {timestamp}: say where it comes from (timestamp_header \
             or timestamp_field)"
                .into(),
        );
    }
    b = b.signed(template.clone());
    if let Some(h) = &s.timestamp_header {
        HeaderName::from_bytes(h.as_bytes())
            .map_err(|_| format!("`signature.timestamp_header`: {h:?} is not a header name"))?;
        b = b.timestamp_header(h);
    }
    match (&s.signature_field, &s.timestamp_field) {
        (None, Some(_)) => {
            return Err("`signature.timestamp_field` goes with `signature_field`".into())
        }
        (Some(_), Some(_)) if s.timestamp_header.is_some() => {
            return Err(
                "the timestamp comes from `timestamp_field` or `timestamp_header`, not both".into(),
            )
        }
        _ => {}
    }
    if let Some(f) = &s.signature_field {
        b = b.signature_field(f.clone());
    }
    if let Some(f) = &s.timestamp_field {
        b = b.timestamp_field(f.clone());
    }
    if let Some(e) = &s.secret_encoding {
        b = b.secret_encoding(SecretEncoding::from_name(e).ok_or_else(|| {
            format!("`signature.secret_encoding`: `{e}`: expected \"raw\" or \"base64\"")
        })?);
    }
    if let Some(shape) = shape {
        b = b.body_shape(shape);
    }
    Ok((b, template))
}
