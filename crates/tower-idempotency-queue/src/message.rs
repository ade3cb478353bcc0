//! [`Message`]: what a queue entry carries, and its byte encoding.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Uri};
use tower_idempotency::Fingerprint;

/// What separates a key from the number of its copy: a notification with
/// another payload than the first of its key (from a sender nobody
/// verified) is queued beside it as `KEY~copyN`, so that a forged copy
/// cannot take the key's place.
const COPY: &str = "~copy";

/// The queue key of copy `n` of `key` (copy 0 is the key itself).
///
/// ```
/// use tower_idempotency_queue::copy_key;
/// assert_eq!(copy_key("idem:stripe:/n::evt_1", 0), "idem:stripe:/n::evt_1");
/// assert_eq!(copy_key("idem:stripe:/n::evt_1", 2), "idem:stripe:/n::evt_1~copy2");
/// ```
pub fn copy_key(key: &str, n: usize) -> String {
    match n {
        0 => key.to_owned(),
        n => format!("{key}{COPY}{n}"),
    }
}

/// The stored key a queue entry's key stands for: the key of a copy queued
/// beside it ([`copy_key`]), or the key itself.
///
/// ```
/// use tower_idempotency_queue::original_key;
/// assert_eq!(original_key("idem:stripe:/n::evt_1~copy2"), "idem:stripe:/n::evt_1");
/// assert_eq!(original_key("idem:stripe:/n::evt_1"), "idem:stripe:/n::evt_1");
/// ```
pub fn original_key(queued: &str) -> &str {
    match queued.rsplit_once(COPY) {
        Some((key, n)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => key,
        _ => queued,
    }
}

/// What separates a notification's key from the destination an entry of it
/// is for: a notification for several destinations is queued as one entry
/// per destination, `KEY~to:DESTINATION`.
const DESTINATION: &str = "~to:";

/// The queue key of the entry of notification `key` for `destination`: each
/// destination's entry is deduplicated, delivered, retried and
/// dead-lettered on its own.
///
/// ```
/// use tower_idempotency_queue::destination_key;
/// assert_eq!(
///     destination_key("idem:stripe:/n::evt_1", "ledger"),
///     "idem:stripe:/n::evt_1~to:ledger"
/// );
/// ```
pub fn destination_key(key: &str, destination: &str) -> String {
    format!("{key}{DESTINATION}{destination}")
}

/// One queued notification: its key, the request it came in as, an
/// optional order group, and the destination it is for.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Message {
    /// The scoped idempotency key: a second message with the same key is not
    /// queued again.
    pub key: String,
    /// The fingerprint of the message's meaning: a copy with another one is
    /// refused ([`Ingested::Mismatch`](super::Ingested::Mismatch)).
    pub fingerprint: Fingerprint,
    /// Messages with the same order group are delivered one at a time, in
    /// the order they were queued (several events of one transaction).
    /// `None`: no order with other messages.
    pub order: Option<String>,
    /// The destination this entry is for, when a notification is delivered
    /// to several ([`destination`](Self::destination)): the service that
    /// delivers it reads it to know where to. `None`: the one destination
    /// of its queue.
    pub destination: Option<String>,
    /// The request method. Defaults to `POST`.
    pub method: Method,
    /// The request target (path and query). Defaults to `/`.
    pub uri: Uri,
    /// The request headers.
    pub headers: HeaderMap,
    /// The body.
    pub body: Bytes,
    /// The MAC a [`Sealed`](crate::Sealed) queue wrote, when it was sealed.
    pub(crate) mac: Option<[u8; 32]>,
    /// When it was sealed (ms since the Unix epoch), covered by the MAC;
    /// `None` in an entry sealed by an earlier version.
    pub(crate) sealed_at: Option<u64>,
}

impl Message {
    /// A `POST /` message with no headers.
    pub fn new(key: impl Into<String>, fingerprint: Fingerprint, body: impl Into<Bytes>) -> Self {
        Self {
            key: key.into(),
            fingerprint,
            order: None,
            destination: None,
            method: Method::POST,
            uri: Uri::from_static("/"),
            headers: HeaderMap::new(),
            body: body.into(),
            mac: None,
            sealed_at: None,
        }
    }

    /// The message of a buffered request.
    pub fn from_request(
        key: impl Into<String>,
        fingerprint: Fingerprint,
        req: Request<Bytes>,
    ) -> Self {
        let (parts, body) = req.into_parts();
        Self {
            key: key.into(),
            fingerprint,
            order: None,
            destination: None,
            method: parts.method,
            uri: parts.uri,
            headers: parts.headers,
            body,
            mac: None,
            sealed_at: None,
        }
    }

    /// Sets the order group.
    pub fn order(mut self, group: impl Into<String>) -> Self {
        self.order = Some(group.into());
        self
    }

    /// The entry of this message for `destination`: its key scoped by the
    /// destination ([`destination_key`]), so that each destination's entry
    /// is deduplicated and delivered on its own. The destination is part of
    /// the entry's bytes (and of its MAC on a [`Sealed`](crate::Sealed)
    /// queue). [`Queue::ingest_each`](crate::Queue::ingest_each) queues one
    /// per destination.
    ///
    /// ```
    /// use tower_idempotency::Fingerprint;
    /// use tower_idempotency_queue::Message;
    ///
    /// let m = Message::new("evt_1", Fingerprint::of(b"paid"), "{}").destination("ledger");
    /// assert_eq!(m.key, "evt_1~to:ledger");
    /// assert_eq!(m.destination.as_deref(), Some("ledger"));
    /// assert_eq!(m.notification_key(), "evt_1");
    /// ```
    pub fn destination(mut self, destination: impl Into<String>) -> Self {
        let destination = destination.into();
        self.key = destination_key(&self.key, &destination);
        self.destination = Some(destination);
        self
    }

    /// The key of the notification this entry delivers: its queue key
    /// without the copy number ([`original_key`]) and without its
    /// destination. The same for every destination of one notification.
    pub fn notification_key(&self) -> &str {
        let key = original_key(&self.key);
        self.destination
            .as_deref()
            .and_then(|d| key.strip_suffix(d))
            .and_then(|k| k.strip_suffix(DESTINATION))
            .unwrap_or(key)
    }

    /// The request again, to deliver it.
    pub fn to_request(&self) -> Request<Bytes> {
        let mut req = Request::new(self.body.clone());
        *req.method_mut() = self.method.clone();
        *req.uri_mut() = self.uri.clone();
        *req.headers_mut() = self.headers.clone();
        req
    }

    /// What a dead letter shows of an entry whose bytes could not be read
    /// (written by another version, or by hand): its raw bytes as the body,
    /// under a key naming the entry.
    pub(crate) fn undecodable(entry: &str, raw: &[u8]) -> Self {
        Self::new(
            format!("undecodable-entry:{entry}"),
            Fingerprint::of(raw),
            Bytes::copy_from_slice(raw),
        )
    }

    /// The encoded form: unsealed, [`encode_plain`](Self::encode_plain)'s;
    /// sealed, version 3, the MAC, when it was sealed (ms, little-endian
    /// u64), then those bytes (version 2, written by earlier versions: the
    /// MAC, then those bytes).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let Some(mac) = &self.mac else {
            return self.encode_plain();
        };
        let plain = self.encode_plain();
        let mut out = Vec::with_capacity(1 + mac.len() + 8 + plain.len());
        match self.sealed_at {
            Some(at) => {
                out.push(3);
                out.extend_from_slice(mac);
                out.extend_from_slice(&at.to_le_bytes());
            }
            None => {
                out.push(2);
                out.extend_from_slice(mac);
            }
        }
        out.extend_from_slice(&plain);
        out
    }

    /// The encoded form without a MAC (what the MAC covers): version 1,
    /// key, fingerprint, order, method, uri, headers, body; lengths as
    /// little-endian u32. An entry for a destination is version 4, its
    /// destination after the order.
    pub(crate) fn encode_plain(&self) -> Vec<u8> {
        let uri = self.uri.to_string();
        let mut out = BytesMut::with_capacity(64 + self.key.len() + uri.len() + self.body.len());
        out.put_u8(match self.destination {
            None => 1,
            Some(_) => 4,
        });
        put(&mut out, self.key.as_bytes());
        out.put_slice(&self.fingerprint.to_bytes());
        match &self.order {
            Some(o) => {
                out.put_u8(1);
                put(&mut out, o.as_bytes());
            }
            None => out.put_u8(0),
        }
        if let Some(d) = &self.destination {
            put(&mut out, d.as_bytes());
        }
        put(&mut out, self.method.as_str().as_bytes());
        put(&mut out, uri.as_bytes());
        out.put_u32_le(self.headers.len() as u32);
        for (name, value) in &self.headers {
            put(&mut out, name.as_str().as_bytes());
            put(&mut out, value.as_bytes());
        }
        put(&mut out, &self.body);
        out.to_vec()
    }

    /// Reads [`encode`](Self::encode)'s bytes; `None` if they are not that.
    pub(crate) fn decode(b: &[u8]) -> Option<Self> {
        if b.first() == Some(&2) {
            let mac: [u8; 32] = b.get(1..33)?.try_into().ok()?;
            let mut message = Self::decode_plain(&b[33..])?;
            message.mac = Some(mac);
            return Some(message);
        }
        if b.first() == Some(&3) {
            let mac: [u8; 32] = b.get(1..33)?.try_into().ok()?;
            let at = u64::from_le_bytes(b.get(33..41)?.try_into().ok()?);
            let mut message = Self::decode_plain(&b[41..])?;
            message.mac = Some(mac);
            message.sealed_at = Some(at);
            return Some(message);
        }
        Self::decode_plain(b)
    }

    /// Reads [`encode_plain`](Self::encode_plain)'s bytes.
    fn decode_plain(mut b: &[u8]) -> Option<Self> {
        let version = take_u8(&mut b)?;
        if version != 1 && version != 4 {
            return None;
        }
        let key = String::from_utf8(take(&mut b)?.to_vec()).ok()?;
        let fp: [u8; 16] = b.get(..16)?.try_into().ok()?;
        b.advance(16);
        let order = match take_u8(&mut b)? {
            0 => None,
            _ => Some(String::from_utf8(take(&mut b)?.to_vec()).ok()?),
        };
        let destination = match version {
            4 => Some(String::from_utf8(take(&mut b)?.to_vec()).ok()?),
            _ => None,
        };
        let method = Method::from_bytes(take(&mut b)?).ok()?;
        let uri = Uri::try_from(take(&mut b)?).ok()?;
        let count = take_u32(&mut b)?;
        let mut headers = HeaderMap::with_capacity(count.min(256) as usize);
        for _ in 0..count {
            let name = HeaderName::from_bytes(take(&mut b)?).ok()?;
            let value = HeaderValue::from_bytes(take(&mut b)?).ok()?;
            headers.append(name, value);
        }
        let body = Bytes::copy_from_slice(take(&mut b)?);
        Some(Self {
            key,
            fingerprint: Fingerprint::from_bytes(fp),
            order,
            destination,
            method,
            uri,
            headers,
            body,
            mac: None,
            sealed_at: None,
        })
    }
}

fn put(out: &mut BytesMut, bytes: &[u8]) {
    out.put_u32_le(bytes.len() as u32);
    out.put_slice(bytes);
}

fn take_u8(b: &mut &[u8]) -> Option<u8> {
    let v = *b.first()?;
    b.advance(1);
    Some(v)
}

fn take_u32(b: &mut &[u8]) -> Option<u32> {
    let v = u32::from_le_bytes(b.get(..4)?.try_into().ok()?);
    b.advance(4);
    Some(v)
}

fn take<'a>(b: &mut &'a [u8]) -> Option<&'a [u8]> {
    let len = take_u32(b)? as usize;
    let v = b.get(..len)?;
    *b = &b[len..];
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let mut m = Message::new("k", Fingerprint::of(b"x"), "body").order("tx-1");
        m.uri = Uri::from_static("/notify/wechat?a=1");
        m.headers
            .append("wechatpay-serial", HeaderValue::from_static("5157"));
        m.headers.append("x-twice", HeaderValue::from_static("1"));
        m.headers.append("x-twice", HeaderValue::from_static("2"));
        let back = Message::decode(&m.encode()).unwrap();
        assert_eq!(back.key, "k");
        assert_eq!(back.fingerprint, m.fingerprint);
        assert_eq!(back.order.as_deref(), Some("tx-1"));
        assert_eq!(back.uri, m.uri);
        assert_eq!(back.headers, m.headers);
        assert_eq!(back.body, m.body);
        let bytes = m.encode();
        for cut in 0..bytes.len() {
            assert!(Message::decode(&bytes[..cut]).is_none(), "cut at {cut}");
        }
    }

    #[test]
    fn a_destination_round_trips_and_leaves_other_entries_as_they_were() {
        let plain = Message::new("k", Fingerprint::of(b"x"), "body").order("k");
        let bytes = plain.encode();
        // An entry for no destination is written as before: version 1.
        assert_eq!(bytes[0], 1);
        assert!(Message::decode(&bytes).unwrap().destination.is_none());

        let m = plain.clone().destination("ledger");
        let bytes = m.encode();
        assert_eq!(bytes[0], 4);
        let back = Message::decode(&bytes).unwrap();
        assert_eq!(back.destination.as_deref(), Some("ledger"));
        assert_eq!(back.key, "k~to:ledger");
        assert_eq!(back.order.as_deref(), Some("k"));
        assert_eq!(back.body, m.body);
        for cut in 0..bytes.len() {
            assert!(Message::decode(&bytes[..cut]).is_none(), "cut at {cut}");
        }
    }

    #[test]
    fn the_notification_key_of_an_entry() {
        let fp = Fingerprint::of(b"x");
        let m = Message::new("idem:s:/n::evt", fp, "").destination("orders");
        assert_eq!(m.notification_key(), "idem:s:/n::evt");
        let mut copy = m.clone();
        copy.key = copy_key(&m.key, 2);
        assert_eq!(copy.notification_key(), "idem:s:/n::evt");
        assert_eq!(original_key(&copy.key), "idem:s:/n::evt~to:orders");
        let plain = Message::new(copy_key("evt", 1), fp, "");
        assert_eq!(plain.notification_key(), "evt");
        // A key that merely ends like a destination's, for none, is its own.
        let odd = Message::new("evt~to:orders", fp, "");
        assert_eq!(odd.notification_key(), "evt~to:orders");
    }
}
