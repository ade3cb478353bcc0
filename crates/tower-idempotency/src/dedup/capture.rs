//! Capturing a success for replay while it streams to the caller: the body
//! is teed into the record up to the cache limit, and only end-to-end headers
//! are kept.

use crate::headers::{connection_named, is_grpc, is_hop_by_hop};
use crate::store::{CompletedRecord, StoredResponse};
use crate::Fingerprint;
use bytes::{Bytes, BytesMut};
use http::{header, HeaderMap, HeaderValue, StatusCode};

/// The part of a streamed success kept for its record.
pub(super) struct Capture {
    status: StatusCode,
    headers: HeaderMap,
    body: BytesMut,
    cap: usize,
    omitted: bool,
    trailers: Option<HeaderMap>,
}

impl Capture {
    /// Starts a capture of a response with this head, keeping at most `cap`
    /// body bytes.
    pub(super) fn new(status: StatusCode, headers: &HeaderMap, cap: usize) -> Self {
        Self {
            status,
            headers: end_to_end(headers),
            body: BytesMut::new(),
            cap,
            omitted: false,
            trailers: None,
        }
    }

    /// Tees one data frame. Past the cap the body is dropped (the record
    /// completes without it), so memory never grows with the response.
    pub(super) fn data(&mut self, data: &Bytes) {
        if self.omitted {
            return;
        }
        if self.body.len() + data.len() > self.cap {
            self.omitted = true;
            self.body = BytesMut::new();
            return;
        }
        // Copied: the response's bytes may be slices of a connection's read
        // buffer, which the record would otherwise keep alive for the window.
        self.body.extend_from_slice(data);
    }

    /// Tees the trailers.
    pub(super) fn trailers(&mut self, trailers: &HeaderMap) {
        let kept = end_to_end(trailers);
        match &mut self.trailers {
            Some(existing) => existing.extend(kept),
            None => self.trailers = Some(kept),
        }
    }

    /// The body bytes held so far.
    pub(super) fn held(&self) -> usize {
        self.body.len()
    }

    /// Whether the whole response says success: for gRPC, `grpc-status: 0`.
    pub(super) fn succeeded(&self) -> bool {
        !grpc_failed(&self.headers, Some(self.trailers.as_ref()))
    }

    /// The record to store.
    pub(super) fn into_record(mut self, fingerprint: Fingerprint) -> CompletedRecord {
        if self.omitted {
            self.headers.remove(header::CONTENT_LENGTH);
        }
        let response = StoredResponse::new(self.status, self.headers, self.body.freeze())
            .with_trailers(self.trailers)
            .with_body_omitted(self.omitted);
        CompletedRecord::new(fingerprint, response)
    }
}

/// For gRPC responses: whether `grpc-status` says anything but 0.
///
/// With `trailers` = `None` only the headers are known: a trailers-only
/// response carries its status there. With `Some(..)`, the whole response is
/// known and a missing status is a failure. gRPC-Web carries its status in a
/// frame of the body, not in trailers, so a gRPC-Web response is never judged
/// a success: it is not guarded (every copy runs).
pub(super) fn grpc_failed(headers: &HeaderMap, trailers: Option<Option<&HeaderMap>>) -> bool {
    if !is_grpc(headers) {
        return false;
    }
    let status = headers
        .get("grpc-status")
        .or_else(|| trailers.flatten().and_then(|t| t.get("grpc-status")));
    match (status, trailers) {
        (Some(s), _) => s.as_bytes() != b"0",
        (None, None) => false,
        (None, Some(_)) => true,
    }
}

/// The headers kept for replay: end-to-end headers only. `Trailer` is kept:
/// it announces the trailers that HTTP/1.1 sends after a chunked body.
fn end_to_end(headers: &HeaderMap) -> HeaderMap {
    // Headers that `Connection` names are hop-by-hop too.
    let named = connection_named(headers);
    let dropped = |name: &header::HeaderName| is_hop_by_hop(name) || named.contains(name);
    let keep = |name: &header::HeaderName| !dropped(name);
    // A fresh map sized for what is kept: a stored record lives for the
    // whole window, and a clone of the handler's map would keep its spare
    // capacity (hundreds of bytes) that long.
    let kept = headers.iter().filter(|(name, _)| keep(name)).count();
    let mut out = HeaderMap::with_capacity(kept);
    for (name, value) in headers.iter() {
        if keep(name) {
            out.append(name.clone(), owned(value));
        }
    }
    out
}

/// A header value that owns its bytes (a parsed value may be a slice of a
/// connection's read buffer).
fn owned(value: &HeaderValue) -> HeaderValue {
    match HeaderValue::from_bytes(value.as_bytes()) {
        Ok(mut copy) => {
            copy.set_sensitive(value.is_sensitive());
            copy
        }
        Err(_) => value.clone(),
    }
}
