//! Every channel preset against real notification bodies (DESIGN §6).
//!
//! The bodies are in `tests/fixtures/` (their sources are listed in its
//! README); the headers that came with them are in the tables below. For each
//! vector, through `IdempotencyLayer::<preset>()` around a `service_fn`:
//!
//! - `key_and_success`: the scoped key ends with the channel's key, the
//!   handler sees the same bytes, and any 2xx becomes the exact success reply;
//! - `failure_not_cached`: a handler 500 becomes the failure reply and the
//!   retry runs the handler again;
//! - `storm`: K identical copies at the same instant through a real hyper
//!   server run the handler once and all get the success reply;
//! - `storm_after_failure`: the same storm when the first run fails;
//! - `in_flight`: a copy whose wait for the running first one runs out gets
//!   a retryable answer, never a success;
//! - `resent_and_tampered`: a re-signed, re-timestamped copy replays, the
//!   same key with another business field gets the failure reply;
//! - `limits`: 413 past the body limit, 400 for a malformed body or a missing
//!   key, in the channel's failure form.

mod common;

use bytes::Bytes;
use common::{all_at_once, client, post, read, request, serve, Answer, Counter};
use http::header::CONTENT_TYPE;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use std::convert::Infallible;
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tower::util::ServiceFn;
use tower::{service_fn, Layer, ServiceExt};
use tower_idempotency::{Idempotency, IdempotencyKey, IdempotencyLayer, Preset};

/// Copies of one notification sent at the same instant.
const K: usize = 7;

// ---------------------------------------------------------------------------
// What each preset answers (DESIGN §6).
// ---------------------------------------------------------------------------

/// How a content type is checked.
#[derive(Debug, Clone, Copy)]
enum Ct {
    /// Present and containing this text.
    Has(&'static str),
    /// No `content-type` header.
    Absent,
    /// Not checked (DESIGN does not fix it).
    Any,
}

/// How a body is checked.
#[derive(Debug, Clone, Copy)]
enum BodyCheck {
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
struct Expect {
    status: u16,
    ct: Ct,
    body: BodyCheck,
}

impl Expect {
    /// This reply form with another status; a kept body must contain `hint`.
    fn with(self, status: u16, hint: &'static str) -> Self {
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
struct Channel {
    name: &'static str,
    layer: fn() -> IdempotencyLayer,
    preset: fn() -> Preset,
    path: &'static str,
    max_body: usize,
    /// The success reply; `None`: the handler's response passes through.
    success: Option<Expect>,
    /// The failure reply to a handler 500. Its body form is also used for the
    /// layers' own 400, 413 (status kept) and mismatch answers.
    failure: Expect,
    /// The status of a reused key with another payload.
    mismatch_status: u16,
    /// The status of a copy whose wait for the first ran out.
    busy_status: u16,
}

const CHANNEL_LIMIT: usize = 64 * 1024;

/// A channel that sets its own success reply and answers failures with 500.
const fn channel(
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
const PLAIN_500: Expect = Expect {
    status: 500,
    ct: Ct::Any,
    body: BodyCheck::Kept,
};

const WECHATPAY_V3: Channel = channel(
    "wechatpay-v3",
    IdempotencyLayer::wechatpay_v3,
    Preset::wechatpay_v3,
    Expect {
        status: 200,
        ct: Ct::Has("application/json"),
        body: BodyCheck::Exact(r#"{"code":"SUCCESS","message":"成功"}"#.as_bytes()),
    },
    Expect {
        status: 500,
        ct: Ct::Has("application/json"),
        body: BodyCheck::Exact(r#"{"code":"FAIL","message":"失败"}"#.as_bytes()),
    },
);

const WECHATPAY_V2: Channel = channel(
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

const ALIPAY: Channel = channel(
    "alipay",
    IdempotencyLayer::alipay,
    Preset::alipay,
    Expect {
        status: 200,
        ct: Ct::Has("text/plain"),
        body: BodyCheck::Exact(b"success"),
    },
    Expect {
        status: 500,
        ct: Ct::Has("text/plain"),
        body: BodyCheck::Exact(b"fail"),
    },
);

const STRIPE: Channel = channel(
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

const PAYPAL: Channel = channel(
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

const ADYEN: Channel = channel(
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

const STANDARD_WEBHOOKS: Channel = channel(
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

const IDEMPOTENCY_KEY: Channel = Channel {
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
struct Req {
    headers: Vec<(String, String)>,
    body: Bytes,
}

impl Req {
    fn header_refs(&self) -> Vec<(&str, &str)> {
        self.headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect()
    }

    fn with_body(&self, body: impl Into<Bytes>) -> Self {
        Self {
            headers: self.headers.clone(),
            body: body.into(),
        }
    }
}

/// A change to a vector's request. Every listed change must apply, so a
/// fixture edit cannot silently turn it into a no-op.
#[derive(Debug, Clone, Copy)]
struct Edit {
    /// Headers set (replacing any of the same name).
    set: &'static [(&'static str, &'static str)],
    /// Headers removed.
    drop: &'static [&'static str],
    /// Substitutions in the body, each matching exactly once.
    replace: &'static [(&'static str, &'static str)],
    /// The whole body replaced by a fixture file.
    file: Option<&'static str>,
    /// The whole body replaced by these bytes.
    body: Option<&'static str>,
    /// Only the first half of the body.
    truncate: bool,
}

const NO_EDIT: Edit = Edit {
    set: &[],
    drop: &[],
    replace: &[],
    file: None,
    body: None,
    truncate: false,
};

impl Edit {
    fn apply(&self, base: &Req) -> Req {
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
type Malformed = (Edit, &'static str);

/// How a body is grown to a given size without changing its meaning.
#[derive(Debug, Clone, Copy)]
enum Pad {
    /// Trailing whitespace (JSON, XML, or a body nobody parses).
    Whitespace,
    /// One more form field.
    FormField,
}

impl Pad {
    fn to(self, body: &[u8], len: usize) -> Bytes {
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
enum Source {
    /// A file in `tests/fixtures/`.
    File(&'static str),
    /// Written here (client APIs have no channel vectors).
    Inline(&'static str),
}

/// One notification and what the tests do with it.
struct Vector {
    channel: &'static Channel,
    source: Source,
    headers: &'static [(&'static str, &'static str)],
    /// The key the channel meant (from the vector's meta).
    key: &'static str,
    /// A retry of the same notification: re-signed, re-timestamped or
    /// re-serialized, same business fields.
    resent: Edit,
    /// The same key with another business field.
    tampered: Edit,
    /// Whether the preset fingerprints the body at all (standard-webhooks
    /// does not: DESIGN §6 lists no fingerprint fields).
    fingerprinted: bool,
    malformed: &'static [Malformed],
    pad: Pad,
}

impl Vector {
    fn label(&self) -> String {
        match self.source {
            Source::File(f) => format!("{} {f}", self.channel.name),
            Source::Inline(_) => format!("{} (inline)", self.channel.name),
        }
    }

    fn base(&self) -> Req {
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

fn fixture(name: &str) -> Bytes {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    Bytes::from(std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}

// ---------------------------------------------------------------------------
// The vectors.
// ---------------------------------------------------------------------------

const JSON: (&str, &str) = ("content-type", "application/json");
const XML: (&str, &str) = ("content-type", "text/xml");
const FORM: (&str, &str) = (
    "content-type",
    "application/x-www-form-urlencoded; charset=utf-8",
);

const TRUNCATED: Malformed = (
    Edit {
        truncate: true,
        ..NO_EDIT
    },
    "expected",
);

/// A JSON body without the key.
const NO_ID: Malformed = (
    Edit {
        body: Some(r#"{"object":"event"}"#),
        ..NO_EDIT
    },
    "expected",
);

const WECHATPAY_V3_VECTORS: &[Vector] = &[
    Vector {
        channel: &WECHATPAY_V3,
        source: Source::File("wechatpay_v3_notify_wechatpay-go.json"),
        headers: &[
            JSON,
            ("Wechatpay-Nonce", "EcZ9Cmy4Xyx1i6RlJQzLcCyEqDa26NBz"),
            ("Wechatpay-Timestamp", "1624523846"),
            ("Wechatpay-Serial", "D7CE59D1F522D701"),
            ("Wechatpay-Signature", "tJHIiIS9eB2hAYstmAmbbD3ZE5LiIm/Ug5tuL4fC0YOFRWIHV39UFIZXC0e9Wl6lBu6sKvkqDkzpqzBsVHyXFlbYZTOQrVdG4b6LfTnK4mikv9++ixJMd3vTf2yCqvBkh98zs3Ds5zsYQakzbcwhmw4fMJs4nPLws28H0UW9FjDR//rxELLwXvV1VEA1IBLX70xptjL8hrfUjEE8kkry6yNJTHZRU8CAc7qHli2Ng1V1qb9ARbK8A3ThmFmPQvRGrapI/jS2laKKgYUmfdEdkNO6B2Cke5e8VTxY406ArAmQ90GAihDwIcb16TQMnzCMBoutnwZKNiKRACrFmtxw2Q=="),
        ],
        key: "3119dfba-e649-5eec-ab1e-3412bc4d2e17",
        resent: Edit {
            set: &[
                ("Wechatpay-Nonce", "resentNonce0000000000000000000000"),
                ("Wechatpay-Timestamp", "1624523861"),
                ("Wechatpay-Signature", "cmUtc2lnbmVkIGNvcHkgb2YgdGhlIHNhbWUgbm90aWZpY2F0aW9u"),
            ],
            replace: &[(r#","summary":"#, r#", "summary": "#)],
            ..NO_EDIT
        },
        tampered: Edit {
            replace: &[("PAYSCORE.USER_OPEN_SERVICE", "PAYSCORE.USER_CLOSE_SERVICE")],
            ..NO_EDIT
        },
        fingerprinted: true,
        malformed: &[TRUNCATED, NO_ID],
        pad: Pad::Whitespace,
    },
    Vector {
        channel: &WECHATPAY_V3,
        source: Source::File("wechatpay_v3_notify_official_doc_transaction_success.json"),
        headers: &[JSON, ("Wechatpay-Timestamp", "1432100975")],
        key: "EV-2018022511223320873",
        resent: Edit {
            set: &[("Wechatpay-Timestamp", "1432100990")],
            replace: &[(r#""summary": "支付成功""#, r#""summary":"支付成功""#)],
            ..NO_EDIT
        },
        tampered: Edit {
            replace: &[(r#""original_type": "transaction""#, r#""original_type": "refund""#)],
            ..NO_EDIT
        },
        fingerprinted: true,
        malformed: &[TRUNCATED],
        pad: Pad::Whitespace,
    },
];

const V2_NO_TRANSACTION_ID: Malformed = (
    Edit {
        replace: &[(
            "<transaction_id><![CDATA[1004400740201409030005092168]]></transaction_id>",
            "",
        )],
        ..NO_EDIT
    },
    "expected",
);

const WECHATPAY_V2_VECTORS: &[Vector] = &[
    Vector {
        channel: &WECHATPAY_V2,
        source: Source::File("wechatpay_v2_notify_wechatpay-php_paysuccess.xml"),
        headers: &[XML],
        key: "1004400740201409030005092168",
        // The same fields, re-signed, in another element order and layout.
        resent: Edit {
            file: Some("wechatpay_v2_notify_SYNTHESIZED_md5_doc_key.xml"),
            ..NO_EDIT
        },
        tampered: Edit {
            replace: &[("<total_fee>1</total_fee>", "<total_fee>100</total_fee>")],
            ..NO_EDIT
        },
        fingerprinted: true,
        malformed: &[TRUNCATED, V2_NO_TRANSACTION_ID],
        pad: Pad::Whitespace,
    },
    Vector {
        channel: &WECHATPAY_V2,
        source: Source::File("wechatpay_v2_notify_SYNTHESIZED_md5_doc_key.xml"),
        headers: &[XML],
        key: "1004400740201409030005092168",
        // The same notification signed with HMAC-SHA256 instead of MD5.
        resent: Edit {
            file: Some("wechatpay_v2_notify_SYNTHESIZED_hmacsha256_doc_key.xml"),
            ..NO_EDIT
        },
        tampered: Edit {
            replace: &[(
                "<result_code><![CDATA[SUCCESS]]></result_code>",
                "<result_code><![CDATA[FAIL]]></result_code>",
            )],
            ..NO_EDIT
        },
        fingerprinted: true,
        malformed: &[TRUNCATED, V2_NO_TRANSACTION_ID],
        pad: Pad::Whitespace,
    },
];

/// A body that is not a form.
const ALIPAY_XML_BODY: Malformed = (
    Edit {
        body: Some("<xml><notify_id>2019081500222155624068450559358070</notify_id></xml>"),
        ..NO_EDIT
    },
    "expected",
);

const ALIPAY_VECTORS: &[Vector] = &[
    Vector {
        channel: &ALIPAY,
        source: Source::File("alipay_notify_trade_status_sync_alipay-sdk-nodejs-all.form"),
        headers: &[FORM],
        key: "2019081500222155624068450559358070",
        resent: Edit {
            replace: &[
                (
                    "notify_time=2019-08-15%2015%3A56%3A25",
                    "notify_time=2019-08-15%2015%3A58%3A40",
                ),
                ("sign=QfTb8tqE1BMhS5qA", "sign=ReSignedCopy0000A"),
            ],
            ..NO_EDIT
        },
        tampered: Edit {
            replace: &[("trade_status=TRADE_SUCCESS", "trade_status=TRADE_CLOSED")],
            ..NO_EDIT
        },
        fingerprinted: true,
        malformed: &[
            (
                Edit {
                    replace: &[("notify_id=2019081500222155624068450559358070&", "")],
                    ..NO_EDIT
                },
                "expected",
            ),
            ALIPAY_XML_BODY,
        ],
        pad: Pad::FormField,
    },
    Vector {
        channel: &ALIPAY,
        source: Source::File("alipay_notify_servicemarket_order_notify_alipay-sdk-nodejs-all.form"),
        headers: &[FORM],
        key: "2019030800222102023008121054923345",
        resent: Edit {
            replace: &[
                (
                    "notify_time=2019-03-08%2010%3A20%3A23",
                    "notify_time=2019-03-08%2010%3A22%3A48",
                ),
                (
                    "timestamp=2019-03-08%2010%3A20%3A23",
                    "timestamp=2019-03-08%2010%3A22%3A48",
                ),
                ("sign=MsK5SCw8oqLw", "sign=ReSignedCopy"),
            ],
            ..NO_EDIT
        },
        // This notification carries none of the preset's fingerprint fields
        // (it has no trade); a copy that adds one is another payload.
        tampered: Edit {
            replace: &[("total_price=0.00", "total_price=0.00&total_amount=0.01")],
            ..NO_EDIT
        },
        fingerprinted: true,
        malformed: &[
            (
                Edit {
                    replace: &[("notify_id=2019030800222102023008121054923345&", "")],
                    ..NO_EDIT
                },
                "expected",
            ),
            ALIPAY_XML_BODY,
        ],
        pad: Pad::FormField,
    },
];

const STRIPE_VECTORS: &[Vector] = &[Vector {
    channel: &STRIPE,
    source: Source::File("stripe_webhook_SYNTHESIZED_stripe-go_testPayload.json"),
    headers: &[
        JSON,
        (
            "Stripe-Signature",
            "t=1700000000,v1=c488b24db08e6b7ea11d0ce6b4d536817201a6dff3608deb089bd4e413a0ff93",
        ),
    ],
    key: "evt_test_webhook",
    resent: Edit {
        set: &[(
            "Stripe-Signature",
            "t=1700000300,v1=5257d6f1a8c2b5f0a4e5c5d1e1d4c3b2a1f0e9d8c7b6a5f4e3d2c1b0a9f8e7d6",
        )],
        replace: &[(r#""object": "event""#, r#""object":"event""#)],
        ..NO_EDIT
    },
    // The stripe-go test payload has no `type`; a copy with one is another event.
    tampered: Edit {
        replace: &[(
            r#""object": "event","#,
            r#""object": "event", "type": "charge.refunded","#,
        )],
        ..NO_EDIT
    },
    fingerprinted: true,
    malformed: &[TRUNCATED, NO_ID],
    pad: Pad::Whitespace,
}];

const PAYPAL_VECTORS: &[Vector] = &[
    Vector {
        channel: &PAYPAL,
        source: Source::File("paypal_webhook_PayPal-Java-SDK_ValidateCertTest.json"),
        headers: &[
            JSON,
            ("PAYPAL-CERT-URL", "https://api.sandbox.paypal.com/v1/notifications/certs/CERT-360caa42-fca2a594-1d93a270"),
            ("PAYPAL-TRANSMISSION-ID", "afa30d40-ca4a-11e9-ab68-7d4e2605c70c"),
            ("PAYPAL-TRANSMISSION-TIME", "2019-08-29T10:49:33Z"),
            ("PAYPAL-AUTH-ALGO", "SHA256withRSA"),
            ("PAYPAL-TRANSMISSION-SIG", "K7DF5+hOyGS6v0xTZ9PkEO+BFNQmpryxw2hFlXbHgmxpu+883ldEC9HcL6ccEmB8sfy80y/Q3qcZZL1MR8Qi0e1ysylVj/yROgKK6zBsQPoNmgXC8yTiNoAjULuhk5Aoau0Itk3nrkgAfji1zvADlErMFM9VZe2nDvhM3nDMLjCi/K5fRjWp3eGo6Nx17GX/WIEibeKDyS+YdJMex3i+KO4aWmm9zznC/FJ5Y/ntd0MxOJNrM0r0f3y7c3e3sO5pB3oPgN6KzKVS5P6AWHqtS8acD3DjgCKZ1uqKz7q954G1aBz2/m0wRGOFFsv0/D3FE2uIheRRmoQtVSOAX7Aupg=="),
        ],
        key: "WH-7MU294299R542214K-4N1831857K851783H",
        resent: Edit {
            set: &[
                ("PAYPAL-TRANSMISSION-ID", "0b1c2d3e-ca4b-11e9-ab68-7d4e2605c70c"),
                ("PAYPAL-TRANSMISSION-TIME", "2019-08-29T10:51:03Z"),
                ("PAYPAL-TRANSMISSION-SIG", "cmUtc2lnbmVkIGNvcHkgb2YgdGhlIHNhbWUgZXZlbnQ="),
            ],
            ..NO_EDIT
        },
        tampered: Edit {
            replace: &[(
                r#""event_type":"PAYMENTS.PAYMENT.CREATED""#,
                r#""event_type":"PAYMENTS.PAYMENT.CANCELLED""#,
            )],
            ..NO_EDIT
        },
        fingerprinted: true,
        malformed: &[TRUNCATED, NO_ID],
        pad: Pad::Whitespace,
    },
    Vector {
        channel: &PAYPAL,
        source: Source::File("paypal_webhook_PayPal-Python-SDK_sample_PAYMENT.SALE.COMPLETED.json"),
        headers: &[
            JSON,
            ("PAYPAL-TRANSMISSION-ID", "dfb3be50-fd74-11e4-8bf3-77339302725b"),
            ("PAYPAL-TRANSMISSION-TIME", "2015-05-18T15:45:13Z"),
            ("PAYPAL-CERT-URL", "https://api.sandbox.paypal.com/v1/notifications/certs/CERT-360caa42-fca2a594-a5cafa77"),
            ("PAYPAL-AUTH-ALGO", "sha256"),
            ("PAYPAL-TRANSMISSION-SIG", "thy4/U002quzxFavHPwbfJGcc46E8rc5jzgyeafWm5mICTBdY/8rl7WJpn8JA0GKA+oDTPsSruqusw+XXg5RLAP7ip53Euh9Xu3UbUhQFX7UgwzE2FeYoY6lyRMiiiQLzy9BvHfIzNIVhPad4KnC339dr6y2l+mN8ALgI4GCdIh3/SoJO5wE64Bh/ueWtt8EVuvsvXfda2Le5a2TrOI9vLEzsm9GS79hAR/5oLexNz8UiZr045Mr5ObroH4w4oNfmkTaDk9Rj0G19uvISs5QzgmBpauKr7Nw++JI0pr/v5mFctQkoWJSGfBGzPRXawrvIIVHQ9Wer48GR2g9ZiApWg=="),
        ],
        key: "WH-0G2756385H040842W-5Y612302CV158622M",
        resent: Edit {
            set: &[
                ("PAYPAL-TRANSMISSION-ID", "e1c2d3f4-fd74-11e4-8bf3-77339302725b"),
                ("PAYPAL-TRANSMISSION-TIME", "2015-05-18T15:45:28Z"),
                ("PAYPAL-TRANSMISSION-SIG", "cmUtc2lnbmVkIGNvcHkgb2YgdGhlIHNhbWUgZXZlbnQ="),
            ],
            ..NO_EDIT
        },
        tampered: Edit {
            replace: &[(
                r#""event_type":"PAYMENT.SALE.COMPLETED""#,
                r#""event_type":"PAYMENT.SALE.REFUNDED""#,
            )],
            ..NO_EDIT
        },
        fingerprinted: true,
        malformed: &[TRUNCATED, NO_ID],
        pad: Pad::Whitespace,
    },
];

/// Adyen's envelope without items.
const ADYEN_NO_ITEMS: Malformed = (
    Edit {
        body: Some(r#"{"live": "false", "notificationItems": []}"#),
        ..NO_EDIT
    },
    "expected",
);

/// An Adyen notification. Its retry writes `amount` (a fingerprint field)
/// with its members in the other order: the same amount.
macro_rules! adyen {
    ($file:literal, $key:literal, $amount:expr => $reordered:expr) => {
        Vector {
            channel: &ADYEN,
            source: Source::File($file),
            headers: &[JSON],
            key: $key,
            resent: Edit {
                replace: &[($amount, $reordered)],
                ..NO_EDIT
            },
            tampered: Edit {
                replace: &[(r#""value": 1000"#, r#""value": 100000"#)],
                ..NO_EDIT
            },
            fingerprinted: true,
            malformed: &[TRUNCATED, ADYEN_NO_ITEMS],
            pad: Pad::Whitespace,
        }
    };
}

const CURRENCY_FIRST: &str = r#"{"currency": "EUR", "value": 1000}"#;
const VALUE_FIRST: &str = r#"{"value": 1000, "currency": "EUR"}"#;

const ADYEN_VECTORS: &[Vector] = &[
    adyen!("adyen_notify_adyen-python_backslash_ENVELOPED.json", "T7FD4VM4D3RZNN82:AUTHORISATION:true", CURRENCY_FIRST => VALUE_FIRST),
    adyen!("adyen_notify_adyen-python_colon_ENVELOPED.json", "M8NB66SBZSGLNK82:AUTHORISATION:true", CURRENCY_FIRST => VALUE_FIRST),
    adyen!("adyen_notify_adyen-python_forwardslash_ENVELOPED.json", "X3GWNS6KJ8NKGK82:AUTHORISATION:true", VALUE_FIRST => CURRENCY_FIRST),
    adyen!("adyen_notify_adyen-python_mixed_ENVELOPED.json", "ZVWN7D3WSMK2WN82:AUTHORISATION:true", CURRENCY_FIRST => VALUE_FIRST),
];

const NO_WEBHOOK_ID: Malformed = (
    Edit {
        drop: &["webhook-id"],
        ..NO_EDIT
    },
    "webhook-id",
);

const STANDARD_WEBHOOKS_VECTORS: &[Vector] = &[
    Vector {
        channel: &STANDARD_WEBHOOKS,
        source: Source::File("standard_webhooks_standard-webhooks_go_test.json"),
        headers: &[
            JSON,
            ("webhook-id", "msg_p5jXN8AQM9LWM0D4loKWxJek"),
            ("webhook-timestamp", "1614265330"),
            (
                "webhook-signature",
                "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
            ),
        ],
        key: "msg_p5jXN8AQM9LWM0D4loKWxJek",
        resent: Edit {
            set: &[
                ("webhook-timestamp", "1614265390"),
                (
                    "webhook-signature",
                    "v1,cmUtc2lnbmVkIGNvcHkgb2YgdGhlIHNhbWUgbWVzc2FnZQ==",
                ),
            ],
            ..NO_EDIT
        },
        tampered: Edit {
            replace: &[("2432232314", "1")],
            ..NO_EDIT
        },
        fingerprinted: false,
        malformed: &[NO_WEBHOOK_ID],
        pad: Pad::Whitespace,
    },
    Vector {
        channel: &STANDARD_WEBHOOKS,
        source: Source::File("standard_webhooks_standard-webhooks_rust_test.json"),
        headers: &[
            JSON,
            ("webhook-id", "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk"),
            ("webhook-timestamp", "1649367553"),
            (
                "webhook-signature",
                "v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw=",
            ),
        ],
        key: "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk",
        resent: Edit {
            set: &[
                ("webhook-timestamp", "1649367613"),
                (
                    "webhook-signature",
                    "v1,cmUtc2lnbmVkIGNvcHkgb2YgdGhlIHNhbWUgbWVzc2FnZQ==",
                ),
            ],
            ..NO_EDIT
        },
        tampered: Edit {
            replace: &[("test_user", "other_user")],
            ..NO_EDIT
        },
        fingerprinted: false,
        malformed: &[NO_WEBHOOK_ID],
        pad: Pad::Whitespace,
    },
];

/// The key of the draft's own example.
const CLIENT_KEY: &str = "8e03978e-40d5-43e8-bc93-6894a57f9324";

const IDEMPOTENCY_KEY_VECTORS: &[Vector] = &[Vector {
    channel: &IDEMPOTENCY_KEY,
    source: Source::Inline(r#"{"order":"A-1","amount":100}"#),
    headers: &[
        JSON,
        (
            "Idempotency-Key",
            "\"8e03978e-40d5-43e8-bc93-6894a57f9324\"",
        ),
        ("Authorization", "Bearer alice"),
    ],
    key: CLIENT_KEY,
    // The key as a bare token, and another trace id: the same request.
    resent: Edit {
        set: &[
            ("Idempotency-Key", CLIENT_KEY),
            (
                "traceparent",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            ),
        ],
        ..NO_EDIT
    },
    tampered: Edit {
        replace: &[(r#""amount":100"#, r#""amount":1000"#)],
        ..NO_EDIT
    },
    fingerprinted: true,
    malformed: &[
        (
            Edit {
                drop: &["Idempotency-Key"],
                ..NO_EDIT
            },
            "Idempotency-Key",
        ),
        (
            Edit {
                set: &[("Idempotency-Key", "\"8e03978e-40d5-43e8-bc93-6894a57f9324")],
                ..NO_EDIT
            },
            "unclosed quote",
        ),
    ],
    pad: Pad::Whitespace,
}];

// ---------------------------------------------------------------------------
// The handler and the stack.
// ---------------------------------------------------------------------------

const HANDLER_CT: &str = "application/x-handler";
const HANDLER_OK: &[u8] = b"ok";
const HANDLER_FAILED: &str = "handler failed";

type HandlerResult = Result<Response<Full<Bytes>>, Infallible>;
type HandlerFuture = Pin<Box<dyn Future<Output = HandlerResult> + Send>>;

/// The scoped key (if any) and the body of one call the handler got.
type Seen = (Option<String>, Bytes);

/// A business handler: answers `status` (500 for its first `fail_first`
/// calls), counts its calls and keeps the scoped keys and bodies it saw.
#[derive(Clone)]
struct Handler {
    calls: Counter,
    status: u16,
    fail_first: usize,
    delay: Duration,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Handler {
    fn answering(status: u16) -> Self {
        Self {
            calls: Counter::default(),
            status,
            fail_first: 0,
            delay: Duration::ZERO,
            seen: Arc::default(),
        }
    }

    fn failing_first(mut self, n: usize) -> Self {
        self.fail_first = n;
        self
    }

    /// Slow enough for K copies sent at once to overlap.
    fn slow(self) -> Self {
        self.taking(Duration::from_millis(300))
    }

    fn taking(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    fn calls(&self) -> usize {
        self.calls.get()
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// What the handler answers when it succeeds.
    fn ok_body(&self) -> &'static [u8] {
        if self.status == 204 {
            b""
        } else {
            HANDLER_OK
        }
    }

    async fn handle(self, req: Request<Full<Bytes>>) -> HandlerResult {
        let n = self.calls.bump();
        let key = req
            .extensions()
            .get::<IdempotencyKey>()
            .map(|k| k.as_str().to_owned());
        let body = req.into_body().collect().await.unwrap().to_bytes();
        self.seen.lock().unwrap().push((key, body));
        tokio::time::sleep(self.delay).await;
        let (status, body) = if n <= self.fail_first {
            (500, HANDLER_FAILED.as_bytes())
        } else {
            (self.status, self.ok_body())
        };
        Ok(Response::builder()
            .status(status)
            .header(CONTENT_TYPE, HANDLER_CT)
            .body(Full::new(Bytes::from_static(body)))
            .unwrap())
    }

    /// `IdempotencyLayer::<preset>()` around this handler.
    fn stack(
        &self,
        channel: &Channel,
    ) -> Idempotency<ServiceFn<impl FnMut(Request<Full<Bytes>>) -> HandlerFuture + Clone + Send>>
    {
        self.stack_with((channel.layer)())
    }

    /// `layer` around this handler.
    fn stack_with(
        &self,
        layer: IdempotencyLayer,
    ) -> Idempotency<ServiceFn<impl FnMut(Request<Full<Bytes>>) -> HandlerFuture + Clone + Send>>
    {
        let handler = self.clone();
        layer.layer(service_fn(move |req| {
            Box::pin(handler.clone().handle(req)) as HandlerFuture
        }))
    }
}

// ---------------------------------------------------------------------------
// Checks.
// ---------------------------------------------------------------------------

fn check(ans: &Answer, want: Expect, what: &str) {
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

/// The reply to a success of `handler`.
fn success_reply(channel: &Channel, handler: &Handler) -> Expect {
    channel.success.unwrap_or(Expect {
        status: handler.status,
        ct: Ct::Has(HANDLER_CT),
        body: BodyCheck::Exact(handler.ok_body()),
    })
}

/// The reply to a handler failure.
fn failure_reply(channel: &Channel) -> Expect {
    channel.failure.with(channel.failure.status, HANDLER_FAILED)
}

/// The reply to a reused key with another payload.
fn mismatch_reply(channel: &Channel) -> Expect {
    channel
        .failure
        .with(channel.mismatch_status, "different request payload")
}

/// The reply to a copy whose wait for the first ran out.
fn busy_reply(channel: &Channel) -> Expect {
    channel
        .failure
        .with(channel.busy_status, "still in progress")
}

/// The layers' own answer to a bad request: its status, the channel's form.
fn rejection(channel: &Channel, status: u16, hint: &'static str) -> Expect {
    channel.failure.with(status, hint)
}

/// The stack as the tests call it.
trait Stack:
    tower::Service<
        Request<Full<Bytes>>,
        Response = Response<tower_idempotency::ResponseBody<Full<Bytes>>>,
        Error = Infallible,
    > + Clone
{
}

impl<S> Stack for S where
    S: tower::Service<
            Request<Full<Bytes>>,
            Response = Response<tower_idempotency::ResponseBody<Full<Bytes>>>,
            Error = Infallible,
        > + Clone
{
}

/// Sends one request through `svc` with `oneshot`.
async fn send(svc: &impl Stack, path: &str, req: &Req) -> Answer {
    let res = svc
        .clone()
        .oneshot(request(path, &req.header_refs(), req.body.clone()))
        .await
        .unwrap();
    read(res).await
}

/// Sends K copies of `req` at the same instant through a real hyper server.
async fn storm_of(v: &'static Vector, handler: &Handler, req: Req) -> Vec<Answer> {
    let (addr, server) = serve(handler.stack(v.channel)).await;
    let http = client();
    let answers = all_at_once(K, |_| {
        let (http, req) = (http.clone(), req.clone());
        async move {
            post(
                &http,
                addr,
                v.channel.path,
                &req.header_refs(),
                req.body.clone(),
            )
            .await
        }
    })
    .await;
    server.abort();
    answers
}

fn replayed(answers: &[Answer]) -> usize {
    answers.iter().filter(|a| a.replayed()).count()
}

// ---------------------------------------------------------------------------
// Scenarios, each run for every vector of a preset.
// ---------------------------------------------------------------------------

mod scenario {
    use super::*;

    /// The scoped key, the bytes handed on, and the success reply to any 2xx.
    pub(super) async fn key_and_success(v: &'static Vector) {
        let base = v.base();
        for status in [200, 201, 202, 204] {
            let what = format!("{}, handler {status}", v.label());
            let handler = Handler::answering(status);
            let svc = handler.stack(v.channel);
            let ok = success_reply(v.channel, &handler);

            let first = send(&svc, v.channel.path, &base).await;
            check(&first, ok, &what);
            assert!(!first.replayed(), "{what}: the first copy is not a replay");

            let seen = handler.seen();
            assert_eq!(seen.len(), 1, "{what}: handler calls");
            let (key, body) = &seen[0];
            let key = key.as_deref().expect("an IdempotencyKey extension");
            let scope = format!("idem:{}:{}:", v.channel.name, v.channel.path);
            assert!(key.starts_with(&scope), "{what}: {key} not in {scope}");
            assert!(
                key.ends_with(&format!(":{}", v.key)),
                "{what}: {key} not ending with {}",
                v.key
            );
            if !(v.channel.preset)().is_client_api() {
                // Channels have no principal: the key follows the scope.
                assert_eq!(key, format!("{scope}:{}", v.key), "{what}: scoped key");
            }
            assert_eq!(body, &base.body, "{what}: the handler gets the same bytes");

            let again = send(&svc, v.channel.path, &base).await;
            check(&again, ok, &format!("{what}, replay"));
            assert!(again.replayed(), "{what}: the second copy is a replay");
            assert_eq!(handler.calls(), 1, "{what}: handler calls");
        }
    }

    /// A failure gets the failure reply and is not cached: the retry runs.
    pub(super) async fn failure_not_cached(v: &'static Vector) {
        let what = v.label();
        let base = v.base();
        let handler = Handler::answering(200).failing_first(1);
        let svc = handler.stack(v.channel);
        let ok = success_reply(v.channel, &handler);

        let failed = send(&svc, v.channel.path, &base).await;
        check(
            &failed,
            failure_reply(v.channel),
            &format!("{what}, failure"),
        );
        assert!(!failed.replayed(), "{what}: a failure is not a replay");
        assert_eq!(handler.calls(), 1, "{what}: handler calls");

        let retry = send(&svc, v.channel.path, &base).await;
        check(&retry, ok, &format!("{what}, retry"));
        assert!(!retry.replayed(), "{what}: the retry runs the handler");
        assert_eq!(handler.calls(), 2, "{what}: the retry runs the handler");

        let third = send(&svc, v.channel.path, &base).await;
        check(&third, ok, &format!("{what}, third"));
        assert!(third.replayed(), "{what}: the third copy is a replay");
        assert_eq!(handler.calls(), 2, "{what}: handler calls");
    }

    /// K copies at once through hyper: one run, K success replies.
    pub(super) async fn storm(v: &'static Vector) {
        let what = v.label();
        let handler = Handler::answering(200).slow();
        let answers = storm_of(v, &handler, v.base()).await;
        assert_eq!(handler.calls(), 1, "{what}: handler calls");
        let ok = success_reply(v.channel, &handler);
        for (i, ans) in answers.iter().enumerate() {
            check(ans, ok, &format!("{what}, copy {i}"));
        }
        assert_eq!(replayed(&answers), K - 1, "{what}: replays");
    }

    /// K copies at once when the first run fails: that copy gets the failure
    /// reply, one waiter runs the handler again, the rest replay its success.
    pub(super) async fn storm_after_failure(v: &'static Vector) {
        let what = v.label();
        let handler = Handler::answering(200).failing_first(1).slow();
        let answers = storm_of(v, &handler, v.base()).await;
        assert_eq!(handler.calls(), 2, "{what}: handler calls");
        let failure = failure_reply(v.channel);
        let (failed, ok): (Vec<_>, Vec<_>) =
            answers.iter().partition(|a| a.status == failure.status);
        assert_eq!(failed.len(), 1, "{what}: failures {answers:#?}");
        check(failed[0], failure, &format!("{what}, failed copy"));
        assert!(!failed[0].replayed(), "{what}: a failure is not a replay");
        for (i, ans) in ok.iter().enumerate() {
            check(
                ans,
                success_reply(v.channel, &handler),
                &format!("{what}, copy {i}"),
            );
        }
        assert_eq!(replayed(&answers), K - 2, "{what}: replays");
    }

    /// A copy whose wait for the running first one runs out gets a retryable
    /// answer (the channel's failure reply, 409 for client keys), never a
    /// success; the next retry replays.
    pub(super) async fn in_flight(v: &'static Vector) {
        let what = v.label();
        let base = v.base();
        // The first runs for a second; the second copy comes after 50 ms and
        // gives up waiting 50 ms later.
        let handler = Handler::answering(200).taking(Duration::from_secs(1));
        let svc = handler.stack_with((v.channel.layer)().wait(Duration::from_millis(50)));
        let ok = success_reply(v.channel, &handler);

        let (first, second) = tokio::join!(send(&svc, v.channel.path, &base), async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            send(&svc, v.channel.path, &base).await
        });
        check(&first, ok, &format!("{what}, first"));
        check(&second, busy_reply(v.channel), &format!("{what}, busy"));
        assert!(!second.replayed(), "{what}: a busy answer is not a replay");
        if (v.channel.preset)().is_client_api() {
            assert!(
                second.headers.contains_key("retry-after"),
                "{what}: Retry-After"
            );
        }
        assert_eq!(handler.calls(), 1, "{what}: handler calls");

        let retry = send(&svc, v.channel.path, &base).await;
        check(&retry, ok, &format!("{what}, retry"));
        assert!(retry.replayed(), "{what}: the retry is a replay");
        assert_eq!(handler.calls(), 1, "{what}: handler calls");
    }

    /// A re-signed copy replays; the same key with another business field is
    /// refused without running the handler, and does not spoil the record.
    pub(super) async fn resent_and_tampered(v: &'static Vector) {
        let what = v.label();
        let base = v.base();
        let handler = Handler::answering(200);
        let svc = handler.stack(v.channel);
        let ok = success_reply(v.channel, &handler);

        check(&send(&svc, v.channel.path, &base).await, ok, &what);

        let resent = send(&svc, v.channel.path, &v.resent.apply(&base)).await;
        check(&resent, ok, &format!("{what}, resent"));
        assert!(resent.replayed(), "{what}: a re-signed copy is a replay");

        let tampered = send(&svc, v.channel.path, &v.tampered.apply(&base)).await;
        if v.fingerprinted {
            check(
                &tampered,
                mismatch_reply(v.channel),
                &format!("{what}, tampered"),
            );
            assert!(
                !tampered.replayed(),
                "{what}: a tampered copy is not a replay"
            );
        } else {
            // DESIGN §6: no fingerprint, so the key alone decides.
            check(&tampered, ok, &format!("{what}, other body"));
            assert!(tampered.replayed(), "{what}: the key alone decides");
        }
        assert_eq!(handler.calls(), 1, "{what}: handler calls");

        let genuine = send(&svc, v.channel.path, &base).await;
        check(&genuine, ok, &format!("{what}, genuine retry"));
        assert!(
            genuine.replayed(),
            "{what}: the genuine retry still replays"
        );
        assert_eq!(handler.calls(), 1, "{what}: handler calls");
    }

    /// 413 one byte past the limit (streamed or declared), 400 for malformed
    /// bodies and missing keys, the limit itself accepted.
    pub(super) async fn limits(v: &'static Vector) {
        let what = v.label();
        let limit = v.channel.max_body;
        assert_eq!((v.channel.preset)().max_body(), limit, "{what}: body limit");
        let base = v.base();
        let handler = Handler::answering(200);
        let svc = handler.stack(v.channel);
        let too_large = rejection(v.channel, 413, "too large");

        let over = base.with_body(v.pad.to(&base.body, limit + 1));
        check(
            &send(&svc, v.channel.path, &over).await,
            too_large,
            &format!("{what}, over"),
        );
        for (i, (edit, hint)) in v.malformed.iter().enumerate() {
            let ans = send(&svc, v.channel.path, &edit.apply(&base)).await;
            check(
                &ans,
                rejection(v.channel, 400, hint),
                &format!("{what}, malformed {i}"),
            );
        }
        assert_eq!(handler.calls(), 0, "{what}: rejected before the handler");

        let full = base.with_body(v.pad.to(&base.body, limit));
        let ans = send(&svc, v.channel.path, &full).await;
        check(
            &ans,
            success_reply(v.channel, &handler),
            &format!("{what}, at the limit"),
        );
        assert_eq!(handler.calls(), 1, "{what}: handler calls");

        // Through hyper the length is declared up front.
        let (addr, server) = serve(handler.stack(v.channel)).await;
        let ans = post(
            &client(),
            addr,
            v.channel.path,
            &over.header_refs(),
            over.body.clone(),
        )
        .await;
        server.abort();
        check(&ans, too_large, &format!("{what}, over, declared"));
        assert_eq!(handler.calls(), 1, "{what}: handler calls");
    }
}

macro_rules! channel_tests {
    ($($preset:ident: $vectors:expr => [$($(#[$attr:meta])* $scenario:ident),* $(,)?];)*) => {$(
        mod $preset {
            use super::*;

            const VECTORS: &[Vector] = $vectors;

            $(
                $(#[$attr])*
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $scenario() {
                    for v in VECTORS {
                        scenario::$scenario(v).await;
                    }
                }
            )*
        }
    )*};
}

channel_tests! {
    wechatpay_v3: WECHATPAY_V3_VECTORS => [key_and_success, failure_not_cached, storm, storm_after_failure, in_flight, resent_and_tampered, limits];
    wechatpay_v2: WECHATPAY_V2_VECTORS => [key_and_success, failure_not_cached, storm, storm_after_failure, in_flight, resent_and_tampered, limits];
    alipay: ALIPAY_VECTORS => [key_and_success, failure_not_cached, storm, storm_after_failure, in_flight, resent_and_tampered, limits];
    stripe: STRIPE_VECTORS => [key_and_success, failure_not_cached, storm, storm_after_failure, in_flight, resent_and_tampered, limits];
    paypal: PAYPAL_VECTORS => [key_and_success, failure_not_cached, storm, storm_after_failure, in_flight, resent_and_tampered, limits];
    adyen: ADYEN_VECTORS => [key_and_success, failure_not_cached, storm, storm_after_failure, in_flight, resent_and_tampered, limits];
    standard_webhooks: STANDARD_WEBHOOKS_VECTORS => [key_and_success, failure_not_cached, storm, storm_after_failure, in_flight, resent_and_tampered, limits];
    idempotency_key: IDEMPOTENCY_KEY_VECTORS => [key_and_success, failure_not_cached, storm, storm_after_failure, in_flight, resent_and_tampered, limits];
}

/// Client-API keys are scoped to the principal: another user's request with
/// the same key runs on its own and never gets the first user's response.
#[tokio::test]
async fn idempotency_key_is_scoped_to_the_principal() {
    let v = &IDEMPOTENCY_KEY_VECTORS[0];
    let handler = Handler::answering(201);
    let svc = handler.stack(v.channel);
    let alice = v.base();
    let bob = Edit {
        set: &[("Authorization", "Bearer bob")],
        ..NO_EDIT
    }
    .apply(&alice);
    assert!(!send(&svc, v.channel.path, &alice).await.replayed());
    assert!(!send(&svc, v.channel.path, &bob).await.replayed());
    assert_eq!(handler.calls(), 2);
    assert!(send(&svc, v.channel.path, &alice).await.replayed());
    assert!(send(&svc, v.channel.path, &bob).await.replayed());
    assert_eq!(handler.calls(), 2);
}

/// Every fixture is listed with its source in the fixtures README, and every
/// file a vector names is there.
#[test]
fn fixtures_are_documented() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let readme = std::fs::read_to_string(dir.join("README.md")).unwrap();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        assert!(
            name == "README.md" || readme.contains(&format!("`{name}`")),
            "{name} is not listed in tests/fixtures/README.md"
        );
    }
    let all = [
        WECHATPAY_V3_VECTORS,
        WECHATPAY_V2_VECTORS,
        ALIPAY_VECTORS,
        STRIPE_VECTORS,
        PAYPAL_VECTORS,
        ADYEN_VECTORS,
        STANDARD_WEBHOOKS_VECTORS,
        IDEMPOTENCY_KEY_VECTORS,
    ];
    for v in all.iter().flat_map(|vs| vs.iter()) {
        let files = [Some(v.source), v.resent.file.map(Source::File)];
        for file in files.into_iter().flatten() {
            if let Source::File(f) = file {
                assert!(dir.join(f).is_file(), "{f} is missing");
            }
        }
    }
}
