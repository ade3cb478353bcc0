//! One parse: a signed body that two readers could read differently is
//! refused before the claim, the signed content is built as the channels'
//! SDKs build it (Alipay signs `k=` too, in the body's charset), and — the
//! properties — whenever a body verifies, the key and fingerprint read from
//! it are those of the fields the verifier checked, and the string a `k=v`
//! scheme signs determines the field map.

use test_support::verify_support;

use proptest::prelude::*;
use tower_idempotency::verify::VerifyError;
use tower_idempotency::Preset;
use verify_support::fixture;
use verify_support::signed::*;

#[test]
fn wechat_v2_a_nested_element_inside_a_signed_field_is_refused() {
    let genuine = fixture("wechatpay_v2_notify_SYNTHESIZED_md5_doc_key.xml");
    assert!(verify(&wechat(), "text/xml", &genuine).is_ok());
    let text = String::from_utf8(genuine).unwrap();
    for forged in [
        text.replace(
            "<total_fee>1</total_fee>",
            "<total_fee>1<a>100000</a></total_fee>",
        ),
        text.replace(
            "<total_fee>1</total_fee>",
            "<total_fee><a>100000</a></total_fee>",
        ),
        text.replace("</xml>", "<total_fee>100000</total_fee></xml>"),
        text.replace("<xml>", "<xml>100000"),
        format!("{text}<xml><total_fee>100000</total_fee></xml>"),
    ] {
        let err = verify(&wechat(), "text/xml", forged.as_bytes()).unwrap_err();
        assert!(matches!(err, VerifyError::Malformed(_)), "{err}: {forged}");
    }
}

#[test]
fn alipay_gbk_notifications_signed_over_their_gbk_bytes_verify() {
    let subject = "语雀空间 500人规模";
    for (label, charset) in [
        ("GBK", encoding_rs::GBK),
        ("gbk", encoding_rs::GBK),
        ("GB2312", encoding_rs::GBK),
        ("GB18030", encoding_rs::GB18030),
        ("UTF-8", encoding_rs::UTF_8),
    ] {
        let body = alipay_body(&trade(label, subject), charset);
        if charset != encoding_rs::UTF_8 {
            assert!(
                !body.contains("%E8%AF%AD"),
                "the subject is in {label}, not UTF-8"
            );
        }
        let got = verify(&alipay(), FORM, body.as_bytes());
        assert!(got.is_ok(), "{label}: {got:?}");
        let key = extract(&Preset::alipay(), FORM, body.as_bytes()).unwrap();
        assert_eq!(key.key, "2019081500222155624068450559358070");
    }
    // A body that says UTF-8 but carries GBK bytes does not decode: refused.
    let gbk = alipay_body(&trade("GBK", subject), encoding_rs::GBK);
    let lying = gbk.replace("charset=GBK", "charset=UTF-8");
    assert!(verify(&alipay(), FORM, lying.as_bytes()).is_err());
    let unknown = gbk.replace("charset=GBK", "charset=Big5");
    assert!(verify(&alipay(), FORM, unknown.as_bytes()).is_err());
}

#[test]
fn alipay_signs_empty_values_like_the_sdks_and_refuses_a_repeated_parameter() {
    let mut fields = trade("utf-8", "order");
    fields.push(("passback_params", ""));
    let body = alipay_body(&fields, encoding_rs::UTF_8);
    assert!(
        verify(&alipay(), FORM, body.as_bytes()).is_ok(),
        "`passback_params=` is signed"
    );
    // Dropping the signed empty parameter, or adding one, breaks the signature.
    let dropped = body.replace("passback_params=&", "");
    assert!(verify(&alipay(), FORM, dropped.as_bytes()).is_err());
    let genuine = alipay_body(&trade("utf-8", "order"), encoding_rs::UTF_8);
    let added = format!("{genuine}&refund_fee=");
    assert!(matches!(
        verify(&alipay(), FORM, added.as_bytes()),
        Err(VerifyError::BadSignature)
    ));
    // The issue's forgery: `&trade_status=` appended to a signed form.
    let forged = format!("{genuine}&trade_status=");
    assert!(matches!(
        verify(&alipay(), FORM, forged.as_bytes()),
        Err(VerifyError::Malformed(_))
    ));
    let stray = format!("{genuine}&trade_status");
    assert!(verify(&alipay(), FORM, stray.as_bytes()).is_err());
}

#[test]
fn adyen_notification_items_twice_are_refused() {
    let genuine = adyen_item("PSP1", 100, "AUTHORISATION");
    let other = adyen_item("PSP2", 100000, "AUTHORISATION");
    let body = format!(r#"{{"live":"false","notificationItems":[{genuine}]}}"#);
    assert!(verify(&adyen(), "application/json", body.as_bytes()).is_ok());
    for forged in [
        format!(
            r#"{{"notificationItems":[{other}],"live":"false","notificationItems":[{genuine}]}}"#
        ),
        body.replace(
            r#""pspReference":"PSP1""#,
            r#""pspReference":"PSPX","pspReference":"PSP1""#,
        ),
        body.replace(r#""value":100"#, r#""value":{"v":100000},"value":100"#),
        body.replace(r#""value":100"#, r#""value":{"v":100}"#),
    ] {
        let err = verify(&adyen(), "application/json", forged.as_bytes()).unwrap_err();
        assert!(matches!(err, VerifyError::Malformed(_)), "{err}: {forged}");
    }
    // The original vectors still verify.
    for name in ["backslash", "colon", "forwardslash", "mixed"] {
        let body = fixture(&format!("adyen_notify_adyen-python_{name}_ENVELOPED.json"));
        assert!(
            verify(&adyen(), "application/json", &body).is_ok(),
            "{name}"
        );
    }
}

#[test]
fn a_value_holding_a_field_boundary_is_refused_though_the_signed_string_is_genuine() {
    // Alipay: `notify_type` folded into `notify_id` signs the same string
    // (`notify_id=N&notify_type=…`) under another key.
    let genuine = trade("utf-8", "order");
    let folded: Vec<(&str, &str)> = genuine
        .iter()
        .filter(|(k, _)| *k != "notify_type")
        .map(|&(k, v)| match k {
            "notify_id" => (
                k,
                "2019081500222155624068450559358070&notify_type=trade_status_sync",
            ),
            _ => (k, v),
        })
        .collect();
    assert_eq!(
        signed_pairs(&genuine),
        signed_pairs(&folded),
        "one signed string"
    );
    let body = alipay_body(&folded, encoding_rs::UTF_8);
    let err = verify(&alipay(), FORM, body.as_bytes()).unwrap_err();
    assert!(matches!(err, VerifyError::Malformed(_)), "{err}");
    assert!(err.to_string().contains("field boundary"), "{err}");
    // A name holding `=` or `&` (`notify_id=N` named `notify_id=2019…`).
    for name in ["a=b", "a&b"] {
        let mut fields = trade("utf-8", "order");
        fields.push((name, "1"));
        let body = alipay_body(&fields, encoding_rs::UTF_8);
        let err = verify(&alipay(), FORM, body.as_bytes()).unwrap_err();
        assert!(matches!(err, VerifyError::Malformed(_)), "{name}: {err}");
    }
    // `&` or `=` alone, or `=` before `&`, reads as no boundary: verifies.
    for subject in ["Tom & Jerry", "a=b", "x=1&y", "&", "=", "&&"] {
        let body = alipay_body(&trade("utf-8", subject), encoding_rs::UTF_8);
        let got = verify(&alipay(), FORM, body.as_bytes());
        assert!(got.is_ok(), "{subject:?}: {got:?}");
    }

    // WeChat Pay v2: `total_fee` folded into `result_code`.
    let fields = |result: &str, fee: Option<&str>| {
        let mut f = vec![
            ("out_trade_no".to_owned(), "o1".to_owned()),
            ("result_code".to_owned(), result.to_owned()),
            ("transaction_id".to_owned(), "4200001".to_owned()),
        ];
        if let Some(fee) = fee {
            f.push(("total_fee".to_owned(), fee.to_owned()));
        }
        f
    };
    let genuine = fields("SUCCESS", Some("1"));
    let folded = fields("SUCCESS&total_fee=1", None);
    assert_eq!(
        wechat_sign(&genuine),
        wechat_sign(&folded),
        "one signed string"
    );
    let with_sign = |mut f: Vec<(String, String)>| {
        let sign = wechat_sign(&f);
        f.push(("sign".into(), sign));
        xml(&f)
    };
    assert!(verify(&wechat(), "text/xml", with_sign(genuine).as_bytes()).is_ok());
    let err = verify(&wechat(), "text/xml", with_sign(folded).as_bytes()).unwrap_err();
    assert!(matches!(err, VerifyError::Malformed(_)), "{err}");
    for result in ["A & B", "a=b", "x=1&y"] {
        let body = with_sign(fields(result, Some("1")));
        let got = verify(&wechat(), "text/xml", body.as_bytes());
        assert!(got.is_ok(), "{result:?}: {got:?}");
    }
}

/// The string Alipay signs for `fields` (every field here is signed).
fn signed_pairs(fields: &[(&str, &str)]) -> String {
    let mut sorted = fields.to_vec();
    sorted.sort();
    let pairs: Vec<String> = sorted.iter().map(|(k, v)| format!("{k}={v}")).collect();
    pairs.join("&")
}

/// Another reading of the signed string `s` of `k=v` pairs joined with `&`:
/// cut at the `&`s that `choice` picks, each piece split at one of its `=`s;
/// `None` when a piece holds no `=`, a name is empty or repeats, or the
/// names are not in the order the scheme sorts them (another signed string).
fn reread(s: &str, choice: &[u8]) -> Option<Vec<(String, String)>> {
    let mut pick = choice.iter().cycle();
    let mut pieces = vec![String::new()];
    for c in s.chars() {
        if c == '&' && pick.next().is_some_and(|b| b & 1 == 1) {
            pieces.push(String::new());
        } else {
            pieces.last_mut().unwrap().push(c);
        }
    }
    let mut out: Vec<(String, String)> = Vec::new();
    for piece in pieces {
        let eqs: Vec<usize> = piece.match_indices('=').map(|(i, _)| i).collect();
        let at = *eqs.get(usize::from(*pick.next().unwrap()) % eqs.len().max(1))?;
        let (name, value) = (&piece[..at], &piece[at + 1..]);
        if name.is_empty() || out.last().is_some_and(|(k, _)| k.as_str() >= name) {
            return None;
        }
        out.push((name.to_owned(), value.to_owned()));
    }
    Some(out)
}

// ---- The property --------------------------------------------------------

/// How a forger rewrites a genuine body while keeping its signature.
#[derive(Debug, Clone)]
enum Mutation {
    /// The body as signed.
    None,
    /// One field again, with another value, before or after the genuine one.
    Repeat {
        field: usize,
        value: String,
        before: bool,
    },
    /// Nested markup inside a field (XML) or an object where a field is
    /// expected (JSON).
    Nest { field: usize, value: String },
    /// Text outside the fields (XML) or a segment without `=` (form).
    Stray(String),
    /// A second root / document after the first.
    SecondRoot(String),
    /// The fields in another order (must still verify, with the same key).
    Reverse,
}

fn mutation(fields: usize) -> impl Strategy<Value = Mutation> {
    let value = "[0-9a-zA-Z语中]{0,6}";
    prop_oneof![
        Just(Mutation::None),
        (0..fields, value, any::<bool>()).prop_map(|(field, value, before)| Mutation::Repeat {
            field,
            value,
            before
        }),
        (0..fields, value).prop_map(|(field, value)| Mutation::Nest { field, value }),
        "[a-z0-9]{1,5}".prop_map(Mutation::Stray),
        value.prop_map(Mutation::SecondRoot),
        Just(Mutation::Reverse),
    ]
}

/// WeChat Pay v2 bodies: the key's fields plus random others.
fn wechat_fields() -> impl Strategy<Value = Vec<(String, String)>> {
    (
        "[0-9]{1,12}",
        "[0-9]{1,6}",
        prop::sample::select(vec!["SUCCESS", "FAIL"]),
        prop::collection::btree_map("[a-z]{1,3}", "[0-9a-zA-Z语 ]{0,6}", 0..4),
    )
        .prop_map(|(tx, fee, result, extra)| {
            let mut fields = vec![
                ("transaction_id".to_owned(), tx.clone()),
                ("out_trade_no".to_owned(), format!("o{tx}")),
                ("total_fee".to_owned(), fee),
                ("result_code".to_owned(), result.to_owned()),
            ];
            fields.extend(extra.into_iter().map(|(k, v)| (format!("x_{k}"), v)));
            fields
        })
}

fn wechat_mutated(fields: &[(String, String)], sign: &str, m: &Mutation) -> String {
    let mut fields = fields.to_vec();
    fields.push(("sign".into(), sign.into()));
    match m {
        Mutation::None => xml(&fields),
        Mutation::Repeat {
            field,
            value,
            before,
        } => {
            let (k, _) = fields[*field].clone();
            let at = if *before { *field } else { *field + 1 };
            fields.insert(at, (k, value.clone()));
            xml(&fields)
        }
        Mutation::Nest { field, value } => {
            let (k, v) = &fields[*field];
            xml(&fields).replacen(
                &format!("<{k}><![CDATA[{v}]]></{k}>"),
                &format!("<{k}><![CDATA[{v}]]><a>{value}</a></{k}>"),
                1,
            )
        }
        Mutation::Stray(text) => xml(&fields).replacen("<xml>", &format!("<xml>{text}"), 1),
        Mutation::SecondRoot(v) => format!("{}<xml><total_fee>{v}</total_fee></xml>", xml(&fields)),
        Mutation::Reverse => {
            fields.reverse();
            xml(&fields)
        }
    }
}

fn adyen_mutated(psp: &str, value: i64, m: &Mutation) -> String {
    let item = adyen_item(psp, value, "AUTHORISATION");
    let body = format!(r#"{{"live":"false","notificationItems":[{item}]}}"#);
    match m {
        Mutation::None | Mutation::Reverse => body,
        Mutation::Repeat {
            value: v, before, ..
        } => {
            let forged = format!(
                r#"[{{"NotificationRequestItem":{{"pspReference":"F{v}","eventCode":"REFUND","success":"true"}}}}]"#
            );
            if *before {
                body.replacen(
                    r#""notificationItems""#,
                    &format!(r#""notificationItems":{forged},"notificationItems""#),
                    1,
                )
            } else {
                body.replacen(
                    r#""pspReference""#,
                    &format!(r#""pspReference":"F{v}","pspReference""#),
                    1,
                )
            }
        }
        Mutation::Nest { value: v, .. } => body.replacen(
            r#""value":"#,
            &format!(r#""value":{{"x":"{v}"}},"value":"#),
            1,
        ),
        Mutation::Stray(t) => format!("{body} {t}"),
        Mutation::SecondRoot(v) => format!(r#"{body}{{"notificationItems":"{v}"}}"#),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Whenever a rewritten WeChat Pay v2 body still verifies, its key and
    /// fingerprint are those of the body as signed.
    #[test]
    fn wechat_v2_what_the_key_reads_is_what_the_verifier_checked(
        fields in wechat_fields(),
        m in mutation(4),
    ) {
        let sign = wechat_sign(&fields);
        let clean = wechat_mutated(&fields, &sign, &Mutation::None);
        prop_assert!(verify(&wechat(), "text/xml", clean.as_bytes()).is_ok());
        let want = extract(&Preset::wechatpay_v2(), "text/xml", clean.as_bytes()).unwrap();
        let body = wechat_mutated(&fields, &sign, &m);
        if verify(&wechat(), "text/xml", body.as_bytes()).is_ok() {
            let got = extract(&Preset::wechatpay_v2(), "text/xml", body.as_bytes());
            prop_assert_eq!(got.as_ref().map(|g| &g.key), Some(&want.key), "{}", body);
            prop_assert_eq!(got.map(|g| g.fingerprint), Some(want.fingerprint), "{}", body);
        } else {
            prop_assert!(!matches!(m, Mutation::None | Mutation::Reverse), "{}", body);
        }
    }

    /// The same for Adyen JSON bodies.
    #[test]
    fn adyen_what_the_key_reads_is_what_the_verifier_checked(
        psp in "[A-Z0-9]{4,16}",
        value in 0i64..1_000_000,
        m in mutation(1),
    ) {
        let clean = adyen_mutated(&psp, value, &Mutation::None);
        let want = extract(&Preset::adyen(), "application/json", clean.as_bytes()).unwrap();
        let body = adyen_mutated(&psp, value, &m);
        if verify(&adyen(), "application/json", body.as_bytes()).is_ok() {
            let got = extract(&Preset::adyen(), "application/json", body.as_bytes());
            prop_assert_eq!(got.as_ref().map(|g| &g.key), Some(&want.key), "{}", body);
            prop_assert_eq!(got.map(|g| g.fingerprint), Some(want.fingerprint), "{}", body);
        } else {
            prop_assert!(!matches!(m, Mutation::None | Mutation::Reverse), "{}", body);
        }
    }

    /// The same for Alipay forms (signed once per case with the test key).
    #[test]
    fn alipay_what_the_key_reads_is_what_the_verifier_checked(
        status in prop::sample::select(vec!["TRADE_SUCCESS", "TRADE_CLOSED", ""]),
        amount in "[0-9]{1,4}\\.[0-9]{2}",
        m in mutation(3),
        gbk in any::<bool>(),
    ) {
        let (label, charset) = if gbk { ("GBK", encoding_rs::GBK) } else { ("UTF-8", encoding_rs::UTF_8) };
        let fields = vec![
            ("charset", label),
            ("notify_id", "N1"),
            ("subject", "中文"),
            ("total_amount", amount.as_str()),
            ("trade_status", status),
        ];
        let clean = alipay_body(&fields, charset);
        prop_assert!(verify(&alipay(), FORM, clean.as_bytes()).is_ok());
        let want = extract(&Preset::alipay(), FORM, clean.as_bytes()).unwrap();
        let names = ["notify_id", "total_amount", "trade_status"];
        let body = match &m {
            Mutation::None => clean.clone(),
            Mutation::Repeat { field, value, before } => {
                let extra = format!("{}={}", names[*field], pct(value.as_bytes()));
                if *before { format!("{extra}&{clean}") } else { format!("{clean}&{extra}") }
            }
            Mutation::Nest { field, value } => format!("{clean}&{}%5B{}%5D=1", names[*field], pct(value.as_bytes())),
            Mutation::Stray(t) => format!("{clean}&{t}"),
            Mutation::SecondRoot(v) => format!("{clean}&&{}", pct(v.as_bytes())),
            Mutation::Reverse => clean.split('&').rev().collect::<Vec<_>>().join("&"),
        };
        if verify(&alipay(), FORM, body.as_bytes()).is_ok() {
            let got = extract(&Preset::alipay(), FORM, body.as_bytes());
            prop_assert_eq!(got.as_ref().map(|g| &g.key), Some(&want.key), "{}", body);
            prop_assert_eq!(got.map(|g| g.fingerprint), Some(want.fingerprint), "{}", body);
        } else {
            prop_assert!(!matches!(m, Mutation::None | Mutation::Reverse), "{}", body);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// The signed string determines the field map: two different Alipay
    /// field maps that sign one string (`a=x&b=y` is `{a: "x&b=y"}` or
    /// `{a: "x", b: "y"}`) never both verify.
    #[test]
    fn alipay_one_signed_string_verifies_one_field_map(
        fields in prop::collection::btree_map("[ab][ab&=]{0,2}", "[ab&=]{0,4}", 1..4),
        choice in prop::collection::vec(any::<u8>(), 1..12),
    ) {
        let genuine: Vec<(&str, &str)> = fields.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let signed = signed_pairs(&genuine);
        let Some(other) = reread(&signed, &choice) else { return Ok(()) };
        let other: Vec<(&str, &str)> = other.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        prop_assert_eq!(&signed_pairs(&other), &signed);
        if other != genuine {
            let a = verify(&alipay(), FORM, alipay_body(&genuine, encoding_rs::UTF_8).as_bytes());
            let b = verify(&alipay(), FORM, alipay_body(&other, encoding_rs::UTF_8).as_bytes());
            prop_assert!(a.is_err() || b.is_err(), "{:?} and {:?} both verify, signing {:?}", genuine, other, signed);
        }
    }

    /// The same for WeChat Pay v2 (its non-empty fields: empty ones are not
    /// signed, by the channel's rule).
    #[test]
    fn wechat_v2_one_signed_string_verifies_one_field_map(
        fields in prop::collection::btree_map("[ab]{1,3}", "[ab&=]{1,4}", 1..4),
        choice in prop::collection::vec(any::<u8>(), 1..12),
    ) {
        let genuine: Vec<(String, String)> = fields.into_iter().collect();
        let pairs: Vec<(&str, &str)> = genuine.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let signed = signed_pairs(&pairs);
        let Some(other) = reread(&signed, &choice) else { return Ok(()) };
        if other != genuine && other.iter().all(|(_, v)| !v.is_empty()) {
            prop_assert_eq!(wechat_sign(&other), wechat_sign(&genuine));
            let body = |f: &[(String, String)]| {
                let mut f = f.to_vec();
                f.push(("sign".into(), wechat_sign(&f)));
                xml(&f)
            };
            let a = verify(&wechat(), "text/xml", body(&genuine).as_bytes());
            let b = verify(&wechat(), "text/xml", body(&other).as_bytes());
            prop_assert!(a.is_err() || b.is_err(), "{:?} and {:?} both verify, signing {:?}", genuine, other, signed);
        }
    }
}
