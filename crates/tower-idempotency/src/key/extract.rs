//! Where a key and a fingerprint come from: headers, JSON pointers, form
//! fields, XML elements, composites of those, or a closure.

use super::form::parse_form;
use super::json::{Found, Paths};
use super::scope::escape_into;
use super::xml::parse_flat_xml;
use crate::Fingerprint;
use bytes::Bytes;
use http::request::Parts;
use http::HeaderName;
use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

/// A key and fingerprint taken from a request.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
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
    invalid_key: bool,
}

impl KeyError {
    /// A new error with a message for the client: the request is not what
    /// was expected (400 where the key is required, a pass-through where it
    /// is optional).
    pub fn new(message: impl Into<Cow<'static, str>>) -> Self {
        Self {
            message: message.into(),
            invalid_key: false,
        }
    }

    /// A key was sent but cannot be used (a header that is not visible
    /// ASCII, an unclosed quote): 400 even where the key is optional, since
    /// the client asked for a guarded request.
    pub fn invalid_key(message: impl Into<Cow<'static, str>>) -> Self {
        Self {
            message: message.into(),
            invalid_key: true,
        }
    }

    /// Whether this is an [`invalid_key`](Self::invalid_key) error.
    pub fn is_invalid_key(&self) -> bool {
        self.invalid_key
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
#[non_exhaustive]
pub enum Field {
    /// A header.
    Header(HeaderName),
    /// A value in a JSON body, by [JSON pointer](https://www.rfc-editor.org/rfc/rfc6901) (`/id`).
    Json(Cow<'static, str>),
    /// A field of an `application/x-www-form-urlencoded` body.
    Form(Cow<'static, str>),
    /// A child element of the root of an XML body (`<xml><transaction_id>…`).
    Xml(Cow<'static, str>),
    /// A parameter of the query string (decoded as a form field is).
    Query(Cow<'static, str>),
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

    /// A query parameter.
    pub fn query(name: impl Into<Cow<'static, str>>) -> Self {
        Self::Query(name.into())
    }

    fn describe(&self) -> String {
        match self {
            Self::Query(n) => format!("query parameter `{n}`"),
            Self::Header(name) => format!("header `{name}`"),
            Self::Json(p) => format!("JSON value at `{p}`"),
            Self::Form(n) => format!("form field `{n}`"),
            Self::Xml(n) => format!("XML element `{n}`"),
        }
    }
}

/// The field as a configured preset's source names it: `header:NAME`,
/// `json:/POINTER`, `form:FIELD`, `xml:ELEMENT` or `query:NAME`.
///
/// ```
/// use tower_idempotency::key::Field;
/// assert_eq!(Field::json("/id").to_string(), "json:/id");
/// ```
impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Header(h) => write!(f, "header:{h}"),
            Self::Query(q) => write!(f, "query:{q}"),
            Self::Json(p) => write!(f, "json:{p}"),
            Self::Form(n) => write!(f, "form:{n}"),
            Self::Xml(n) => write!(f, "xml:{n}"),
        }
    }
}

/// Reads a source as a configured preset names it: `header:NAME`,
/// `json:/POINTER`, `form:FIELD`, `xml:ELEMENT` or `query:NAME`.
///
/// ```
/// use tower_idempotency::key::Field;
/// let field: Field = "json:/data/object/id".parse().unwrap();
/// assert_eq!(field, Field::json("/data/object/id"));
/// assert_eq!("form:out_trade_no".parse::<Field>().unwrap(), Field::form("out_trade_no"));
/// assert!("json:id".parse::<Field>().is_err());
/// assert!("body:id".parse::<Field>().is_err());
/// ```
impl std::str::FromStr for Field {
    type Err = KeyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (kind, rest) = s.split_once(':').unwrap_or((s, ""));
        let empty = || KeyError::new(format!("`{s}`: the source names nothing after `{kind}:`"));
        match kind {
            "header" => HeaderName::from_bytes(rest.as_bytes())
                .map(Field::header)
                .map_err(|_| KeyError::new(format!("`{s}`: not a header name"))),
            "json" if rest.starts_with('/') => Ok(Field::json(rest.to_owned())),
            "json" => Err(KeyError::new(format!(
                "`{s}`: a JSON pointer starts with `/` (json:/id)"
            ))),
            "form" | "xml" | "query" if rest.is_empty() => Err(empty()),
            "form" => Ok(Field::form(rest.to_owned())),
            "xml" => Ok(Field::xml(rest.to_owned())),
            "query" => Ok(Field::query(rest.to_owned())),
            _ => Err(KeyError::new(format!(
                "unknown source `{s}`: expected header:NAME, json:/POINTER, form:FIELD, \
                 xml:ELEMENT or query:NAME"
            ))),
        }
    }
}

/// What the fingerprint of a request covers.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum FingerprintSpec {
    /// Method, path and the raw body: for client APIs.
    Request,
    /// The named business fields: for channels, whose retries are re-signed
    /// and re-timestamped so the raw body differs between copies.
    Fields(Vec<Field>),
    /// Nothing: every request with the key matches.
    None,
    /// The raw body alone: for a sender that sends every copy of a
    /// notification byte for byte the same.
    Body,
}

/// A declarative key source: the fields that make the key (joined with `:`
/// when there are several, each with `:`, `%` and `#` percent-escaped) and
/// what the fingerprint covers.
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
    /// The JSON pointers among the fields, read in one pass.
    json: Paths,
    /// Whether a header or query parameter sent twice is refused.
    refuse_repeated: bool,
}

impl KeySpec {
    /// A spec from the key fields and the fingerprint.
    pub fn new(key: impl IntoIterator<Item = Field>, fingerprint: FingerprintSpec) -> Self {
        let key: Vec<Field> = key.into_iter().collect();
        let fp: &[Field] = match &fingerprint {
            FingerprintSpec::Fields(f) => f,
            _ => &[],
        };
        let json = Paths::new(key.iter().chain(fp).filter_map(|f| match f {
            Field::Json(pointer) => Some(pointer),
            _ => None,
        }));
        Self {
            key,
            fingerprint,
            json,
            refuse_repeated: false,
        }
    }

    /// The same spec refusing a request that sends a header or a query
    /// parameter it reads twice (400, an invalid key): readers disagree on
    /// which of two copies counts. A configured preset refuses them.
    pub fn refuse_repeated(mut self) -> Self {
        self.refuse_repeated = true;
        self
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
        if self.refuse_repeated {
            check_repeated(self, parts)?;
        }
        let doc = Document::parse(self, body)?;
        let mut key = String::new();
        for (i, field) in self.key.iter().enumerate() {
            if let Field::Header(name) = field {
                check_visible_ascii(parts, name)?;
            }
            let Some(value) = doc.get(parts, field) else {
                return Ok(None);
            };
            if value.is_empty() {
                return Ok(None);
            }
            if self.key.len() == 1 {
                key.push_str(&value);
            } else {
                // Escaped so that ("a:b", "c") and ("a", "b:c") differ.
                if i > 0 {
                    key.push(':');
                }
                escape_into(&mut key, &value);
            }
        }
        let fingerprint = match &self.fingerprint {
            FingerprintSpec::Request => Fingerprint::of_request(parts, body),
            FingerprintSpec::None => Fingerprint::of(b""),
            FingerprintSpec::Body => Fingerprint::of(body),
            FingerprintSpec::Fields(fields) => Fingerprint::of_fields(
                fields
                    .iter()
                    .map(|field| doc.get(parts, field).map(bytes_of)),
            ),
        };
        Ok(Some(Extracted { key, fingerprint }))
    }
}

impl KeySpec {
    /// The text of each key field, read in one pass over the body (`None`
    /// where a field is absent or empty), for readers other than the key's
    /// (an order's object, version and state; a destination's filter).
    pub fn values(&self, parts: &Parts, body: &Bytes) -> Result<Vec<Option<String>>, KeyError> {
        let doc = Document::parse(self, body)?;
        Ok(self
            .key
            .iter()
            .map(|field| {
                doc.get(parts, field)
                    .filter(|v| !v.is_empty())
                    .map(Cow::into_owned)
            })
            .collect())
    }
}

/// A field's text as bytes, borrowed where it was.
fn bytes_of(text: Cow<'_, str>) -> Cow<'_, [u8]> {
    match text {
        Cow::Borrowed(s) => Cow::Borrowed(s.as_bytes()),
        Cow::Owned(s) => Cow::Owned(s.into_bytes()),
    }
}

/// A header or query parameter of `spec` sent twice: an invalid key.
fn check_repeated(spec: &KeySpec, parts: &Parts) -> Result<(), KeyError> {
    for field in spec.fields() {
        let twice = match field {
            Field::Header(name) => parts.headers.get_all(name).iter().nth(1).is_some(),
            Field::Query(name) => query_value(parts, name).1,
            _ => false,
        };
        if twice {
            return Err(KeyError::invalid_key(format!(
                "the {} is sent twice",
                field.describe()
            )));
        }
    }
    Ok(())
}

/// The first decoded value of query parameter `name`, and whether it is
/// sent more than once.
fn query_value<'a>(parts: &'a Parts, name: &str) -> (Option<Cow<'a, str>>, bool) {
    let query = parts.uri.query().unwrap_or("");
    let mut values = query.as_bytes().split(|&b| b == b'&').filter_map(|pair| {
        let (k, v) = match pair.iter().position(|&b| b == b'=') {
            Some(i) => (&pair[..i], &pair[i + 1..]),
            None => (pair, &pair[..0]),
        };
        (super::form::decode_form(k) == name).then(|| super::form::decode_form(v))
    });
    let first = values.next();
    let twice = first.is_some() && values.next().is_some();
    (first, twice)
}

/// A key header that is present but not visible ASCII is an invalid key,
/// not a missing one.
fn check_visible_ascii(parts: &Parts, name: &HeaderName) -> Result<(), KeyError> {
    match parts.headers.get(name).map(|v| v.to_str()) {
        Some(Err(_)) => Err(KeyError::invalid_key(format!(
            "the `{name}` header must be visible ASCII"
        ))),
        _ => Ok(()),
    }
}

impl<T: ExtractKey + ?Sized> ExtractKey for Arc<T> {
    fn extract(&self, parts: &Parts, body: &Bytes) -> Result<Option<Extracted>, KeyError> {
        (**self).extract(parts, body)
    }
}

/// A body read once for the fields a spec needs; values borrow from it.
struct Document<'a> {
    json: Option<Found<'a, 'a>>,
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
        if !spec.json.is_empty() {
            doc.json = Some(spec.json.read(body).map_err(|e| {
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
            Field::Json(pointer) => self.json.as_ref()?.text_at(pointer),
            Field::Query(name) => query_value(parts, name).0,
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
