//! One record codec for every store: a completed record as one buffer
//! (status, headers, trailers and body), decoded on replay. A store that
//! keeps records as bytes (Redis, SQL, a store of your own) writes
//! [`encode`]'s bytes and reads them back with [`decode`].
//!
//! ```text
//! version u8 | fingerprint [16] | status u16 | flags u8 (1 = body omitted,
//! 2 = has trailers) | headers | trailers (if flag 2) | body: u32 len, bytes
//! headers = count u32, then per entry: name u16 len, name, value u32 len, value
//! ```
//!
//! All integers big-endian. Decoding shares the buffer: the body and the
//! header values of a decoded record point into it, nothing is copied.

use super::{CompletedRecord, StoreError, StoreErrorKind, StoredResponse};
use crate::Fingerprint;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use std::fmt;

/// First byte of a completed record (its format version).
pub(crate) const VERSION: u8 = 0x01;

const FLAG_BODY_OMITTED: u8 = 1;
const FLAG_TRAILERS: u8 = 2;

/// Encodes a completed record into one binary string (the Redis store's
/// value; the memory store encodes in place).
pub fn encode(record: &CompletedRecord) -> Vec<u8> {
    let mut out = Vec::with_capacity(encoded_len(record));
    encode_into(&mut out, record);
    out
}

/// The exact length [`encode`] writes.
pub(crate) fn encoded_len(record: &CompletedRecord) -> usize {
    let res = &record.response;
    let headers_len = |h: &HeaderMap| -> usize {
        4 + h
            .iter()
            .map(|(k, v)| 6 + k.as_str().len() + v.len())
            .sum::<usize>()
    };
    24 + headers_len(&res.headers) + res.trailers.as_ref().map_or(0, headers_len) + res.body.len()
}

/// Appends the encoding of `record` to `out`.
pub(crate) fn encode_into(out: &mut Vec<u8>, record: &CompletedRecord) {
    let res = &record.response;
    out.push(VERSION);
    out.extend_from_slice(&record.fingerprint.to_bytes());
    out.extend_from_slice(&res.status.as_u16().to_be_bytes());
    let mut flags = 0;
    if res.body_omitted {
        flags |= FLAG_BODY_OMITTED;
    }
    if res.trailers.is_some() {
        flags |= FLAG_TRAILERS;
    }
    out.push(flags);
    encode_headers(out, &res.headers);
    if let Some(trailers) = &res.trailers {
        encode_headers(out, trailers);
    }
    put_len32(out, res.body.len());
    out.extend_from_slice(&res.body);
}

fn put_len32(out: &mut Vec<u8>, len: usize) {
    // Bodies above 4 GiB are never cached (the dedup layer's limit is far
    // below); saturate rather than wrap so that decoding fails loudly.
    let len = u32::try_from(len).unwrap_or(u32::MAX);
    out.extend_from_slice(&len.to_be_bytes());
}

fn encode_headers(out: &mut Vec<u8>, headers: &HeaderMap) {
    put_len32(out, headers.len());
    for (name, value) in headers {
        let name = name.as_str().as_bytes();
        // Header names are short tokens; http rejects anything near 64 KiB.
        let len = u16::try_from(name.len()).unwrap_or(u16::MAX);
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(&name[..usize::from(len)]);
        put_len32(out, value.len());
        out.extend_from_slice(value.as_bytes());
    }
}

/// Reads a record written by [`encode`]; the body and header values share
/// `buf`.
pub fn decode(buf: &Bytes) -> Result<CompletedRecord, StoreError> {
    let bytes: &[u8] = buf;
    let mut r = Reader { buf, bytes, pos: 0 };
    let version = r.u8()?;
    if version != VERSION {
        return Err(corrupt(format_args!(
            "unknown record version {version:#04x} (written by a newer release, or not ours)"
        )));
    }
    let fingerprint = Fingerprint::from_bytes(r.array()?);
    let status = StatusCode::from_u16(r.u16()?).map_err(corrupt)?;
    let flags = r.u8()?;
    if flags & !(FLAG_BODY_OMITTED | FLAG_TRAILERS) != 0 {
        return Err(corrupt(format_args!("unknown flags {flags:#04x}")));
    }
    let headers = r.headers()?;
    let trailers = if flags & FLAG_TRAILERS != 0 {
        Some(r.headers()?)
    } else {
        None
    };
    let body_len = r.u32()?;
    let body = r.shared(body_len)?;
    if r.pos != bytes.len() {
        return Err(corrupt(format_args!(
            "{} trailing bytes",
            bytes.len() - r.pos
        )));
    }
    Ok(CompletedRecord {
        fingerprint,
        response: StoredResponse {
            status,
            headers,
            body,
            trailers,
            body_omitted: flags & FLAG_BODY_OMITTED != 0,
        },
    })
}

struct Reader<'a> {
    buf: &'a Bytes,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], StoreError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len())
            .ok_or_else(|| corrupt(format_args!("truncated at byte {}", self.pos)))?;
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    /// The next `n` bytes, sharing the buffer.
    fn shared(&mut self, n: usize) -> Result<Bytes, StoreError> {
        let start = self.pos;
        self.take(n)?;
        Ok(self.buf.slice(start..self.pos))
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], StoreError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, StoreError> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16, StoreError> {
        Ok(u16::from_be_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<usize, StoreError> {
        // u32 always fits in usize on the 32- and 64-bit targets we build for.
        Ok(u32::from_be_bytes(self.array()?) as usize)
    }

    fn headers(&mut self) -> Result<HeaderMap, StoreError> {
        let count = self.u32()?;
        // Each entry takes at least 6 bytes: refuse absurd counts before
        // allocating for them.
        if count > (self.bytes.len() - self.pos) / 6 {
            return Err(corrupt(format_args!("header count {count} too large")));
        }
        let mut headers = HeaderMap::with_capacity(count);
        for _ in 0..count {
            let name_len = usize::from(self.u16()?);
            let name = HeaderName::from_bytes(self.take(name_len)?).map_err(corrupt)?;
            let value_len = self.u32()?;
            let value = HeaderValue::from_maybe_shared(self.shared(value_len)?).map_err(corrupt)?;
            headers.append(name, value);
        }
        Ok(headers)
    }
}

fn corrupt(what: impl fmt::Display) -> StoreError {
    StoreError::new(
        StoreErrorKind::Corrupt,
        format!("unreadable idempotency record: {what}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(trailers: bool, omitted: bool) -> CompletedRecord {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.append("set-cookie", HeaderValue::from_static("a=1"));
        headers.append("set-cookie", HeaderValue::from_static("b=2"));
        headers.insert("x-bin", HeaderValue::from_bytes(b"\xff\xfe ok").unwrap());
        let trailers = trailers.then(|| {
            let mut t = HeaderMap::new();
            t.insert("grpc-status", HeaderValue::from_static("0"));
            t.insert("grpc-message", HeaderValue::from_static(""));
            t
        });
        CompletedRecord {
            fingerprint: Fingerprint::of(b"order 42"),
            response: StoredResponse {
                status: StatusCode::CREATED,
                headers,
                body: if omitted {
                    Bytes::new()
                } else {
                    Bytes::from_static(
                        "{\"code\":\"SUCCESS\",\"message\":\"成功\"}\0\u{1}".as_bytes(),
                    )
                },
                trailers,
                body_omitted: omitted,
            },
        }
    }

    fn assert_same(a: &CompletedRecord, b: &CompletedRecord) {
        assert_eq!(a.fingerprint, b.fingerprint);
        assert_eq!(a.response.status, b.response.status);
        assert_eq!(a.response.headers, b.response.headers);
        assert_eq!(a.response.body, b.response.body);
        assert_eq!(a.response.trailers, b.response.trailers);
        assert_eq!(a.response.body_omitted, b.response.body_omitted);
    }

    #[test]
    fn round_trips() {
        for (trailers, omitted) in [(false, false), (true, false), (false, true), (true, true)] {
            let rec = record(trailers, omitted);
            let bytes = encode(&rec);
            assert_eq!(bytes[0], VERSION);
            assert_same(&decode(&Bytes::from(bytes.clone())).unwrap(), &rec);
        }
    }

    #[test]
    fn round_trips_empty_trailers_and_headers() {
        let rec = CompletedRecord {
            fingerprint: Fingerprint::from_bytes([7; 16]),
            response: StoredResponse {
                status: StatusCode::OK,
                headers: HeaderMap::new(),
                body: Bytes::new(),
                trailers: Some(HeaderMap::new()),
                body_omitted: false,
            },
        };
        let bytes = encode(&rec);
        assert_eq!(bytes.len(), 1 + 16 + 2 + 1 + 4 + 4 + 4);
        assert_same(&decode(&Bytes::from(bytes.clone())).unwrap(), &rec);
    }

    #[test]
    fn every_truncation_is_corrupt() {
        let bytes = encode(&record(true, false));
        for len in 0..bytes.len() {
            let err = decode(&Bytes::copy_from_slice(&bytes[..len])).unwrap_err();
            assert_eq!(err.kind(), StoreErrorKind::Corrupt, "len {len}");
        }
    }

    #[test]
    fn trailing_bytes_are_corrupt() {
        let mut bytes = encode(&record(false, false));
        bytes.push(0);
        assert_eq!(
            decode(&Bytes::from(bytes.clone())).unwrap_err().kind(),
            StoreErrorKind::Corrupt
        );
    }

    #[test]
    fn bad_fields_are_corrupt() {
        let good = encode(&record(false, false));
        // Unknown version.
        let mut bytes = good.clone();
        bytes[0] = 9;
        assert_eq!(
            decode(&Bytes::from(bytes.clone())).unwrap_err().kind(),
            StoreErrorKind::Corrupt
        );
        // A Redis in-flight tag is not a record.
        bytes[0] = 0xF1;
        assert_eq!(
            decode(&Bytes::from(bytes.clone())).unwrap_err().kind(),
            StoreErrorKind::Corrupt
        );
        // Status 1000.
        let mut bytes = good.clone();
        bytes[17..19].copy_from_slice(&1000u16.to_be_bytes());
        assert_eq!(
            decode(&Bytes::from(bytes.clone())).unwrap_err().kind(),
            StoreErrorKind::Corrupt
        );
        // Unknown flag.
        let mut bytes = good.clone();
        bytes[19] = 0x80;
        assert_eq!(
            decode(&Bytes::from(bytes.clone())).unwrap_err().kind(),
            StoreErrorKind::Corrupt
        );
        // Header count far beyond the bytes.
        let mut bytes = good.clone();
        bytes[20..24].copy_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(
            decode(&Bytes::from(bytes.clone())).unwrap_err().kind(),
            StoreErrorKind::Corrupt
        );
        // Invalid header name (a space).
        let mut bytes = good;
        let first_name = 24 + 2;
        bytes[first_name] = b' ';
        assert_eq!(
            decode(&Bytes::from(bytes.clone())).unwrap_err().kind(),
            StoreErrorKind::Corrupt
        );
        // Garbage.
        assert_eq!(
            decode(&Bytes::from_static(b"hello world"))
                .unwrap_err()
                .kind(),
            StoreErrorKind::Corrupt
        );
    }
}
