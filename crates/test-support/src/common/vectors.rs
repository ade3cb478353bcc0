//! One table of channel vectors for every test. For each preset, what it
//! answers ([`Channel`]: the success and the failure reply) and real
//! notifications ([`Vector`]: the body in `tests/fixtures/`, whose sources
//! are listed in its README, the headers that came with it, the key the
//! channel meant, a resent and a tampered copy, malformed ones). The
//! vectors themselves are in `vectors/table.rs`.

mod table;

pub use table::*;

use super::Answer;
use bytes::Bytes;
use http::header::CONTENT_TYPE;
use std::path::{Path, PathBuf};
use tower_idempotency::{IdempotencyLayer, Preset};

/// WeChat Pay's success reply body.
pub const WECHAT_SUCCESS: &str = r#"{"code":"SUCCESS","message":"成功"}"#;
/// WeChat Pay's failure reply body.
pub const WECHAT_FAIL: &str = r#"{"code":"FAIL","message":"失败"}"#;
/// Alipay's success reply body.
pub const ALIPAY_SUCCESS: &str = "success";
/// Alipay's failure reply body.
pub const ALIPAY_FAIL: &str = "fail";

// ---------------------------------------------------------------------------
// What each preset answers.
// ---------------------------------------------------------------------------

/// How a content type is checked.
#[derive(Debug, Clone, Copy)]
pub enum Ct {
    /// Present and containing this text.
    Has(&'static str),
    /// No `content-type` header.
    Absent,
    /// Not checked (the channel fixes no value for it).
    Any,
}

/// How a body is checked.
#[derive(Debug, Clone, Copy)]
pub enum BodyCheck {
    /// Exactly these bytes.
    Exact(&'static [u8]),
    /// Contains this text.
    Contains(&'static str),
    /// The reply keeps the body underneath (the handler's, or the layer's own
    /// message); checked for a hint of that body.
    Kept,
}

/// An expected reply.
#[derive(Debug, Clone, Copy)]
pub struct Expect {
    pub status: u16,
    pub ct: Ct,
    pub body: BodyCheck,
}

impl Expect {
    /// This reply form with another status; a kept body must contain `hint`.
    pub fn with(self, status: u16, hint: &'static str) -> Self {
        let body = match self.body {
            BodyCheck::Kept => BodyCheck::Contains(hint),
            fixed => fixed,
        };
        Self {
            status,
            ct: self.ct,
            body,
        }
    }
}

/// A preset and its replies.
pub struct Channel {
    pub name: &'static str,
    pub layer: fn() -> IdempotencyLayer,
    pub preset: fn() -> Preset,
    pub path: &'static str,
    pub max_body: usize,
    /// The success reply; `None`: the handler's response passes through.
    pub success: Option<Expect>,
    /// The failure reply to a handler 500. Its body form is also used for the
    /// layers' own 400, 413 (status kept) and mismatch answers.
    pub failure: Expect,
    /// The status of a reused key with another payload.
    pub mismatch_status: u16,
    /// The status of a copy whose wait for the first ran out.
    pub busy_status: u16,
}

pub const CHANNEL_LIMIT: usize = 64 * 1024;

/// A channel that sets its own success reply and answers failures with 500.
pub const fn channel(
    name: &'static str,
    layer: fn() -> IdempotencyLayer,
    preset: fn() -> Preset,
    success: Expect,
    failure: Expect,
) -> Channel {
    Channel {
        name,
        layer,
        preset,
        path: "/notify",
        max_body: CHANNEL_LIMIT,
        success: Some(success),
        failure,
        mismatch_status: 500,
        busy_status: 500,
    }
}

/// "500" and nothing more: the body underneath is kept.
pub const PLAIN_500: Expect = Expect {
    status: 500,
    ct: Ct::Any,
    body: BodyCheck::Kept,
};

pub const WECHATPAY_V3: Channel = channel(
    "wechatpay-v3",
    IdempotencyLayer::wechatpay_v3,
    Preset::wechatpay_v3,
    Expect {
        status: 200,
        ct: Ct::Has("application/json"),
        body: BodyCheck::Exact(WECHAT_SUCCESS.as_bytes()),
    },
    Expect {
        status: 500,
        ct: Ct::Has("application/json"),
        body: BodyCheck::Exact(WECHAT_FAIL.as_bytes()),
    },
);

pub const WECHATPAY_V2: Channel = channel(
    "wechatpay-v2",
    IdempotencyLayer::wechatpay_v2,
    Preset::wechatpay_v2,
    Expect {
        status: 200,
        ct: Ct::Has("xml"),
        body: BodyCheck::Exact(
            b"<xml><return_code><![CDATA[SUCCESS]]></return_code><return_msg><![CDATA[OK]]></return_msg></xml>",
        ),
    },
    Expect {
        status: 500,
        ct: Ct::Has("xml"),
        body: BodyCheck::Contains("<return_code><![CDATA[FAIL]]></return_code>"),
    },
);

pub const ALIPAY: Channel = channel(
    "alipay",
    IdempotencyLayer::alipay,
    Preset::alipay,
    Expect {
        status: 200,
        ct: Ct::Has("text/plain"),
        body: BodyCheck::Exact(ALIPAY_SUCCESS.as_bytes()),
    },
    Expect {
        status: 500,
        ct: Ct::Has("text/plain"),
        body: BodyCheck::Exact(ALIPAY_FAIL.as_bytes()),
    },
);

pub const STRIPE: Channel = channel(
    "stripe",
    IdempotencyLayer::stripe,
    Preset::stripe,
    Expect {
        status: 200,
        ct: Ct::Has("application/json"),
        body: BodyCheck::Exact(br#"{"received":true}"#),
    },
    PLAIN_500,
);

pub const PAYPAL: Channel = channel(
    "paypal",
    IdempotencyLayer::paypal,
    Preset::paypal,
    Expect {
        status: 200,
        ct: Ct::Absent,
        body: BodyCheck::Exact(b""),
    },
    PLAIN_500,
);

pub const ADYEN: Channel = channel(
    "adyen",
    IdempotencyLayer::adyen,
    Preset::adyen,
    Expect {
        status: 200,
        ct: Ct::Has("text/plain"),
        body: BodyCheck::Exact(b"[accepted]"),
    },
    PLAIN_500,
);

pub const STANDARD_WEBHOOKS: Channel = channel(
    "standard-webhooks",
    IdempotencyLayer::standard_webhooks,
    Preset::standard_webhooks,
    Expect {
        status: 204,
        ct: Ct::Absent,
        body: BodyCheck::Exact(b""),
    },
    PLAIN_500,
);

pub const IDEMPOTENCY_KEY: Channel = Channel {
    name: "idempotency-key",
    layer: IdempotencyLayer::idempotency_key,
    preset: Preset::idempotency_key,
    path: "/orders",
    max_body: 1024 * 1024,
    success: None,
    failure: PLAIN_500,
    mismatch_status: 422,
    busy_status: 409,
};

// ---------------------------------------------------------------------------
// Requests and the changes made to them.
// ---------------------------------------------------------------------------

/// A request: headers and body.
#[derive(Debug, Clone, PartialEq)]
pub struct Req {
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
}

impl Req {
    pub fn header_refs(&self) -> Vec<(&str, &str)> {
        self.headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect()
    }

    pub fn with_body(&self, body: impl Into<Bytes>) -> Self {
        Self {
            headers: self.headers.clone(),
            body: body.into(),
        }
    }
}

/// A change to a vector's request. Every listed change must apply, so a
/// fixture edit cannot silently turn it into a no-op.
#[derive(Debug, Clone, Copy)]
pub struct Edit {
    /// Headers set (replacing any of the same name).
    pub set: &'static [(&'static str, &'static str)],
    /// Headers removed.
    pub drop: &'static [&'static str],
    /// Substitutions in the body, each matching exactly once.
    pub replace: &'static [(&'static str, &'static str)],
    /// The whole body replaced by a fixture file.
    pub file: Option<&'static str>,
    /// The whole body replaced by these bytes.
    pub body: Option<&'static str>,
    /// Only the first half of the body.
    pub truncate: bool,
}

pub const NO_EDIT: Edit = Edit {
    set: &[],
    drop: &[],
    replace: &[],
    file: None,
    body: None,
    truncate: false,
};

impl Edit {
    pub fn apply(&self, base: &Req) -> Req {
        let mut headers = base.headers.clone();
        for name in self.drop {
            let before = headers.len();
            headers.retain(|(k, _)| !k.eq_ignore_ascii_case(name));
            assert!(headers.len() < before, "edit drops a missing header {name}");
        }
        for (name, value) in self.set {
            headers.retain(|(k, _)| !k.eq_ignore_ascii_case(name));
            headers.push(((*name).to_owned(), (*value).to_owned()));
        }
        let mut body = match (self.file, self.body) {
            (Some(file), _) => fixture(file).to_vec(),
            (None, Some(body)) => body.as_bytes().to_vec(),
            (None, None) => base.body.to_vec(),
        };
        for (from, to) in self.replace {
            let text = String::from_utf8(body).expect("replace edits apply to text bodies");
            assert_eq!(
                text.matches(from).count(),
                1,
                "edit expects {from:?} exactly once in the body"
            );
            body = text.replacen(from, to, 1).into_bytes();
        }
        if self.truncate {
            body.truncate(body.len() / 2);
        }
        let edited = Req {
            headers,
            body: Bytes::from(body),
        };
        assert_ne!(&edited, base, "edit changes nothing");
        edited
    }
}

/// A malformed request and a word of the 400 message it gets (checked where
/// the channel keeps the layer's message).
pub type Malformed = (Edit, &'static str);

/// How a body is grown to a given size without changing its meaning.
#[derive(Debug, Clone, Copy)]
pub enum Pad {
    /// Trailing whitespace (JSON, XML, or a body nobody parses).
    Whitespace,
    /// One more form field.
    FormField,
}

impl Pad {
    pub fn to(self, body: &[u8], len: usize) -> Bytes {
        let mut out = body.to_vec();
        let fill = match self {
            Pad::Whitespace => b' ',
            Pad::FormField => {
                out.extend_from_slice(b"&pad=");
                b'x'
            }
        };
        assert!(out.len() <= len, "body already longer than {len}");
        out.resize(len, fill);
        Bytes::from(out)
    }
}

/// Where a vector's body comes from.
#[derive(Debug, Clone, Copy)]
pub enum Source {
    /// A file in `tests/fixtures/`.
    File(&'static str),
    /// Written here (client APIs have no channel vectors).
    Inline(&'static str),
}

/// One notification and what the tests do with it.
pub struct Vector {
    pub channel: &'static Channel,
    pub source: Source,
    pub headers: &'static [(&'static str, &'static str)],
    /// The key the channel meant (from the vector's meta).
    pub key: &'static str,
    /// A retry of the same notification: re-signed, re-timestamped or
    /// re-serialized, same business fields.
    pub resent: Edit,
    /// The same key with another business field.
    pub tampered: Edit,
    /// Whether the preset fingerprints the body at all (standard-webhooks
    /// does not: the preset names no fingerprint fields).
    pub fingerprinted: bool,
    pub malformed: &'static [Malformed],
    pub pad: Pad,
}

impl Vector {
    pub fn label(&self) -> String {
        match self.source {
            Source::File(f) => format!("{} {f}", self.channel.name),
            Source::Inline(_) => format!("{} (inline)", self.channel.name),
        }
    }

    pub fn base(&self) -> Req {
        let body = match self.source {
            Source::File(f) => fixture(f),
            Source::Inline(b) => Bytes::from_static(b.as_bytes()),
        };
        Req {
            headers: self
                .headers
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            body,
        }
    }
}

/// The directory of the channel vectors: `tests/fixtures/` of the
/// tower-idempotency crate, where its doctests read them too.
pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tower-idempotency/tests/fixtures")
}

/// The bytes of `tests/fixtures/NAME`.
pub fn fixture(name: &str) -> Bytes {
    let path = fixtures_dir().join(name);
    Bytes::from(std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}

pub const JSON: (&str, &str) = ("content-type", "application/json");
pub const XML: (&str, &str) = ("content-type", "text/xml");
pub const FORM: (&str, &str) = (
    "content-type",
    "application/x-www-form-urlencoded; charset=utf-8",
);

/// Every vector of every preset.
pub const ALL: &[&[Vector]] = &[
    WECHATPAY_V3_VECTORS,
    WECHATPAY_V2_VECTORS,
    ALIPAY_VECTORS,
    STRIPE_VECTORS,
    PAYPAL_VECTORS,
    ADYEN_VECTORS,
    STANDARD_WEBHOOKS_VECTORS,
    IDEMPOTENCY_KEY_VECTORS,
];

// ---------------------------------------------------------------------------
// Checks.
// ---------------------------------------------------------------------------

/// Asserts that `ans` is the reply `want`.
pub fn check(ans: &Answer, want: Expect, what: &str) {
    assert_eq!(
        ans.status,
        want.status,
        "{what}: status (body {:?})",
        ans.text()
    );
    let ct = ans.headers.get(CONTENT_TYPE).map(|v| v.to_str().unwrap());
    match want.ct {
        Ct::Has(s) => assert!(
            ct.is_some_and(|ct| ct.contains(s)),
            "{what}: content-type {ct:?}, expected one with {s:?}"
        ),
        Ct::Absent => assert_eq!(ct, None, "{what}: content-type"),
        Ct::Any => {}
    }
    match want.body {
        BodyCheck::Exact(bytes) => assert_eq!(
            ans.body,
            Bytes::from_static(bytes),
            "{what}: body {:?}",
            ans.text()
        ),
        BodyCheck::Contains(s) => {
            assert!(
                ans.text().contains(s),
                "{what}: body {:?} lacks {s:?}",
                ans.text()
            )
        }
        BodyCheck::Kept => unreachable!("resolve kept bodies with Expect::with"),
    }
}
