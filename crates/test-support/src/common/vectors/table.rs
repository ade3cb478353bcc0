//! The vectors of [`super`]: real notifications per preset, the headers
//! that came with them, and the changes the tests make to them.

use super::*;

pub const TRUNCATED: Malformed = (
    Edit {
        truncate: true,
        ..NO_EDIT
    },
    "expected",
);

/// A JSON body without the key.
pub const NO_ID: Malformed = (
    Edit {
        body: Some(r#"{"object":"event"}"#),
        ..NO_EDIT
    },
    "expected",
);

pub const WECHATPAY_V3_VECTORS: &[Vector] = &[
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
        // The official doc example comes with a timestamp only; WeChat Pay
        // always signs, so the copy carries the signature headers real
        // deliveries have (the gateway's `auto` detection looks for them).
        headers: &[
            JSON,
            ("Wechatpay-Timestamp", "1432100975"),
            ("Wechatpay-Serial", "5157F09EFDC096DE15EBE81A47057A7232F1B8E1"),
            (
                "Wechatpay-Signature",
                "cmUtc2lnbmVkIGNvcHkgb2YgdGhlIHNhbWUgbm90aWZpY2F0aW9u",
            ),
        ],
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

pub const V2_NO_TRANSACTION_ID: Malformed = (
    Edit {
        replace: &[(
            "<transaction_id><![CDATA[1004400740201409030005092168]]></transaction_id>",
            "",
        )],
        ..NO_EDIT
    },
    "expected",
);

const MD5_SIGNED: &str = "wechatpay_v2_notify_SYNTHESIZED_md5_doc_key.xml";
const HMAC_SIGNED: &str = "wechatpay_v2_notify_SYNTHESIZED_hmacsha256_doc_key.xml";

/// The synthesized WeChat Pay v2 notification signed one way (`file`),
/// resent signed the other way (`resent`).
const fn wechatpay_v2_synthesized(file: &'static str, resent: &'static str) -> Vector {
    Vector {
        channel: &WECHATPAY_V2,
        source: Source::File(file),
        headers: &[XML],
        key: "1004400740201409030005092168",
        resent: Edit {
            file: Some(resent),
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
    }
}

pub const WECHATPAY_V2_VECTORS: &[Vector] = &[
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
    // The synthesized notification, each signature's copy resent as the
    // other one's (MD5 and HMAC-SHA256).
    wechatpay_v2_synthesized(MD5_SIGNED, HMAC_SIGNED),
    wechatpay_v2_synthesized(HMAC_SIGNED, MD5_SIGNED),
];

/// A body that is not a form.
pub const ALIPAY_XML_BODY: Malformed = (
    Edit {
        body: Some("<xml><notify_id>2019081500222155624068450559358070</notify_id></xml>"),
        ..NO_EDIT
    },
    "expected",
);

pub const ALIPAY_VECTORS: &[Vector] = &[
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

pub const STRIPE_VECTORS: &[Vector] = &[Vector {
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

pub const PAYPAL_VECTORS: &[Vector] = &[
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
pub const ADYEN_NO_ITEMS: Malformed = (
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

pub const CURRENCY_FIRST: &str = r#"{"currency": "EUR", "value": 1000}"#;
pub const VALUE_FIRST: &str = r#"{"value": 1000, "currency": "EUR"}"#;

pub const ADYEN_VECTORS: &[Vector] = &[
    adyen!("adyen_notify_adyen-python_backslash_ENVELOPED.json", "T7FD4VM4D3RZNN82:AUTHORISATION:true", CURRENCY_FIRST => VALUE_FIRST),
    adyen!("adyen_notify_adyen-python_colon_ENVELOPED.json", "M8NB66SBZSGLNK82:AUTHORISATION:true", CURRENCY_FIRST => VALUE_FIRST),
    adyen!("adyen_notify_adyen-python_forwardslash_ENVELOPED.json", "X3GWNS6KJ8NKGK82:AUTHORISATION:true", VALUE_FIRST => CURRENCY_FIRST),
    adyen!("adyen_notify_adyen-python_mixed_ENVELOPED.json", "ZVWN7D3WSMK2WN82:AUTHORISATION:true", CURRENCY_FIRST => VALUE_FIRST),
];

pub const NO_WEBHOOK_ID: Malformed = (
    Edit {
        drop: &["webhook-id"],
        ..NO_EDIT
    },
    "webhook-id",
);

pub const STANDARD_WEBHOOKS_VECTORS: &[Vector] = &[
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
pub const CLIENT_KEY: &str = "8e03978e-40d5-43e8-bc93-6894a57f9324";

pub const IDEMPOTENCY_KEY_VECTORS: &[Vector] = &[Vector {
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
