//! Reading the fields of an `application/x-www-form-urlencoded` body
//! (Alipay notifications): a few wanted ones in one pass for the key, or all
//! of them, strictly, for the verifier. Both decode values in the charset the
//! body declares (`charset=GBK`, as Alipay sends for GBK applications).

use encoding_rs::{Encoding, GB18030, GBK, UTF_8};
use std::borrow::Cow;

/// Reads the `wanted` fields of an `application/x-www-form-urlencoded` body
/// in one pass, as the key layer reads them; only their values are decoded,
/// in the charset the body declares (its `charset` field: GBK, GB2312 or
/// GB18030, else UTF-8). The first occurrence of a name wins (the verifier
/// refuses a repeated name). Code that reads a notification's fields after
/// the layers should read them with this, so that both read the same.
pub fn parse_form<'a>(body: &'a [u8], wanted: &[&'a str]) -> Vec<(&'a str, Cow<'a, str>)> {
    let charset = form_charset(body).unwrap_or(UTF_8);
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
            out.push((hit, decode_in(value, charset)));
        }
    }
    out
}

/// The charset a form body declares in its `charset` parameter: UTF-8 when
/// absent; `Err` with the label when it is none of UTF-8, GBK, GB2312 and
/// GB18030 (GB2312 bodies decode as GBK, its superset).
pub(crate) fn form_charset(body: &[u8]) -> Result<&'static Encoding, String> {
    let label = body.split(|&b| b == b'&').find_map(|pair| {
        let (name, value) = pair.split_at(pair.iter().position(|&b| b == b'=')?);
        (name == b"charset").then(|| decode_form(&value[1..]))
    });
    let Some(label) = label else {
        return Ok(UTF_8);
    };
    match label.trim().to_ascii_lowercase().as_str() {
        "utf-8" | "utf8" => Ok(UTF_8),
        "gbk" | "gb2312" => Ok(GBK),
        "gb18030" => Ok(GB18030),
        _ => Err(label.into_owned()),
    }
}

/// Percent-decodes `raw` and decodes the bytes in `charset`, replacing what
/// does not decode.
fn decode_in<'a>(raw: &'a [u8], charset: &'static Encoding) -> Cow<'a, str> {
    if charset == UTF_8 {
        return decode_form(raw);
    }
    let bytes = percent_decode(raw);
    let (text, _) = charset.decode_without_bom_handling(&bytes);
    Cow::Owned(text.into_owned())
}

/// One field of a form body as the verifier reads it.
#[cfg(feature = "verify")]
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FormField {
    /// The decoded name.
    pub(crate) name: String,
    /// The percent-decoded value bytes, in the body's charset (what the
    /// sender signed).
    pub(crate) raw: Vec<u8>,
    /// The value decoded in the body's charset.
    pub(crate) value: String,
}

/// Every field of a form body, strictly: a name that repeats, a segment that
/// is no `name=value` pair, a name that is not UTF-8, a value that does not
/// decode in the body's charset, an unknown charset, or more than
/// [`MAX_FIELDS`](super::MAX_FIELDS) parameters is an `Err` naming the
/// fault. Empty segments (`a=1&&b=2`, a trailing `&`) are skipped. Linear in
/// the body: each name is looked up in a hash set of the earlier ones.
#[cfg(feature = "verify")]
pub(crate) fn parse_form_strict(body: &[u8]) -> Result<Vec<FormField>, Cow<'static, str>> {
    let charset = form_charset(body).map_err(|label| {
        Cow::Owned(format!(
            "form charset {label:?} (UTF-8, GBK, GB2312 or GB18030)"
        ))
    })?;
    let mut out: Vec<FormField> = Vec::new();
    let mut names = foldhash::HashSet::default();
    for pair in body.split(|&b| b == b'&').filter(|p| !p.is_empty()) {
        if out.len() == super::MAX_FIELDS {
            return Err(Cow::Owned(format!(
                "form body of more than {} parameters",
                super::MAX_FIELDS
            )));
        }
        let Some(at) = pair.iter().position(|&b| b == b'=') else {
            return Err(Cow::Borrowed("form segment without `=`"));
        };
        let name = String::from_utf8(percent_decode(&pair[..at]).into_owned())
            .map_err(|_| Cow::Borrowed("form parameter name"))?;
        if name.is_empty() {
            return Err(Cow::Borrowed("form parameter without a name"));
        }
        if !names.insert(name.clone()) {
            return Err(Cow::Owned(format!("repeated form parameter {name:?}")));
        }
        let raw = percent_decode(&pair[at + 1..]).into_owned();
        let value = charset
            .decode_without_bom_handling_and_without_replacement(&raw)
            .ok_or_else(|| {
                Cow::Owned(format!("form parameter {name:?} is not {}", charset.name()))
            })?
            .into_owned();
        out.push(FormField { name, raw, value });
    }
    Ok(out)
}

/// `application/x-www-form-urlencoded` byte decoding: `+` is a space, `%XX`
/// a byte; a `%` not followed by two hex digits stays as it is (the
/// `percent-encoding` crate's decoding). The pieces between `+`s are
/// decoded one by one, so that an escaped `%2B` stays a `+` (no escape
/// spans a `+`), into one buffer. Borrowed when nothing is decoded.
fn percent_decode(raw: &[u8]) -> Cow<'_, [u8]> {
    if !raw.contains(&b'+') {
        return percent_encoding::percent_decode(raw).into();
    }
    let mut out = Vec::with_capacity(raw.len());
    for (i, piece) in raw.split(|&b| b == b'+').enumerate() {
        if i > 0 {
            out.push(b' ');
        }
        out.extend(percent_encoding::percent_decode(piece));
    }
    Cow::Owned(out)
}

/// `application/x-www-form-urlencoded` decoding to UTF-8 text (lossy).
pub(crate) fn decode_form(raw: &[u8]) -> Cow<'_, str> {
    match percent_decode(raw) {
        Cow::Borrowed(b) => String::from_utf8_lossy(b),
        Cow::Owned(b) => Cow::Owned(String::from_utf8_lossy(&b).into_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hand-written decoder `percent_decode` was before it used the
    /// `percent-encoding` crate: the reference the crate's decoding is held
    /// to, byte for byte.
    fn reference(raw: &[u8]) -> Vec<u8> {
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
        out
    }

    /// A signed form must read one way: the decoded bytes of tricky
    /// escapes, as a table, and every string of up to five bytes from an
    /// alphabet of escape parts, against the reference.
    #[test]
    fn form_decoding_is_byte_for_byte_the_reference() {
        let table: &[(&[u8], &[u8])] = &[
            (b"", b""),
            (b"%", b"%"),
            (b"%4", b"%4"),
            (b"%zz", b"%zz"),
            (b"%%41", b"%A"),
            (b"%41%", b"A%"),
            (b"%4%41", b"%4A"),
            (b"%%%", b"%%%"),
            (b"%2525", b"%25"),
            (b"+", b" "),
            (b"%2B+%2b", b"+ +"),
            (b"%+1", b"% 1"),
            (b"%2+", b"%2 "),
            (b"a+b%20c", b"a b c"),
            (b"%FF%fe", b"\xFF\xFE"),
            (b"%C3%A9", "\u{e9}".as_bytes()),
            (b"%C3", b"\xC3"),
            (b"%00%0a", b"\x00\n"),
            (b"\xFF%4\xFF", b"\xFF%4\xFF"),
            (b"%\xC3\xA9", "%\u{e9}".as_bytes()),
            (b"%\xEF\xBC\x91\xEF\xBC\x91", "%\u{ff11}\u{ff11}".as_bytes()),
        ];
        for (raw, decoded) in table {
            let got = percent_decode(raw);
            assert_eq!(&*got, *decoded, "{:?}", String::from_utf8_lossy(raw));
            assert_eq!(&*got, reference(raw), "{:?}", String::from_utf8_lossy(raw));
            let text = decode_form(raw);
            assert_eq!(text, String::from_utf8_lossy(decoded), "{raw:?}");
        }
        let alphabet = [b'%', b'+', b'2', b'b', b'F', b'z', b'0', b' ', 0xFF, 0xC3];
        let mut raw = Vec::new();
        let mut cases = 0;
        for len in 0..=5_u32 {
            for mut n in 0..alphabet.len().pow(len) {
                raw.clear();
                for _ in 0..len {
                    raw.push(alphabet[n % alphabet.len()]);
                    n /= alphabet.len();
                }
                assert_eq!(percent_decode(&raw), reference(&raw), "{raw:?}");
                cases += 1;
            }
        }
        assert_eq!(cases, 111_111);
        // Nothing to decode: the input itself, not a copy.
        assert!(matches!(percent_decode(b"a=b"), Cow::Borrowed(_)));
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

    #[cfg(feature = "verify")]
    #[test]
    fn strict_form_refuses_what_two_readers_could_read_differently() {
        for body in [
            &b"a=1&trade_status=&trade_status=TRADE_SUCCESS"[..],
            b"a=1&flag",
            b"a=1&=2",
            b"charset=latin1&a=1",
            b"charset=GBK&subject=%FF",
            b"a=%FF%FE",
        ] {
            assert!(
                parse_form_strict(body).is_err(),
                "{:?}",
                String::from_utf8_lossy(body)
            );
        }
        let got = parse_form_strict(b"charset=GBK&subject=%D6%D0%CE%C4&empty=&&").unwrap();
        assert_eq!(got.len(), 3);
        assert_eq!(got[1].value, "中文");
        assert_eq!(got[1].raw, [0xD6, 0xD0, 0xCE, 0xC4]);
        assert_eq!(got[2].value, "");
        let wanted = parse_form(b"charset=gb2312&subject=%D6%D0%CE%C4", &["subject"]);
        assert_eq!(wanted[0].1, "中文");
    }
}
