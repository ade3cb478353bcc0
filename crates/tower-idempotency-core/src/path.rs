//! One spelling per request path, so that `/orders`, `/orders/`, `//orders`,
//! `/shop/../orders` and `/%6Frders` scope and fingerprint alike.

use std::borrow::Cow;

/// The normal form of a path (RFC 3986 section 6.2.2): percent-encoded
/// unreserved characters decoded, other escapes upper-cased, dot segments
/// resolved, empty segments (duplicate and trailing slashes) dropped.
/// Already-normal paths are borrowed.
pub fn normalize(path: &str) -> Cow<'_, str> {
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
///
/// Hand-written: the `percent-encoding` crate decodes every escape, and has
/// no way to decode some and re-spell the others.
fn decode_unreserved(segment: &str) -> String {
    let bytes = segment.as_bytes();
    let mut out = String::with_capacity(segment.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2]))
        {
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
}
