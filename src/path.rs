//! One spelling per request path, so that `/orders`, `/orders/`, `//orders`,
//! `/shop/../orders` and `/%6Frders` route, scope and fingerprint alike.

use std::borrow::Cow;
#[cfg(feature = "proxy")]
use std::fmt;

/// Why a path has no safe normal form: servers behind a proxy read such a
/// path in more than one way (Tomcat drops `;params`, some decode `%2F` into a
/// separator or treat `\` as one, C code stops at a NUL), so no one spelling
/// can stand for what the upstream will see.
#[cfg(feature = "proxy")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unsafe {
    /// A `;` in a segment (path parameters).
    Semicolon,
    /// An escaped `/` (`%2F`) or a `\`, escaped or not.
    Separator,
    /// An escaped control character (`%00` to `%1F`, `%7F`).
    Control,
    /// Escapes that decode to bytes that are not UTF-8 (`%FF`).
    NotUtf8,
    /// A `%` not followed by two hex digits.
    BadEscape,
}

#[cfg(feature = "proxy")]
impl fmt::Display for Unsafe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Semicolon => "a `;` in the path",
            Self::Separator => "an escaped `/` or a `\\` in the path",
            Self::Control => "an escaped control character in the path",
            Self::NotUtf8 => "escapes in the path that are not UTF-8",
            Self::BadEscape => "a `%` in the path that is not an escape",
        })
    }
}

/// The normal form of a request path at the gateway's entrance, or why it
/// has none that every server would agree on.
///
/// A path that does not start with `/` (`*`, or the empty path of a
/// `CONNECT`) is left as it is: no route matches it.
#[cfg(feature = "proxy")]
pub(crate) fn strict(path: &str) -> Result<Cow<'_, str>, Unsafe> {
    if !path.starts_with('/') {
        return Ok(Cow::Borrowed(path));
    }
    if !path.bytes().any(|b| matches!(b, b';' | b'\\' | b'%')) {
        return Ok(normalize(path));
    }
    if path.contains(';') {
        return Err(Unsafe::Semicolon);
    }
    if path.contains('\\') {
        return Err(Unsafe::Separator);
    }
    if path.contains('%') {
        let hex = |c: u8| (c as char).to_digit(16);
        let bytes = path.as_bytes();
        let mut decoded = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] != b'%' {
                decoded.push(bytes[i]);
                i += 1;
                continue;
            }
            let (Some(h), Some(l)) = (
                bytes.get(i + 1).and_then(|c| hex(*c)),
                bytes.get(i + 2).and_then(|c| hex(*c)),
            ) else {
                return Err(Unsafe::BadEscape);
            };
            let b = (h * 16 + l) as u8;
            match b {
                b'/' | b'\\' => return Err(Unsafe::Separator),
                0..=0x1f | 0x7f => return Err(Unsafe::Control),
                _ => decoded.push(b),
            }
            i += 3;
        }
        if std::str::from_utf8(&decoded).is_err() {
            return Err(Unsafe::NotUtf8);
        }
    }
    Ok(normalize(path))
}

/// The path as a lenient server would read it: path parameters dropped from
/// every segment, escaped separators and `\` taken as `/`, then normalised.
/// The gateway refuses an unsafe path when this reading (or the normal form
/// of the path as written) lands on a guarded route.
#[cfg(feature = "proxy")]
pub(crate) fn lenient(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    let mut rest = path;
    while !rest.is_empty() {
        let (segment, tail) = match rest.find(['/', '\\']) {
            Some(0) => {
                out.push('/');
                rest = &rest[1..];
                continue;
            }
            Some(at) => (&rest[..at], &rest[at..]),
            None => (rest, ""),
        };
        let segment = segment.split(';').next().unwrap_or_default();
        let mut s = segment;
        while let Some(at) = s.find('%') {
            out.push_str(&s[..at]);
            let escape = s.get(at..at + 3).unwrap_or(&s[at..]);
            if escape.eq_ignore_ascii_case("%2F") || escape.eq_ignore_ascii_case("%5C") {
                out.push('/');
            } else {
                out.push_str(escape);
            }
            s = &s[at + escape.len()..];
        }
        out.push_str(s);
        rest = tail;
    }
    normalize(&out).into_owned()
}

/// The normal form of a path (RFC 3986 section 6.2.2): percent-encoded
/// unreserved characters decoded, other escapes upper-cased, dot segments
/// resolved, empty segments (duplicate and trailing slashes) dropped.
/// Already-normal paths are borrowed.
pub(crate) fn normalize(path: &str) -> Cow<'_, str> {
    if is_normal(path) {
        return Cow::Borrowed(path);
    }
    let mut segments: Vec<String> = Vec::new();
    for raw in path.split('/') {
        let segment = decode_unreserved(raw);
        match segment.as_str() {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            _ => segments.push(segment),
        }
    }
    let mut out = String::with_capacity(path.len());
    for s in &segments {
        out.push('/');
        out.push_str(s);
    }
    if out.is_empty() {
        out.push('/');
    }
    Cow::Owned(out)
}

fn is_normal(path: &str) -> bool {
    if path == "/" {
        return true;
    }
    let Some(rest) = path.strip_prefix('/') else {
        return false;
    };
    !path.contains('%') && rest.split('/').all(|s| !matches!(s, "" | "." | ".."))
}

fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// Decodes `%XX` escapes of unreserved characters; keeps (upper-cased) the
/// others, so that `a%2Fb` stays one segment distinct from `a/b`.
fn decode_unreserved(segment: &str) -> String {
    let bytes = segment.as_bytes();
    let mut out = String::with_capacity(segment.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                let b = (h * 16 + l) as u8;
                if is_unreserved(b) {
                    out.push(b as char);
                } else {
                    out.push('%');
                    out.push(bytes[i + 1].to_ascii_uppercase() as char);
                    out.push(bytes[i + 2].to_ascii_uppercase() as char);
                }
                i += 3;
                continue;
            }
        }
        // Copy one whole character (paths from `http::Uri` are ASCII, but
        // a matched route or a user's path may not be).
        let len = segment[i..].chars().next().map_or(1, char::len_utf8);
        out.push_str(&segment[i..i + len]);
        i += len;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::normalize;
    #[cfg(feature = "proxy")]
    use super::{lenient, strict, Unsafe};

    #[test]
    fn spellings_of_one_path() {
        for (raw, normal) in [
            ("/", "/"),
            ("", "/"),
            ("/orders", "/orders"),
            ("/orders/", "/orders"),
            ("//orders//1/", "/orders/1"),
            ("/./orders/%31", "/orders/1"),
            ("/shop/../orders", "/orders"),
            ("/../../orders", "/orders"),
            ("/orders/%2e%2E/x", "/x"),
            ("/a%2fb", "/a%2Fb"),
            ("/a%zz%4", "/a%zz%4"),
            ("/a%", "/a%"),
            ("/items/{id}/", "/items/{id}"),
            ("/é/", "/é"),
        ] {
            assert_eq!(normalize(raw), normal, "{raw}");
        }
        assert!(matches!(
            normalize("/orders/1"),
            std::borrow::Cow::Borrowed(_)
        ));
    }

    #[cfg(feature = "proxy")]
    #[test]
    fn strict_refuses_what_servers_read_two_ways() {
        for (raw, normal) in [
            ("/notify/%73tripe", "/notify/stripe"),
            ("//notify/./stripe/", "/notify/stripe"),
            ("/notify/x/../stripe", "/notify/stripe"),
            ("/caf%C3%A9", "/caf%C3%A9"),
            ("/a%3Bb", "/a%3Bb"),
            ("/NOTIFY/stripe", "/NOTIFY/stripe"),
            ("*", "*"),
            ("", ""),
        ] {
            assert_eq!(strict(raw).as_deref(), Ok(normal), "{raw}");
        }
        for (raw, why) in [
            ("/notify/stripe;x", Unsafe::Semicolon),
            ("/a%2Fb", Unsafe::Separator),
            ("/a%2fb", Unsafe::Separator),
            ("/a%5cb", Unsafe::Separator),
            ("/a\\b", Unsafe::Separator),
            ("/a%00", Unsafe::Control),
            ("/a%0A", Unsafe::Control),
            ("/a%FF", Unsafe::NotUtf8),
            ("/a%C3%28", Unsafe::NotUtf8),
            ("/a%zz", Unsafe::BadEscape),
            ("/a%4", Unsafe::BadEscape),
            ("/a%", Unsafe::BadEscape),
        ] {
            assert_eq!(strict(raw), Err(why), "{raw}");
        }
    }

    #[cfg(feature = "proxy")]
    #[test]
    fn lenient_reads_path_parameters_and_escaped_separators_away() {
        for (raw, read) in [
            ("/notify/stripe;x", "/notify/stripe"),
            ("/notify;a=1/stripe;jsessionid=2/", "/notify/stripe"),
            ("/notify%2Fstripe", "/notify/stripe"),
            ("/notify%5cstripe", "/notify/stripe"),
            ("/notify\\stripe", "/notify/stripe"),
            ("/x/..;/notify/stripe", "/notify/stripe"),
            ("/a%00", "/a%00"),
            ("/a%", "/a%"),
        ] {
            assert_eq!(lenient(raw), read, "{raw}");
        }
    }
}
