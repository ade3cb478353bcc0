//! A configured HMAC signature scheme: for senders without a verifier of
//! their own (GitHub, Shopify, Slack, Paddle, Square, an internal system).

use super::keys::{base64_key, SigningKeyError};
use super::{
    any_mac_matches, check_timestamp, too_many_signatures, Verified, Verifier, VerifyError,
    MAX_SIGNATURES,
};
use bytes::Bytes;
use http::request::Parts;
use http::HeaderName;
use ring::hmac;
use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// The MAC of an [`HmacScheme`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum HmacAlgorithm {
    /// HMAC-SHA1 (`hmac-sha1`; GitHub's legacy `X-Hub-Signature`).
    Sha1,
    /// HMAC-SHA256 (`hmac-sha256`).
    Sha256,
    /// HMAC-SHA512 (`hmac-sha512`).
    Sha512,
}

impl HmacAlgorithm {
    /// The algorithm by its configuration name: `hmac-sha1`, `hmac-sha256`
    /// or `hmac-sha512`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "hmac-sha1" => Some(Self::Sha1),
            "hmac-sha256" => Some(Self::Sha256),
            "hmac-sha512" => Some(Self::Sha512),
            _ => None,
        }
    }

    fn ring(self) -> hmac::Algorithm {
        match self {
            Self::Sha1 => hmac::HMAC_SHA1_FOR_LEGACY_USE_ONLY,
            Self::Sha256 => hmac::HMAC_SHA256,
            Self::Sha512 => hmac::HMAC_SHA512,
        }
    }
}

/// How a signature is written in its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SignatureEncoding {
    /// Hexadecimal digits, either case (the default).
    #[default]
    Hex,
    /// Standard base64, padded.
    Base64,
}

impl SignatureEncoding {
    /// The encoding by its configuration name: `hex` or `base64`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "hex" => Some(Self::Hex),
            "base64" => Some(Self::Base64),
            _ => None,
        }
    }

    fn decode(self, s: &str) -> Result<Vec<u8>, VerifyError> {
        use base64::Engine;
        let malformed = || VerifyError::Malformed(Cow::Borrowed("signature encoding"));
        match self {
            Self::Hex => hex::decode(s).map_err(|_| malformed()),
            Self::Base64 => base64::engine::general_purpose::STANDARD
                .decode(s)
                .map_err(|_| malformed()),
        }
    }
}

/// How a configured secret is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SecretEncoding {
    /// The secret's bytes are the key, as they are (the default).
    #[default]
    Raw,
    /// The key is the base64 decoding of the secret, after an optional
    /// `whsec_` prefix (Standard Webhooks' secrets).
    Base64,
}

impl SecretEncoding {
    /// The encoding by its configuration name: `raw` or `base64`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "raw" => Some(Self::Raw),
            "base64" => Some(Self::Base64),
            _ => None,
        }
    }
}

/// One part of a [`SignedTemplate`].
#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    Body,
    Timestamp,
    Header(HeaderName),
    Url,
}

/// What a sender signs: literal text and the placeholders `{body}` (the raw
/// body), `{timestamp}` (the signed timestamp, as sent), `{header:NAME}` (a
/// header's value) and `{url}` (the URL the request was sent to: see
/// [`HmacSchemeBuilder::url`]).
///
/// ```
/// use tower_idempotency::verify::SignedTemplate;
/// let slack: SignedTemplate = "v0:{timestamp}:{body}".parse().unwrap();
/// assert!(slack.uses_timestamp());
/// assert!("{bdy}".parse::<SignedTemplate>().is_err());
/// assert!("{body".parse::<SignedTemplate>().is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedTemplate {
    parts: Vec<Part>,
}

/// A template that cannot be read: an unknown placeholder, an unclosed `{`
/// or a `}` outside a placeholder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateError(String);

impl fmt::Display for TemplateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TemplateError {}

impl FromStr for SignedTemplate {
    type Err = TemplateError;

    fn from_str(s: &str) -> Result<Self, TemplateError> {
        let mut parts = Vec::new();
        let mut literal = String::new();
        let mut rest = s;
        while let Some(at) = rest.find(['{', '}']) {
            literal.push_str(&rest[..at]);
            if rest.as_bytes()[at] == b'}' {
                return Err(TemplateError(format!(
                    "`}}` outside a placeholder in {s:?} (placeholders: {{body}}, {{timestamp}}, \
                     {{header:NAME}}, {{url}})"
                )));
            }
            let Some(end) = rest[at..].find('}') else {
                return Err(TemplateError(format!("unclosed `{{` in {s:?}")));
            };
            let name = &rest[at + 1..at + end];
            let part = match name {
                "body" => Part::Body,
                "timestamp" => Part::Timestamp,
                "url" => Part::Url,
                _ => match name.strip_prefix("header:") {
                    Some(h) => Part::Header(HeaderName::from_bytes(h.as_bytes()).map_err(|_| {
                        TemplateError(format!("`{{header:{h}}}`: not a header name"))
                    })?),
                    None => {
                        return Err(TemplateError(format!(
                            "unknown placeholder `{{{name}}}` (placeholders: {{body}}, \
                             {{timestamp}}, {{header:NAME}}, {{url}})"
                        )))
                    }
                },
            };
            if !literal.is_empty() {
                parts.push(Part::Literal(std::mem::take(&mut literal)));
            }
            parts.push(part);
            rest = &rest[at + end + 1..];
        }
        literal.push_str(rest);
        if !literal.is_empty() {
            parts.push(Part::Literal(literal));
        }
        Ok(Self { parts })
    }
}

impl Default for SignedTemplate {
    /// `{body}`.
    fn default() -> Self {
        Self {
            parts: vec![Part::Body],
        }
    }
}

impl SignedTemplate {
    /// Whether the template holds `{timestamp}`.
    pub fn uses_timestamp(&self) -> bool {
        self.parts.contains(&Part::Timestamp)
    }

    /// Whether the template holds `{body}`.
    pub fn uses_body(&self) -> bool {
        self.parts.contains(&Part::Body)
    }

    /// Whether the template holds `{url}`.
    pub fn uses_url(&self) -> bool {
        self.parts.contains(&Part::Url)
    }

    /// Whether the template holds `{header:NAME}` for this header.
    pub fn uses_header(&self, name: &HeaderName) -> bool {
        self.parts.contains(&Part::Header(name.clone()))
    }
}

/// The shape of a signed body whose fields the key reads, refused when two
/// readers could read it differently (one parse).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BodyShape {
    /// JSON: no object may repeat a member name.
    Json,
    /// `application/x-www-form-urlencoded`: no repeated parameter, every
    /// segment a `name=value` pair.
    Form,
    /// Flat XML: no repeated element, no nested element where a field is
    /// expected, no text outside the fields, one root.
    Xml,
}

/// A configured HMAC signature scheme, a [`Verifier`] for any sender that
/// signs with an HMAC: the signature's header, how it is written (an
/// optional prefix, hex or base64, or `k=v` pairs), what is signed (a
/// [`SignedTemplate`]), where the timestamp comes from, and the secrets
/// (several verify during a rotation: any one verifies).
///
/// Everything the built-in verifiers promise holds: at most
/// [`MAX_SIGNATURES`] candidate signatures, one MAC per secret compared in
/// constant time with every candidate, checked timestamp arithmetic, a
/// repeated signature or timestamp header refused, and with
/// [`body_shape`](HmacSchemeBuilder::body_shape) a body that two readers
/// could read differently refused.
///
/// ```
/// use tower_idempotency::verify::{HmacAlgorithm, HmacScheme};
/// // GitHub: `X-Hub-Signature-256: sha256=HEX` over the body.
/// let github = HmacScheme::builder("github", HmacAlgorithm::Sha256, "x-hub-signature-256")
///     .prefix("sha256=")
///     .secret("It's a Secret to Everybody")
///     .build()?;
/// # let _ = github;
/// // Slack: `v0=HEX` over `v0:{timestamp}:{body}`.
/// let slack = HmacScheme::builder("slack", HmacAlgorithm::Sha256, "x-slack-signature")
///     .prefix("v0=")
///     .signed("v0:{timestamp}:{body}".parse().unwrap())
///     .timestamp_header("x-slack-request-timestamp")
///     .secret("8f742231b10e8888abcd99yyyzzz85a5")
///     .build()?;
/// # let _ = slack;
/// // Without a secret nothing could be checked.
/// assert!(HmacScheme::builder("x", HmacAlgorithm::Sha256, "x-sig").build().is_err());
/// # Ok::<(), tower_idempotency::verify::SigningKeyError>(())
/// ```
#[derive(Clone)]
pub struct HmacScheme {
    channel: Arc<str>,
    header: HeaderName,
    prefix: String,
    encoding: SignatureEncoding,
    signed: SignedTemplate,
    timestamp_header: Option<HeaderName>,
    signature_field: Option<String>,
    timestamp_field: Option<String>,
    url: Option<PublicUrl>,
    tolerance: Duration,
    shape: Option<BodyShape>,
    keys: Vec<hmac::Key>,
}

/// What `{url}` is made of: the public URL of the requests under `path`.
#[derive(Debug, Clone)]
struct PublicUrl {
    url: String,
    path: String,
}

impl PublicUrl {
    /// The URL `parts` was sent to: the public URL, the rest of the
    /// request's path after `path`, and its query; `None` for a request
    /// outside `path`.
    fn of(&self, parts: &Parts) -> Option<String> {
        let mount = self.path.trim_end_matches('/');
        let rest = parts.uri.path().strip_prefix(mount)?;
        let rest = match rest {
            "" | "/" => "",
            rest if rest.starts_with('/') => rest,
            _ => return None,
        };
        let mut out = format!("{}{rest}", self.url);
        if let Some(query) = parts.uri.query() {
            out.push('?');
            out.push_str(query);
        }
        Some(out)
    }
}

/// Builds an [`HmacScheme`]; from [`HmacScheme::builder`].
#[derive(Clone)]
pub struct HmacSchemeBuilder {
    channel: Arc<str>,
    algorithm: HmacAlgorithm,
    header: Result<HeaderName, String>,
    prefix: String,
    encoding: SignatureEncoding,
    signed: SignedTemplate,
    timestamp_header: Option<Result<HeaderName, String>>,
    signature_field: Option<String>,
    timestamp_field: Option<String>,
    url: Option<PublicUrl>,
    tolerance: Duration,
    shape: Option<BodyShape>,
    secret_encoding: SecretEncoding,
    secrets: Vec<Vec<u8>>,
}

impl fmt::Debug for HmacSchemeBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HmacSchemeBuilder")
            .field("channel", &self.channel)
            .field("algorithm", &self.algorithm)
            .field("header", &self.header)
            .field("secrets", &self.secrets.len())
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for HmacScheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HmacScheme")
            .field("channel", &self.channel)
            .field("header", &self.header)
            .field("prefix", &self.prefix)
            .field("encoding", &self.encoding)
            .field("signed", &self.signed)
            .field("timestamp_header", &self.timestamp_header)
            .field("signature_field", &self.signature_field)
            .field("timestamp_field", &self.timestamp_field)
            .field("tolerance", &self.tolerance)
            .field("secrets", &self.keys.len())
            .finish()
    }
}

/// The tolerance of a signed timestamp unless one is set: 5 minutes, as
/// for the built-in channels.
const DEFAULT_TOLERANCE: Duration = Duration::from_secs(300);

impl HmacScheme {
    /// A scheme for the sender `channel` (its name in logs and in the
    /// [`Verified`] marker) whose `algorithm` signature comes in `header`.
    /// Defaults: no prefix, hex, `{body}` signed, no timestamp, a
    /// tolerance of 5 minutes, raw secrets.
    pub fn builder(
        channel: impl Into<Arc<str>>,
        algorithm: HmacAlgorithm,
        header: impl AsRef<str>,
    ) -> HmacSchemeBuilder {
        let header = header.as_ref();
        HmacSchemeBuilder {
            channel: channel.into(),
            algorithm,
            header: HeaderName::from_bytes(header.as_bytes())
                .map_err(|_| format!("signature header {header:?} is not a header name")),
            prefix: String::new(),
            encoding: SignatureEncoding::Hex,
            signed: SignedTemplate::default(),
            timestamp_header: None,
            signature_field: None,
            timestamp_field: None,
            url: None,
            tolerance: DEFAULT_TOLERANCE,
            shape: None,
            secret_encoding: SecretEncoding::Raw,
            secrets: Vec::new(),
        }
    }

    /// How many secrets verify.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether no secret is configured (never, once built).
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The header the signature comes in.
    pub fn header(&self) -> &HeaderName {
        &self.header
    }

    /// What is signed.
    pub fn signed(&self) -> &SignedTemplate {
        &self.signed
    }

    /// The header the timestamp comes in, when it has one of its own.
    pub fn timestamp_header(&self) -> Option<&HeaderName> {
        self.timestamp_header.as_ref()
    }
}

impl HmacSchemeBuilder {
    /// Text before the signature, stripped before it is decoded (`sha256=`,
    /// `v0=`); a signature without it does not verify.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How the signature is written. Defaults to hex.
    pub fn encoding(mut self, encoding: SignatureEncoding) -> Self {
        self.encoding = encoding;
        self
    }

    /// What is signed. Defaults to `{body}`.
    pub fn signed(mut self, template: SignedTemplate) -> Self {
        self.signed = template;
        self
    }

    /// The header `{timestamp}` comes from (seconds since the epoch),
    /// checked against the tolerance.
    pub fn timestamp_header(mut self, name: impl AsRef<str>) -> Self {
        let name = name.as_ref();
        self.timestamp_header = Some(
            HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| format!("timestamp header {name:?} is not a header name")),
        );
        self
    }

    /// For a header of `k=v` pairs (`ts=…;h1=…`, `t=…,v1=…`; `;` or `,`
    /// between pairs): the name of the signature pairs. Each of them is
    /// tried, at most [`MAX_SIGNATURES`].
    pub fn signature_field(mut self, name: impl Into<String>) -> Self {
        self.signature_field = Some(name.into());
        self
    }

    /// For a header of `k=v` pairs: the name of the timestamp pair (seconds
    /// since the epoch), checked against the tolerance.
    pub fn timestamp_field(mut self, name: impl Into<String>) -> Self {
        self.timestamp_field = Some(name.into());
        self
    }

    /// What `{url}` is: the URL the request was sent to, as the sender
    /// signs it. `url` is the public URL of the request path `path` (the
    /// route's prefix, as this service sees it); `{url}` is `url`, then the
    /// rest of the request's path after `path`, then its query (`?…`). So a
    /// signature made for one URL verifies at that URL only, and a request
    /// outside `path` does not verify.
    ///
    /// With `url("https://example.com/hooks/square", "/hooks/square")`, a
    /// request to `/hooks/square/refund?id=1` verifies only a signature over
    /// `https://example.com/hooks/square/refund?id=1`.
    pub fn url(mut self, url: impl Into<String>, path: impl Into<String>) -> Self {
        self.url = Some(PublicUrl {
            url: url.into(),
            path: path.into(),
        });
        self
    }

    /// How far the signed timestamp may lie from now. Defaults to 5 minutes.
    pub fn tolerance(mut self, tolerance: Duration) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// Refuses a body of this shape that two readers could read
    /// differently (a repeated JSON member, form parameter or XML
    /// element): set it to the shape the key is read from. Defaults to no
    /// check.
    pub fn body_shape(mut self, shape: BodyShape) -> Self {
        self.shape = Some(shape);
        self
    }

    /// How the secrets are written. Defaults to [`SecretEncoding::Raw`].
    pub fn secret_encoding(mut self, encoding: SecretEncoding) -> Self {
        self.secret_encoding = encoding;
        self
    }

    /// Adds a secret; while rotating, add the new and the old one (any one
    /// verifies).
    pub fn secret(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.secrets.push(secret.as_ref().to_vec());
        self
    }

    /// The scheme, or why it cannot check anything: no secret, an empty
    /// secret, a secret that is not base64 where it should be, a bad header
    /// name, `{timestamp}` without a timestamp source, a timestamp source
    /// whose value is not signed, `{url}` without a URL, a timestamp pair
    /// without a signature pair.
    pub fn build(self) -> Result<HmacScheme, SigningKeyError> {
        let header = self.header.map_err(SigningKeyError::new)?;
        let timestamp_header = self
            .timestamp_header
            .transpose()
            .map_err(SigningKeyError::new)?;
        if self.secrets.is_empty() {
            return Err(SigningKeyError::new(format!(
                "the {} signature has no secret",
                self.channel
            )));
        }
        if self.timestamp_field.is_some() && self.signature_field.is_none() {
            return Err(SigningKeyError::new(
                "timestamp_field names a pair of a header of pairs: give signature_field too",
            ));
        }
        if self.timestamp_field.is_some() && timestamp_header.is_some() {
            return Err(SigningKeyError::new(
                "the timestamp comes from timestamp_field or timestamp_header, not both",
            ));
        }
        if self.signed.uses_timestamp()
            && self.timestamp_field.is_none()
            && timestamp_header.is_none()
        {
            return Err(SigningKeyError::new(
                "`{timestamp}` is signed, but no timestamp_header or timestamp_field says where it comes from",
            ));
        }
        if (self.timestamp_field.is_some() || timestamp_header.is_some())
            && !self.signed.uses_timestamp()
        {
            return Err(SigningKeyError::new(
                "a timestamp_header or timestamp_field is given, but `{timestamp}` is not signed: any timestamp would pass the tolerance",
            ));
        }
        if self.signed.uses_url() && self.url.is_none() {
            return Err(SigningKeyError::new(
                "`{url}` is signed, but no URL is configured (the route's public_url)",
            ));
        }
        let algorithm = self.algorithm.ring();
        let mut keys = Vec::with_capacity(self.secrets.len());
        for secret in &self.secrets {
            let bytes = match self.secret_encoding {
                SecretEncoding::Raw => Cow::Borrowed(&secret[..]),
                SecretEncoding::Base64 => {
                    let text = std::str::from_utf8(secret)
                        .map_err(|_| SigningKeyError::new("a base64 secret is not text"))?;
                    let text = text.trim();
                    let raw = text.strip_prefix("whsec_").unwrap_or(text);
                    Cow::Owned(base64_key("secret", raw)?)
                }
            };
            if bytes.is_empty() {
                return Err(SigningKeyError::new(format!(
                    "a {} secret is empty (anyone could sign with it)",
                    self.channel
                )));
            }
            keys.push(hmac::Key::new(algorithm, &bytes));
        }
        Ok(HmacScheme {
            channel: self.channel,
            header,
            prefix: self.prefix,
            encoding: self.encoding,
            signed: self.signed,
            timestamp_header,
            signature_field: self.signature_field,
            timestamp_field: self.timestamp_field,
            url: self.url,
            tolerance: self.tolerance,
            shape: self.shape,
            keys,
        })
    }
}

/// The one value of header `name`: a repeated header is malformed (two
/// readers could take different ones).
fn single<'a>(
    parts: &'a Parts,
    name: &HeaderName,
    what: &'static str,
) -> Result<&'a str, VerifyError> {
    let mut values = parts.headers.get_all(name).iter();
    let value = values.next().ok_or(VerifyError::Missing(what))?;
    if values.next().is_some() {
        return Err(VerifyError::Malformed(Cow::Owned(format!(
            "{what}: header `{name}` sent twice"
        ))));
    }
    value
        .to_str()
        .map_err(|_| VerifyError::Malformed(Cow::Borrowed(what)))
}

impl HmacScheme {
    /// The candidate signatures (still encoded) and the timestamp of the
    /// signature header.
    fn read_header<'a>(
        &self,
        value: &'a str,
    ) -> Result<(Vec<&'a str>, Option<&'a str>), VerifyError> {
        let mut candidates: Vec<&str> = Vec::new();
        let mut push = |sig: &'a str| {
            if candidates.len() == MAX_SIGNATURES {
                return Err(too_many_signatures());
            }
            let sig = sig.trim();
            // Without its prefix a signature cannot verify.
            let sig = sig.strip_prefix(self.prefix.as_str()).ok_or(VerifyError::Malformed(
                Cow::Borrowed("signature (its prefix is missing)"),
            ))?;
            candidates.push(sig);
            Ok(())
        };
        let Some(field) = &self.signature_field else {
            for sig in value.split_ascii_whitespace() {
                push(sig)?;
            }
            return Ok((candidates, None));
        };
        let mut timestamp = None;
        for pair in value.split([';', ',']) {
            let Some((name, v)) = pair.trim().split_once('=') else {
                continue;
            };
            if name == field {
                push(v)?;
            } else if self.timestamp_field.as_deref() == Some(name)
                && timestamp.replace(v).is_some()
            {
                return Err(VerifyError::Malformed(Cow::Borrowed(
                    "timestamp (given twice in the signature header)",
                )));
            }
        }
        Ok((candidates, timestamp))
    }

    /// The bytes the sender signed.
    fn message(
        &self,
        parts: &Parts,
        body: &Bytes,
        timestamp: Option<&str>,
    ) -> Result<Vec<u8>, VerifyError> {
        let mut out = Vec::with_capacity(body.len() + 64);
        for part in &self.signed.parts {
            match part {
                Part::Literal(text) => out.extend_from_slice(text.as_bytes()),
                Part::Body => out.extend_from_slice(body),
                Part::Timestamp => {
                    out.extend_from_slice(timestamp.ok_or(VerifyError::Missing("timestamp"))?.as_bytes())
                }
                Part::Header(name) => {
                    out.extend_from_slice(single(parts, name, "signed header")?.as_bytes())
                }
                Part::Url => {
                    let url = self.url.as_ref().and_then(|u| u.of(parts)).ok_or(
                        VerifyError::Malformed(Cow::Borrowed("path (outside the signed URL's)")),
                    )?;
                    out.extend_from_slice(url.as_bytes());
                }
            }
        }
        Ok(out)
    }

    /// One parse: a body of the key's shape that two readers could read
    /// differently is refused.
    fn check_shape(&self, body: &Bytes) -> Result<(), VerifyError> {
        let fault = |e: String| VerifyError::Malformed(Cow::Owned(format!("body: {e}")));
        match self.shape {
            None => Ok(()),
            Some(BodyShape::Json) => crate::key::unique_members(body).map_err(fault),
            Some(BodyShape::Form) => crate::key::parse_form_strict(body)
                .map(drop)
                .map_err(|e| fault(e.into_owned())),
            Some(BodyShape::Xml) => {
                let fields = crate::key::flat_fields(body).map_err(|e| fault(e.into_owned()))?;
                if fields.len() > crate::key::MAX_FIELDS {
                    return Err(fault(format!("more than {} fields", crate::key::MAX_FIELDS)));
                }
                let mut seen = foldhash::HashSet::default();
                for (name, _) in &fields {
                    if !seen.insert(name.as_str()) {
                        return Err(fault(format!("element {name:?} repeated")));
                    }
                }
                Ok(())
            }
        }
    }
}

impl Verifier for HmacScheme {
    fn verify(&self, parts: &mut Parts, body: &Bytes, now: SystemTime) -> Result<Verified, VerifyError> {
        let value = single(parts, &self.header, "signature header")?;
        let (candidates, mut timestamp) = self.read_header(value)?;
        if candidates.is_empty() {
            return Err(VerifyError::Missing("signature"));
        }
        if let Some(name) = &self.timestamp_header {
            timestamp = Some(single(parts, name, "timestamp header")?);
        } else if self.timestamp_field.is_some() && timestamp.is_none() {
            return Err(VerifyError::Missing("timestamp pair in the signature header"));
        }
        let signatures = candidates
            .into_iter()
            .map(|sig| self.encoding.decode(sig))
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(ts) = timestamp {
            check_timestamp(ts, now, self.tolerance)?;
        }
        let message = self.message(parts, body, timestamp)?;
        if !any_mac_matches(&self.keys, &message, &signatures) {
            return Err(VerifyError::BadSignature);
        }
        // Only a verified body's shape matters (and a forged one costs no
        // parse).
        self.check_shape(body)?;
        Ok(Verified::new(self.channel.to_string(), None))
    }

    fn channel(&self) -> &str {
        &self.channel
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_read_their_placeholders() {
        let t: SignedTemplate = "{url}{body}".parse().unwrap();
        assert_eq!(t.parts, vec![Part::Url, Part::Body]);
        let t: SignedTemplate = "v0:{timestamp}:{body}".parse().unwrap();
        assert_eq!(
            t.parts,
            vec![
                Part::Literal("v0:".into()),
                Part::Timestamp,
                Part::Literal(":".into()),
                Part::Body
            ]
        );
        let t: SignedTemplate = "{header:X-Id}.{body}".parse().unwrap();
        assert!(t.uses_header(&HeaderName::from_static("x-id")));
        for bad in ["{bdy}", "{body", "body}", "{header:a b}", "{}"] {
            assert!(bad.parse::<SignedTemplate>().is_err(), "{bad}");
        }
    }

    #[test]
    fn url_is_the_url_the_request_was_sent_to() {
        let square = PublicUrl {
            url: "https://example.com/hooks/square".into(),
            path: "/hooks/square".into(),
        };
        let at = |uri: &str| {
            let (parts, ()) = http::Request::post(uri).body(()).unwrap().into_parts();
            square.of(&parts)
        };
        let url = |s: &str| Some(s.to_owned());
        assert_eq!(at("/hooks/square"), url("https://example.com/hooks/square"));
        assert_eq!(at("/hooks/square/"), url("https://example.com/hooks/square"));
        assert_eq!(
            at("/hooks/square/refund?admin=1"),
            url("https://example.com/hooks/square/refund?admin=1")
        );
        assert_eq!(at("/hooks/square?a=1"), url("https://example.com/hooks/square?a=1"));
        assert_eq!(at("/hooks/squarex"), None);
        assert_eq!(at("/other"), None);
        let root = PublicUrl {
            url: "https://example.com".into(),
            path: "/".into(),
        };
        let (parts, ()) = http::Request::post("/a/b?c").body(()).unwrap().into_parts();
        assert_eq!(root.of(&parts), url("https://example.com/a/b?c"));
    }

    #[test]
    fn a_scheme_without_what_it_signs_is_refused() {
        let b = || HmacScheme::builder("x", HmacAlgorithm::Sha256, "x-sig").secret("s");
        assert!(b().build().is_ok());
        assert!(b().signed("{timestamp}.{body}".parse().unwrap()).build().is_err());
        assert!(b().signed("{url}{body}".parse().unwrap()).build().is_err());
        assert!(b().timestamp_field("ts").build().is_err());
        // A timestamp the template does not sign proves nothing.
        assert!(b().timestamp_header("x-ts").build().is_err());
        assert!(b().signature_field("v1").timestamp_field("t").build().is_err());
        let signed_ts = || b().signed("{timestamp}.{body}".parse().unwrap());
        assert!(signed_ts().timestamp_header("x-ts").build().is_ok());
        assert!(HmacScheme::builder("x", HmacAlgorithm::Sha256, "x sig").secret("s").build().is_err());
        assert!(HmacScheme::builder("x", HmacAlgorithm::Sha256, "x-sig").secret("").build().is_err());
        assert!(b().secret_encoding(SecretEncoding::Base64).build().is_err());
    }
}
