//! Header rewriting between the client and the upstream.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use std::net::SocketAddr;

use tower_idempotency::__private::{connection_named, is_hop_by_hop};

/// How the client reached the gateway, for `x-forwarded-*`.
///
/// The program that accepts connections puts it in each request's
/// extensions; without it, [`Forward`](super::Forward) adds no
/// `x-forwarded-for` and says `x-forwarded-proto: http`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClientConn {
    /// The client's address.
    pub addr: SocketAddr,
    /// Whether the client connected over TLS.
    pub tls: bool,
}

impl ClientConn {
    /// A client at `addr`, connected over TLS or not.
    pub const fn new(addr: SocketAddr, tls: bool) -> Self {
        Self { addr, tls }
    }
}

// The names parsed once, at compile time: a `&str` name is parsed and
// checked again at every `remove` and `insert`. (A `HeaderName` holds
// `Bytes`, whose atomic pointer clippy takes for interior mutability; a
// static name's is never written.)
#[allow(clippy::declare_interior_mutable_const)]
const FENCING_TOKEN_NAME: HeaderName = HeaderName::from_static(FENCING_TOKEN);
#[allow(clippy::declare_interior_mutable_const)]
const KEY_NAME: HeaderName = HeaderName::from_static(KEY);
#[allow(clippy::declare_interior_mutable_const)]
const CLIENT_KEY_NAME: HeaderName = HeaderName::from_static(CLIENT_KEY);

/// The standard headers a request loses on its way upstream: the
/// hop-by-hop ones, `Trailer`, `Expect` (the gateway answers it) and
/// `Content-Length` (the body's own length, or chunks, frames it upstream).
const STRIPPED: [HeaderName; 9] = [
    header::CONNECTION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::EXPECT,
    header::CONTENT_LENGTH,
];

/// Prepares a request's headers for the upstream, in one pass over their
/// names (each removal hashes its name: removing what is not there costs
/// as much as what is):
///
/// - the hop-by-hop headers go: `Connection` and the headers it names,
///   `Keep-Alive`, `Proxy-*`, `TE`, `Trailer`, `Transfer-Encoding`,
///   `Upgrade`; a client that accepts trailers (`TE: trailers`) still says
///   so, as `TE: trailers` alone (an upstream may send trailers only to a
///   client that accepts them);
/// - `Expect` and `Content-Length` go;
/// - only the gateway says what `idempotency-fencing-token`,
///   `idempotency-key` and `idempotency-client-key` are: a client's own go,
///   except its `Idempotency-Key`, which goes upstream as
///   `idempotency-client-key` (see [`set_idempotency`]);
/// - the client's spellings with `_` for `-` of a header the gateway sets
///   or strips go (see [`is_underscore_spelling`]).
pub(crate) fn strip_request(headers: &mut HeaderMap) {
    let mut standard = 0u16;
    let mut other = Vec::new();
    let mut client_key = false;
    for name in headers.keys() {
        if let Some(i) = STRIPPED.iter().position(|s| s == name) {
            standard |= 1 << i;
        } else if *name == KEY_NAME {
            client_key = true;
        } else if *name == FENCING_TOKEN_NAME
            || *name == CLIENT_KEY_NAME
            || name.as_str() == "keep-alive"
            || name.as_str().starts_with("proxy-")
            || is_underscore_spelling(name.as_str())
        {
            other.push(name.clone());
        }
    }
    // STRIPPED[0] is `Connection`, STRIPPED[1] `TE`.
    let trailers = standard & 0b10 != 0 && accepts_trailers(headers);
    if standard & 0b1 != 0 {
        other.extend(connection_named(headers));
    }
    for (i, name) in STRIPPED.iter().enumerate() {
        if standard & (1 << i) != 0 {
            headers.remove(name);
        }
    }
    for name in other {
        headers.remove(name);
    }
    if client_key && let Some(client) = headers.remove(KEY_NAME) {
        headers.insert(CLIENT_KEY_NAME, client);
    }
    if trailers {
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
    }
}

/// Removes hop-by-hop headers from the upstream's answer: `Connection` and
/// the headers it names, `Keep-Alive`, `Proxy-*`, `TE`,
/// `Transfer-Encoding`, `Upgrade`. `Trailer` is kept: it announces the
/// trailers that follow the body, and hyper sends only announced ones.
pub(crate) fn strip_response_hop_by_hop(headers: &mut HeaderMap) {
    // One pass over the names; only what is there is removed (each removal
    // hashes its name).
    let mut dropped = Vec::new();
    let mut connection = false;
    for name in headers.keys() {
        if *name == header::CONNECTION {
            connection = true;
        } else if is_hop_by_hop(name) || name.as_str().starts_with("proxy-") {
            dropped.push(name.clone());
        }
    }
    if connection {
        dropped.extend(
            connection_named(headers)
                .into_iter()
                .filter(|n| *n != header::TRAILER),
        );
        dropped.push(header::CONNECTION);
    }
    for name in dropped {
        headers.remove(name);
    }
}

/// Whether a `TE` header lists `trailers`.
fn accepts_trailers(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::TE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| {
            t.split(';')
                .next()
                .is_some_and(|t| t.trim().eq_ignore_ascii_case("trailers"))
        })
}

/// Appends the client's IP to `x-forwarded-for` (one header,
/// comma-separated) and sets `x-forwarded-proto` and `x-forwarded-host`
/// (the client's `Host`, or the HTTP/2 authority).
pub(crate) fn set_forwarded(headers: &mut HeaderMap, conn: Option<ClientConn>, host: Option<&str>) {
    // The names parsed once, at compile time (see `set_idempotency`).
    #![allow(clippy::declare_interior_mutable_const)]
    const FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
    const PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
    const HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
    if let Some(conn) = conn {
        use std::fmt::Write as _;
        let mut list = String::new();
        for v in headers.get_all(&FOR).iter().filter_map(|v| v.to_str().ok()) {
            list.push_str(v);
            list.push_str(", ");
        }
        // An address is at most 45 bytes (`IpAddr`'s longest form).
        list.reserve(45);
        let _ = write!(list, "{}", conn.addr.ip());
        if let Ok(v) = HeaderValue::try_from(list) {
            headers.insert(FOR, v);
        }
    }
    let proto = if conn.is_some_and(|c| c.tls) {
        "https"
    } else {
        "http"
    };
    headers.insert(PROTO, HeaderValue::from_static(proto));
    let host = headers
        .get(header::HOST)
        .cloned()
        .or_else(|| host.and_then(|h| HeaderValue::from_str(h).ok()));
    if let Some(host) = host {
        headers.insert(HOST, host);
    }
}

/// The header that carries the claim's fencing token upstream.
pub(crate) const FENCING_TOKEN: &str = "idempotency-fencing-token";

/// The header that carries the stored key's hash upstream.
pub(crate) const KEY: &str = "idempotency-key";

/// The header that carries the client's own `Idempotency-Key` upstream.
pub(crate) const CLIENT_KEY: &str = "idempotency-client-key";

/// Sets what the upstream needs to keep its own unique index and refuse a
/// stale owner's write: `idempotency-fencing-token` with the claim's token
/// and `idempotency-key` with the SHA-256 of the stored key in hex (the key
/// scoped by route and principal: two tenants' `order-1001` are two
/// hashes). The client's own were dropped by [`strip_request`] (its
/// `Idempotency-Key` goes upstream as `idempotency-client-key`, claim or
/// not). `shared`: the key whose hash is `idempotency-key` when it is not
/// the claim's (the notification's key, for a delivery to one of several
/// destinations, each claimed under a key of its own).
pub(crate) fn set_idempotency(
    headers: &mut HeaderMap,
    claim: Option<&tower_idempotency::store::ActiveClaim>,
    shared: Option<&str>,
) {
    let Some(claim) = claim else {
        return;
    };
    headers.insert(FENCING_TOKEN_NAME, HeaderValue::from(claim.fence()));
    use sha2::{Digest, Sha256};
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let digest = Sha256::digest(shared.unwrap_or(claim.key()).as_bytes());
    // By table: `write!("{b:02x}")` per byte cost about 6,000 instructions
    // per request (callgrind).
    let mut hex = [0u8; 64];
    for (i, b) in digest.iter().enumerate() {
        hex[2 * i] = DIGITS[usize::from(b >> 4)];
        hex[2 * i + 1] = DIGITS[usize::from(b & 15)];
    }
    if let Ok(v) = HeaderValue::from_bytes(&hex) {
        headers.insert(KEY_NAME, v);
    }
}

/// The headers the gateway sets or strips on the way upstream (and its own
/// answer headers): a client's spelling of one of them with `_` for `-` is
/// dropped by [`strip_request`] (see [`is_underscore_spelling`]).
const GATEWAY_HEADERS: &[&str] = &[
    FENCING_TOKEN,
    KEY,
    CLIENT_KEY,
    "x-forwarded-for",
    "x-forwarded-proto",
    "x-forwarded-host",
    "x-request-id",
    "idempotent-replayed",
    "idempotent-body-omitted",
    "keep-alive",
    "transfer-encoding",
    "content-length",
];

/// Whether a client's header `name` names one the gateway sets or strips
/// once `_` is read as `-` (`Idempotency_Fencing_Token`, `idempotency_key`,
/// `X_Forwarded_For`, `Transfer_Encoding`, `Proxy_Authorization`, ...): CGI
/// and WSGI servers map both spellings to one variable
/// (`HTTP_IDEMPOTENCY_FENCING_TOKEN`), so the client's could stand beside,
/// or for, the gateway's. nginx drops underscore headers by default for the
/// same reason. Other names with `_` pass.
fn is_underscore_spelling(name: &str) -> bool {
    if !name.contains('_') {
        return false;
    }
    let dashed = name.replace('_', "-");
    GATEWAY_HEADERS.contains(&dashed.as_str()) || dashed.starts_with("proxy-")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tower_idempotency::store::{ActiveClaim, OwnerToken};
    use tower_idempotency::Fingerprint;

    fn claim(fence: u64) -> ActiveClaim {
        ActiveClaim::new(
            "idem:wechatpay-v3:/notify:k".into(),
            OwnerToken::new(),
            Fingerprint::of(b""),
            Duration::from_secs(1),
        )
        .with_fence(fence)
    }

    #[test]
    fn the_claim_is_sent_upstream() {
        let mut h = HeaderMap::new();
        h.insert(FENCING_TOKEN, HeaderValue::from_static("999999999999"));
        strip_request(&mut h);
        set_idempotency(&mut h, Some(&claim(42)), None);
        assert_eq!(h[FENCING_TOKEN], "42");
        let key = h[KEY].to_str().unwrap().to_owned();
        assert_eq!(key.len(), 64);
        assert!(key
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        // The client's own key goes upstream under a name of its own; the
        // stored key's hash is `idempotency-key` whatever the client sent.
        let mut h = HeaderMap::new();
        h.insert(KEY, HeaderValue::from_static("client-1"));
        h.insert(CLIENT_KEY, HeaderValue::from_static("forged"));
        strip_request(&mut h);
        set_idempotency(&mut h, Some(&claim(7)), None);
        assert_eq!(h[KEY], key.as_str());
        assert_eq!(h.get_all(KEY).iter().count(), 1);
        assert_eq!(h[CLIENT_KEY], "client-1");
        assert_eq!(h.get_all(CLIENT_KEY).iter().count(), 1);
        assert_eq!(h[FENCING_TOKEN], "7");
        // Without a claim, a client cannot choose a token nor the key.
        let mut h = HeaderMap::new();
        h.insert(FENCING_TOKEN, HeaderValue::from_static("5"));
        h.insert(KEY, HeaderValue::from_static("client-2"));
        strip_request(&mut h);
        set_idempotency(&mut h, None, None);
        assert!(!h.contains_key(FENCING_TOKEN));
        assert!(!h.contains_key(KEY));
        assert_eq!(h[CLIENT_KEY], "client-2");
    }

    #[test]
    fn underscore_spellings_of_the_gateways_headers_are_dropped() {
        let mut h = HeaderMap::new();
        for name in [
            "idempotency_fencing_token",
            "idempotency_key",
            "idempotency_client_key",
            "idempotent_replayed",
            "x_forwarded_for",
            "x-forwarded_proto",
            "transfer_encoding",
            "proxy_authorization",
        ] {
            h.insert(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_static("1"),
            );
        }
        h.insert("x_tenant_id", HeaderValue::from_static("t"));
        strip_request(&mut h);
        let left: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        assert_eq!(left, ["x_tenant_id"]);
    }

    #[test]
    fn a_request_loses_its_hop_by_hop_headers_in_one_pass() {
        let mut h = HeaderMap::new();
        for (name, value) in [
            ("connection", "keep-alive, x-hop, trailer"),
            ("keep-alive", "timeout=5"),
            ("x-hop", "1"),
            ("te", "gzip, trailers;q=1"),
            ("trailer", "x-checksum"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "h2c"),
            ("proxy-authorization", "Basic eA=="),
            ("proxy-foo", "1"),
            ("expect", "100-continue"),
            ("content-length", "12"),
            ("content-type", "application/json"),
            ("x-kept", "1"),
        ] {
            h.append(
                HeaderName::from_static(name),
                HeaderValue::from_static(value),
            );
        }
        h.append("x-kept", HeaderValue::from_static("2"));
        strip_request(&mut h);
        let mut left: Vec<(&str, &str)> = h
            .iter()
            .map(|(k, v)| (k.as_str(), v.to_str().unwrap()))
            .collect();
        left.sort_unstable();
        assert_eq!(
            left,
            [
                ("content-type", "application/json"),
                ("te", "trailers"),
                ("x-kept", "1"),
                ("x-kept", "2"),
            ]
        );
        // Nothing to strip: nothing changes.
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/xml"));
        h.insert(header::HOST, HeaderValue::from_static("a"));
        let before = h.clone();
        strip_request(&mut h);
        assert_eq!(h, before);
        // A `TE` without `trailers` goes whole.
        let mut h = HeaderMap::new();
        h.insert(header::TE, HeaderValue::from_static("gzip"));
        strip_request(&mut h);
        assert!(h.is_empty());
    }
}
