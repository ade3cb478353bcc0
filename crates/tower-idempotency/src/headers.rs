//! Which headers are hop-by-hop (RFC 9110 section 7.6.1): never stored
//! with a record nor replayed, and never passed on by a proxy. Written once
//! for the layers and for a proxy in front of them, so both drop the same.

use http::header::{self, HeaderMap, HeaderName};

/// Whether the message is gRPC (or gRPC-Web): its `Content-Type` starts
/// with `application/grpc`.
pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// Whether `name` is one of the fixed hop-by-hop headers: `Connection`,
/// `Keep-Alive`, `Proxy-Authenticate`, `Proxy-Authorization`, `TE`,
/// `Transfer-Encoding`, `Upgrade`. Headers that `Connection` names are
/// hop-by-hop too: see [`connection_named`].
pub fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        *name,
        header::CONNECTION
            | header::PROXY_AUTHENTICATE
            | header::PROXY_AUTHORIZATION
            | header::TE
            | header::TRANSFER_ENCODING
            | header::UPGRADE
    ) || name.as_str() == "keep-alive"
}

/// The header names that the `Connection` header lists (lower case, as
/// `HeaderName` spells them) besides the fixed hop-by-hop ones, which
/// [`is_hop_by_hop`] names already (`Connection: keep-alive`, on nearly
/// every HTTP/1.1 answer, would otherwise cost a parse and an allocation);
/// unparsable names are skipped.
pub fn connection_named(headers: &HeaderMap) -> Vec<HeaderName> {
    const FIXED: [&str; 7] = [
        "keep-alive",
        "connection",
        "te",
        "transfer-encoding",
        "upgrade",
        "proxy-authenticate",
        "proxy-authorization",
    ];
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|name| !FIXED.iter().any(|f| name.eq_ignore_ascii_case(f)))
        .filter_map(|name| HeaderName::from_bytes(name.as_bytes()).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_and_hop_by_hop() {
        let mut h = HeaderMap::new();
        assert!(!is_grpc(&h));
        h.insert(
            header::CONTENT_TYPE,
            "application/grpc+proto".parse().unwrap(),
        );
        assert!(is_grpc(&h));
        h.insert(
            header::CONNECTION,
            "close, X-Custom , Keep-Alive, upgrade".parse().unwrap(),
        );
        assert_eq!(
            connection_named(&h),
            [
                HeaderName::from_static("close"),
                HeaderName::from_static("x-custom")
            ]
        );
        assert!(is_hop_by_hop(&HeaderName::from_static("keep-alive")));
        assert!(!is_hop_by_hop(&header::TRAILER));
    }
}
