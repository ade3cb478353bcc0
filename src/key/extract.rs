//! Where a key and a fingerprint come from: headers, JSON pointers, form
//! fields, XML elements, composites of those, or a closure.

use super::Fingerprint;
use bytes::Bytes;
use http::request::Parts;
use http::HeaderName;
use sha2::{Digest, Sha256};
use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

/// A key and fingerprint taken from a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extracted {
    /// The key as the sender gave it (before scoping).
    pub key: String,
    /// The fingerprint of the request's meaning.
    pub fingerprint: Fingerprint,
}

/// Why no key could be read from a request that should carry one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyError {
    message: Cow<'static, str>,
}

impl KeyError {
    /// A new error with a message for the client.
    pub fn new(message: impl Into<Cow<'static, str>>) -> Self {
        Self {
            message: message.into(),
        }
    }

    /// The message sent back in the 400 response.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for KeyError {}

/// Reads the key and fingerprint of a request.
///
/// `Ok(None)` means the request carries no key (a 400 on routes where the key
/// is required, a pass-through elsewhere); `Err` means the body is not what
/// was expected. Implemented by [`KeySpec`] and by closures
/// `Fn(&Parts, &Bytes) -> Result<Option<Extracted>, KeyError>`.
pub trait ExtractKey: Send + Sync + 'static {
    /// Reads the key of one request.
    fn extract(&self, parts: &Parts, body: &Bytes) -> Result<Option<Extracted>, KeyError>;
}

impl<F> ExtractKey for F
where
    F: Fn(&Parts, &Bytes) -> Result<Option<Extracted>, KeyError> + Send + Sync + 'static,
{
    fn extract(&self, parts: &Parts, body: &Bytes) -> Result<Option<Extracted>, KeyError> {
        self(parts, body)
    }
}

/// One field of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Field {
    /// A header.
    Header(HeaderName),
    /// A value in a JSON body, by [JSON pointer](https://www.rfc-editor.org/rfc/rfc6901) (`/id`).
    Json(Cow<'static, str>),
    /// A field of an `application/x-www-form-urlencoded` body.
    Form(Cow<'static, str>),
    /// A child element of the root of an XML body (`<xml><transaction_id>…`).
    Xml(Cow<'static, str>),
}

impl Field {
    /// A header field.
    pub fn header(name: HeaderName) -> Self {
        Self::Header(name)
    }

    /// A JSON pointer field.
    pub fn json(pointer: impl Into<Cow<'static, str>>) -> Self {
        Self::Json(pointer.into())
    }

    /// A form field.
    pub fn form(name: impl Into<Cow<'static, str>>) -> Self {
        Self::Form(name.into())
    }

    /// An XML element.
    pub fn xml(name: impl Into<Cow<'static, str>>) -> Self {
        Self::Xml(name.into())
    }

    fn describe(&self) -> String {
        match self {
            Self::Header(name) => format!("header `{name}`"),
            Self::Json(p) => format!("JSON value at `{p}`"),
            Self::Form(n) => format!("form field `{n}`"),
            Self::Xml(n) => format!("XML element `{n}`"),
        }
    }
}

/// What the fingerprint of a request covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FingerprintSpec {
    /// Method, path and the raw body: for client APIs.
    Request,
    /// The named business fields: for channels, whose retries are re-signed
    /// and re-timestamped so the raw body differs between copies.
    Fields(Vec<Field>),
    /// Nothing: every request with the key matches.
    None,
}

/// A declarative key source: the fields that make the key (joined with `:`
/// when there are several) and what the fingerprint covers.
///
/// ```
/// use tower_idempotency::key::{ExtractKey, Field, FingerprintSpec, KeySpec};
/// let spec = KeySpec::new([Field::json("/id")], FingerprintSpec::Fields(vec![Field::json("/type")]));
/// let req = http::Request::post("/").body(()).unwrap();
/// let (parts, _) = req.into_parts();
/// let body = bytes::Bytes::from_static(br#"{"id":"evt_1","type":"charge.succeeded"}"#);
/// let got = spec.extract(&parts, &body).unwrap().unwrap();
/// assert_eq!(got.key, "evt_1");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySpec {
    key: Vec<Field>,
    fingerprint: FingerprintSpec,
}

impl KeySpec {
    /// A spec from the key fields and the fingerprint.
    pub fn new(key: impl IntoIterator<Item = Field>, fingerprint: FingerprintSpec) -> Self {
        Self {
            key: key.into_iter().collect(),
            fingerprint,
        }
    }

    /// The fields of the key.
    pub fn key_fields(&self) -> &[Field] {
        &self.key
    }

    /// What the fingerprint covers.
    pub fn fingerprint_spec(&self) -> &FingerprintSpec {
        &self.fingerprint
    }

    fn fields(&self) -> impl Iterator<Item = &Field> {
        let fp: &[Field] = match &self.fingerprint {
            FingerprintSpec::Fields(f) => f,
            _ => &[],
        };
        self.key.iter().chain(fp)
    }

    /// What the key is expected to be, for error messages.
    pub fn describe(&self) -> String {
        self.key
            .iter()
            .map(Field::describe)
            .collect::<Vec<_>>()
            .join(" + ")
    }
}

impl ExtractKey for KeySpec {
    fn extract(&self, parts: &Parts, body: &Bytes) -> Result<Option<Extracted>, KeyError> {
        let doc = Document::parse(self, body)?;
        let mut key = String::new();
        for (i, field) in self.key.iter().enumerate() {
            let Some(value) = doc.get(parts, field) else {
                return Ok(None);
            };
            if value.is_empty() {
                return Ok(None);
            }
            if i > 0 {
                key.push(':');
            }
            key.push_str(&value);
        }
        let fingerprint = match &self.fingerprint {
            FingerprintSpec::Request => Fingerprint::of_request(parts, body),
            FingerprintSpec::None => Fingerprint::of(b""),
            FingerprintSpec::Fields(fields) => {
                let mut h = Sha256::new();
                for field in fields {
                    match doc.get(parts, field) {
                        // Length-prefixed so that ("ab","c") and ("a","bc") differ.
                        Some(v) => {
                            h.update((v.len() as u64).to_le_bytes());
                            h.update(v.as_bytes());
                        }
                        None => h.update(u64::MAX.to_le_bytes()),
                    }
                }
                Fingerprint::from_digest(h)
            }
        };
        Ok(Some(Extracted { key, fingerprint }))
    }
}

impl<T: ExtractKey + ?Sized> ExtractKey for Arc<T> {
    fn extract(&self, parts: &Parts, body: &Bytes) -> Result<Option<Extracted>, KeyError> {
        (**self).extract(parts, body)
    }
}

/// A body read once for the fields a spec needs; values borrow from it.
struct Document<'a> {
    json: Option<&'a serde_json::value::RawValue>,
    form: Option<Vec<(&'a str, Cow<'a, str>)>>,
    xml: Option<Vec<(&'a str, String)>>,
}

impl<'a> Document<'a> {
    fn parse(spec: &'a KeySpec, body: &'a Bytes) -> Result<Self, KeyError> {
        let mut doc = Document {
            json: None,
            form: None,
            xml: None,
        };
        let needs = |f: fn(&Field) -> bool| spec.fields().any(f);
        if needs(|f| matches!(f, Field::Json(_))) {
            doc.json = Some(super::json::parse(body).map_err(|e| {
                KeyError::new(format!(
                    "expected a JSON body with the {}: {e}",
                    spec.describe()
                ))
            })?);
        }
        if needs(|f| matches!(f, Field::Form(_))) {
            if body.trim_ascii_start().starts_with(b"<") {
                return Err(KeyError::new(format!(
                    "expected an application/x-www-form-urlencoded body with the {}",
                    spec.describe()
                )));
            }
            let wanted: Vec<&str> = spec
                .fields()
                .filter_map(|f| match f {
                    Field::Form(name) => Some(name.as_ref()),
                    _ => None,
                })
                .collect();
            doc.form = Some(parse_form(body, &wanted));
        }
        if needs(|f| matches!(f, Field::Xml(_))) {
            let wanted: Vec<&str> = spec
                .fields()
                .filter_map(|f| match f {
                    Field::Xml(name) => Some(name.as_ref()),
                    _ => None,
                })
                .collect();
            doc.xml = Some(parse_flat_xml(body, &wanted).map_err(|e| {
                KeyError::new(format!(
                    "expected an XML body with the {}: {e}",
                    spec.describe()
                ))
            })?);
        }
        Ok(doc)
    }

    fn get<'b>(&'b self, parts: &'b Parts, field: &Field) -> Option<Cow<'b, str>> {
        match field {
            Field::Header(name) => parts
                .headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(|s| Cow::Borrowed(s.trim())),
            Field::Json(pointer) => super::json::text_at(self.json?, pointer),
            Field::Form(name) => self
                .form
                .as_ref()?
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| Cow::Borrowed(v.as_ref())),
            Field::Xml(name) => self
                .xml
                .as_ref()?
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| Cow::Borrowed(v.as_str())),
        }
    }
}

/// Reads the `wanted` fields of a form body in one pass; only their values
/// are decoded. The first occurrence of a name wins.
fn parse_form<'a>(body: &'a [u8], wanted: &[&'a str]) -> Vec<(&'a str, Cow<'a, str>)> {
    let mut out: Vec<(&'a str, Cow<'a, str>)> = Vec::with_capacity(wanted.len());
    for pair in body.split(|&b| b == b'&') {
        let (name, value) = match pair.iter().position(|&b| b == b'=') {
            Some(i) => (&pair[..i], &pair[i + 1..]),
            None => (pair, &pair[..0]),
        };
        let name = decode_form(name);
        let Some(hit) = wanted.iter().copied().find(|w| *w == name) else {
            continue;
        };
        if out.iter().all(|(k, _)| *k != hit) {
            out.push((hit, decode_form(value)));
        }
    }
    out
}

/// `application/x-www-form-urlencoded` decoding: `+` is a space, `%XX` a byte.
pub(crate) fn decode_form(raw: &[u8]) -> Cow<'_, str> {
    if !raw.iter().any(|&b| b == b'+' || b == b'%') {
        return String::from_utf8_lossy(raw);
    }
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        match raw[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < raw.len() => {
                let hex = |c: u8| (c as char).to_digit(16);
                match (hex(raw[i + 1]), hex(raw[i + 2])) {
                    (Some(h), Some(l)) => {
                        out.push((h * 16 + l) as u8);
                        i += 2;
                    }
                    _ => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    Cow::Owned(String::from_utf8_lossy(&out).into_owned())
}

/// Reads the `wanted` children of the root element of a flat XML document
/// (the shape of WeChat Pay v2 notifications), text and CDATA alike; checks
/// that the whole document is well formed.
fn parse_flat_xml<'w>(body: &[u8], wanted: &[&'w str]) -> Result<Vec<(&'w str, String)>, String> {
    use quick_xml::events::Event;
    let mut reader = quick_xml::Reader::from_reader(body);
    let mut out = Vec::new();
    let mut depth = 0usize;
    let mut current: Option<(&'w str, String)> = None;
    let mut saw_root = false;
    let find = |name: &[u8]| wanted.iter().copied().find(|w| w.as_bytes() == name);
    loop {
        match reader.read_event().map_err(|e| e.to_string())? {
            Event::Start(e) => {
                depth += 1;
                saw_root = true;
                if depth == 2 {
                    current = find(e.name().as_ref()).map(|name| (name, String::new()));
                }
            }
            Event::Empty(e) => {
                saw_root = true;
                if depth == 1 {
                    if let Some(name) = find(e.name().as_ref()) {
                        out.push((name, String::new()));
                    }
                }
            }
            Event::Text(t) if depth == 2 => {
                if let Some((_, v)) = current.as_mut() {
                    v.push_str(&t.decode().map_err(|e| e.to_string())?);
                }
            }
            Event::GeneralRef(r) if depth == 2 => {
                if let Some((_, v)) = current.as_mut() {
                    let reference = format!("&{};", r.decode().map_err(|e| e.to_string())?);
                    let text =
                        quick_xml::escape::unescape(&reference).map_err(|e| e.to_string())?;
                    v.push_str(&text);
                }
            }
            Event::CData(c) if depth == 2 => {
                if let Some((_, v)) = current.as_mut() {
                    v.push_str(&String::from_utf8_lossy(&c));
                }
            }
            Event::End(_) => {
                if depth == 2 {
                    if let Some((name, value)) = current.take() {
                        out.push((name, value.trim().to_string()));
                    }
                }
                depth = depth.saturating_sub(1);
            }
            Event::Eof => break,
            _ => {}
        }
    }
    if !saw_root || depth != 0 {
        return Err("not a complete XML document".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flat_xml_reads_cdata_and_text() {
        let xml = b"<xml><a><![CDATA[x y]]></a><skip>1</skip><b>12</b><c>a &amp; b</c></xml>";
        let got = parse_flat_xml(xml, &["a", "b", "c"]).unwrap();
        assert_eq!(
            got,
            vec![
                ("a", "x y".to_string()),
                ("b", "12".to_string()),
                ("c", "a & b".to_string()),
            ]
        );
    }

    #[test]
    fn form_decodes_only_wanted_fields_like_form_urlencoded() {
        let body = b"a=1&sign=x%2By%3D&subject=%E8%AF%AD+%E9%9B%80&a=2&flag&bad=%zz%4";
        let got = parse_form(body, &["a", "subject", "flag", "bad", "absent"]);
        let expected: Vec<(String, String)> = form_urlencoded::parse(body)
            .filter(|(k, _)| ["a", "subject", "flag", "bad"].contains(&k.as_ref()))
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect();
        let got: Vec<(String, String)> = got
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.into_owned()))
            .collect();
        assert_eq!(
            got[0],
            ("a".to_owned(), "1".to_owned()),
            "first occurrence wins"
        );
        assert_eq!(got[1], expected[1]);
        assert_eq!(got[2], expected[3]);
        assert_eq!(got[3], expected[4]);
        assert_eq!(got.len(), 4);
    }

    #[test]
    fn flat_xml_rejects_truncated() {
        assert!(parse_flat_xml(b"<xml><a>1</a>", &["a"]).is_err());
        assert!(parse_flat_xml(b"", &["a"]).is_err());
    }
}
