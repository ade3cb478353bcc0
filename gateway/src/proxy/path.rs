//! How a request path is read at the gateway's entrance: its normal form
//! ([`normalize`], the same as the layers' keys and fingerprints use), or
//! why it has none that every server behind a proxy would agree on, and
//! the other routes a lenient server could read it as.

use std::borrow::Cow;
use std::fmt;
pub(crate) use tower_idempotency::path::normalize;

/// Why a path is refused on a guarded route: it has no safe normal form
/// (servers behind a proxy read such a path in more than one way: Tomcat
/// drops `;params`, some decode `%2F` into a separator or treat `\` as one,
/// C code stops at a NUL, so no one spelling can stand for what the upstream
/// will see), or its normal form is safe but a lenient server could read it
/// as another route ([`Unsafe::Ambiguous`]), or it is not ASCII on a verified
/// route ([`Unsafe::NotAscii`]).
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
    /// A path that a lenient server could read as a guarded route other than
    /// the one its normal form is on (`/notify/stripe.json`, `/notify/ſtripe`,
    /// `/notify/stripe%20`).
    Ambiguous,
    /// A character that is not ASCII, written or escaped, on a verified route.
    NotAscii,
}

impl fmt::Display for Unsafe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Semicolon => "a `;` in the path",
            Self::Separator => "an escaped `/` or a `\\` in the path",
            Self::Control => "an escaped control character in the path",
            Self::NotUtf8 => "escapes in the path that are not UTF-8",
            Self::BadEscape => "a `%` in the path that is not an escape",
            Self::Ambiguous => "a path that a server could read as another route",
            Self::NotAscii => "a character that is not ASCII in the path of a verified route",
        })
    }
}

/// The normal form of a request path at the gateway's entrance, or why it
/// has none that every server would agree on.
///
/// A path that does not start with `/` (`*`, or the empty path of a
/// `CONNECT`) is left as it is: no route matches it.
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
        let bytes = path.as_bytes();
        let mut decoded = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] != b'%' {
                decoded.push(bytes[i]);
                i += 1;
                continue;
            }
            let (Some(h), Some(l)) = (hex(bytes.get(i + 1)), hex(bytes.get(i + 2))) else {
                return Err(Unsafe::BadEscape);
            };
            let b = h * 16 + l;
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

/// The path as a lenient server would read it: every escape decoded (twice,
/// as a server that decodes twice would), cut at a NUL (as C code reads it),
/// `\` taken as `/`, path parameters dropped from every segment (as Tomcat
/// does), each segment trimmed of white space, control characters and
/// trailing dots (as Spring's old path matcher and Windows do), then
/// normalised. The gateway refuses a path when this reading, or one of its
/// [`variants`], lands on a guarded route that the path's own form is not on.
pub(crate) fn lenient(path: &str) -> String {
    let mut bytes = decode_all(path.as_bytes());
    if bytes.contains(&b'%') {
        bytes = decode_all(&bytes);
    }
    if let Some(nul) = bytes.iter().position(|b| *b == 0) {
        bytes.truncate(nul);
    }
    let text = String::from_utf8_lossy(&bytes);
    let mut out = String::with_capacity(text.len() + 1);
    for segment in text.split(['/', '\\']) {
        let segment = segment.split(';').next().unwrap_or_default();
        let segment = segment.trim_matches(|c: char| c.is_whitespace() || c.is_control());
        let segment = if segment.bytes().all(|b| b == b'.') {
            segment
        } else {
            segment.trim_end_matches('.')
        };
        out.push('/');
        out.push_str(segment);
    }
    normalize(&out).into_owned()
}

/// The other ways a server may read a [`lenient`] reading: letters folded to
/// ASCII as Java's `equalsIgnoreCase` and .NET's `OrdinalIgnoreCase` fold
/// them (`ſ` is `s`, `K` (Kelvin) is `k`, `ı` is `i`), and the last
/// segment without its suffix (Spring's suffix pattern matching routes
/// `/notify/stripe.json` to `/notify/stripe`). The reading itself first;
/// none twice.
pub(crate) fn variants(reading: String) -> Vec<String> {
    let folded = fold(&reading);
    let mut all = vec![reading];
    all.extend(folded);
    for at in 0..all.len() {
        if let Some(cut) = without_suffix(&all[at]).map(str::to_owned)
            && !all.contains(&cut)
        {
            all.push(cut);
        }
    }
    all
}

/// `path` with every character that folds to an ASCII letter in a
/// case-insensitive compare replaced by that letter; `None` when none does.
fn fold(path: &str) -> Option<String> {
    let ascii = |c: char| -> Option<char> {
        if c.is_ascii() {
            return None;
        }
        let mut upper = c.to_uppercase();
        let mut lower = c.to_lowercase();
        match (upper.next(), upper.next(), lower.next()) {
            (Some(u), None, _) if u.is_ascii() => Some(u.to_ascii_lowercase()),
            (_, _, Some(l)) if l.is_ascii() => Some(l),
            _ => None,
        }
    };
    if !path.chars().any(|c| ascii(c).is_some()) {
        return None;
    }
    Some(path.chars().map(|c| ascii(c).unwrap_or(c)).collect())
}

/// `path` without the suffix of its last segment (from its first `.` on,
/// a leading `.` kept), or `None` if it has none.
fn without_suffix(path: &str) -> Option<&str> {
    let last = path.rfind('/').map_or(0, |at| at + 1);
    let segment = &path[last..];
    let first = segment.chars().next()?.len_utf8();
    let dot = segment[first..].find('.')?;
    Some(&path[..last + first + dot])
}

/// Whether a server could read `path` (a strict normal form) as another
/// path than its own: it has an escape, a character that is not ASCII, or a
/// `.` in its last segment. Most paths have none, and skip [`lenient`].
pub(crate) fn has_other_readings(path: &str) -> bool {
    let last = path.rfind('/').map_or(0, |at| at + 1);
    path.bytes().any(|b| b == b'%' || !b.is_ascii()) || path[last..].contains('.')
}

/// Every `%XX` escape in `bytes` decoded; anything else (a `%` that is not
/// an escape included) kept as it is.
fn decode_all(bytes: &[u8]) -> Vec<u8> {
    percent_encoding::percent_decode(bytes).collect()
}

/// The value of a hex digit: for the readers of escapes that the
/// `percent-encoding` crate cannot be (it decodes, it does not tell a `%`
/// that starts no escape from one that does, nor where in the raw path a
/// decoded prefix ends): [`strict`]'s check and the route table's prefix
/// match.
pub(crate) fn hex(c: Option<&u8>) -> Option<u8> {
    match c? {
        c @ b'0'..=b'9' => Some(c - b'0'),
        c @ b'a'..=b'f' => Some(c - b'a' + 10),
        c @ b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// `path` with every `%XX` escape decoded, for matching: what an upstream
/// that decodes the path before routing (Spring, Django, Go, ASP.NET,
/// Rails) routes. Bytes that are not UTF-8 once decoded are replaced (the
/// gateway has refused such paths before). Borrowed when `path` has no
/// escape.
pub(crate) fn decoded(path: &str) -> Cow<'_, str> {
    percent_encoding::percent_decode_str(path).decode_utf8_lossy()
}

#[cfg(test)]
mod tests {
    use super::{
        decode_all, decoded, fold, has_other_readings, hex, lenient, strict, variants, Unsafe,
    };
    use std::borrow::Cow;

    /// The hand-written decoder `decode_all` was before it used the
    /// `percent-encoding` crate: the reference the crate's decoding is held
    /// to, byte for byte.
    fn reference(bytes: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] == b'%'
                && let (Some(h), Some(l)) = (hex(bytes.get(i + 1)), hex(bytes.get(i + 2)))
            {
                out.push(h * 16 + l);
                i += 3;
                continue;
            }
            out.push(bytes[i]);
            i += 1;
        }
        out
    }

    /// Paths are matched and refused on their decoded form: the decoded
    /// bytes of tricky escapes, as a table, and every string of up to five
    /// bytes from an alphabet of escape parts, against the reference; the
    /// text form replaces what is not UTF-8, once per bad sequence.
    #[test]
    fn path_decoding_is_byte_for_byte_the_reference() {
        let table: &[(&[u8], &[u8])] = &[
            (b"", b""),
            (b"%", b"%"),
            (b"/a%4", b"/a%4"),
            (b"/a%zz", b"/a%zz"),
            (b"%%41", b"%A"),
            (b"%41%", b"A%"),
            (b"%4%41", b"%4A"),
            (b"%2525", b"%25"),
            (b"%252F", b"%2F"),
            (b"+%2B", b"++"),
            (b"%2f%5C", b"/\\"),
            (b"%00%0A", b"\x00\n"),
            (b"%FF%fe", b"\xFF\xFE"),
            (b"%C3%A9", "\u{e9}".as_bytes()),
            (b"%C3", b"\xC3"),
            (b"%C3%28", b"\xC3("),
            (b"%\xC3\xA9", "%\u{e9}".as_bytes()),
            (b"/a%C\xC3\xA9%2F", "/a%C\u{e9}/".as_bytes()),
        ];
        for (raw, want) in table {
            let got = decode_all(raw);
            assert_eq!(got, *want, "{:?}", String::from_utf8_lossy(raw));
            assert_eq!(got, reference(raw), "{:?}", String::from_utf8_lossy(raw));
            if let Ok(path) = std::str::from_utf8(raw) {
                assert_eq!(decoded(path), String::from_utf8_lossy(want), "{path:?}");
            }
        }
        let alphabet = [b'%', b'2', b'f', b'F', b'z', b'0', b'/', b'+', 0xFF, 0xC3];
        let mut raw = Vec::new();
        let mut cases = 0;
        for len in 0..=5_u32 {
            for mut n in 0..alphabet.len().pow(len) {
                raw.clear();
                for _ in 0..len {
                    raw.push(alphabet[n % alphabet.len()]);
                    n /= alphabet.len();
                }
                let want = reference(&raw);
                assert_eq!(decode_all(&raw), want, "{raw:?}");
                let text = String::from_utf8_lossy(&raw);
                assert_eq!(
                    decoded(&text),
                    String::from_utf8_lossy(&reference(text.as_bytes())),
                    "{text:?}"
                );
                cases += 1;
            }
        }
        assert_eq!(cases, 111_111);
    }

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

    #[test]
    fn lenient_reads_path_parameters_and_escaped_separators_away() {
        for (raw, read) in [
            ("/notify/stripe;x", "/notify/stripe"),
            ("/notify;a=1/stripe;jsessionid=2/", "/notify/stripe"),
            ("/notify%2Fstripe", "/notify/stripe"),
            ("/notify%5cstripe", "/notify/stripe"),
            ("/notify\\stripe", "/notify/stripe"),
            ("/x/..;/notify/stripe", "/notify/stripe"),
            ("/a%", "/a%"),
            // An escape cut by a character of two bytes, then separators.
            ("/a%C\u{e9}%2F..%2Fnotify/stripe", "/notify/stripe"),
            ("/notify/stripe%00", "/notify/stripe"),
            ("/notify/stripe%00.php/x", "/notify/stripe"),
            ("/notify/stripe%09", "/notify/stripe"),
            ("/notify/stripe%20/", "/notify/stripe"),
            ("/notify/stripe.", "/notify/stripe"),
            ("/notify/pay%3Astripe", "/notify/pay:stripe"),
            ("/notify/%2573tripe", "/notify/stripe"),
            ("/notify/%252Fstripe", "/notify/stripe"),
            ("/a/%2E%2E%20/notify", "/notify"),
        ] {
            assert_eq!(lenient(raw), read, "{raw}");
        }
    }

    #[test]
    fn variants_fold_letters_and_drop_suffixes() {
        assert_eq!(variants("/notify/stripe".into()), ["/notify/stripe"]);
        assert_eq!(
            variants("/notify/stripe.json".into()),
            ["/notify/stripe.json", "/notify/stripe"]
        );
        assert_eq!(
            variants("/notify/\u{17f}tripe".into()),
            ["/notify/\u{17f}tripe", "/notify/stripe"]
        );
        assert_eq!(
            variants("/\u{212a}ey/\u{131}d.xml".into()),
            [
                "/\u{212a}ey/\u{131}d.xml",
                "/key/id.xml",
                "/\u{212a}ey/\u{131}d",
                "/key/id"
            ]
        );
        assert_eq!(variants("/.well-known".into()), ["/.well-known"]);
        assert_eq!(variants("/caf\u{e9}".into()), ["/caf\u{e9}"]);
        // Every character that folds to ASCII in a case-insensitive compare.
        let folding: String = (0x80..=0x10FFFF_u32)
            .filter_map(char::from_u32)
            .filter(|c| fold(&c.to_string()).is_some())
            .collect();
        assert_eq!(folding, "\u{130}\u{131}\u{17f}\u{212a}");
    }

    #[test]
    fn other_readings_and_the_decoded_form() {
        for path in ["/notify/stripe", "/a.b/c", "/"] {
            assert!(!has_other_readings(path), "{path}");
        }
        for path in ["/a%3A", "/a/b.json", "/\u{e9}"] {
            assert!(has_other_readings(path), "{path}");
        }
        assert_eq!(decoded("/hooks/pay%3Astripe"), "/hooks/pay:stripe");
        assert_eq!(decoded("/caf%C3%A9/%25"), "/caf\u{e9}/%");
        assert_eq!(decoded("/a%zz%4"), "/a%zz%4");
        assert!(matches!(decoded("/a/b"), Cow::Borrowed("/a/b")));
    }
}
