//! Reading a few fields out of an `application/x-www-form-urlencoded` body
//! (Alipay notifications) in one pass, decoding only the values wanted.

use std::borrow::Cow;

/// Reads the `wanted` fields of a form body in one pass; only their values
/// are decoded. The first occurrence of a name wins.
pub(crate) fn parse_form<'a>(body: &'a [u8], wanted: &[&'a str]) -> Vec<(&'a str, Cow<'a, str>)> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
