//! The dedup layer's own answers: replays and refusals.

use super::{BODY_OMITTED_HEADER, REPLAYED_HEADER};
use crate::body::{text_response, ResponseBody};
use crate::outcome::Outcome;
use crate::store::{CompletedRecord, StoredResponse};
use http::{header, HeaderValue, Response, StatusCode};
use std::sync::Arc;

/// A replay of a completed record. A record the store decoded for this
/// claim alone is moved into the response; a shared one (the one a memory
/// store's shard keeps decoded, for the copies that follow) is copied.
pub(super) fn replay<B>(
    record: Arc<CompletedRecord>,
    outcome: Outcome,
) -> Response<ResponseBody<B>> {
    let stored = match Arc::try_unwrap(record) {
        Ok(record) => record.response,
        Err(shared) => shared.response.clone(),
    };
    let StoredResponse {
        status,
        headers,
        body,
        trailers,
        body_omitted,
        ..
    } = stored;
    let announce = trailers
        .as_ref()
        .filter(|t| !t.is_empty() && !headers.contains_key(header::TRAILER))
        .map(|t| t.keys().map(|k| k.as_str()).collect::<Vec<_>>().join(", "));
    let mut res = Response::new(ResponseBody::full(body, trailers));
    *res.status_mut() = status;
    *res.headers_mut() = headers;
    if let Some(names) = announce {
        // HTTP/1.1 sends only the trailers that `Trailer` announces.
        if let Ok(v) = HeaderValue::from_str(&names) {
            res.headers_mut().insert(header::TRAILER, v);
        }
    }
    res.headers_mut()
        .insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    if body_omitted {
        res.headers_mut()
            .insert(BODY_OMITTED_HEADER, HeaderValue::from_static("true"));
    }
    res.extensions_mut().insert(outcome);
    res
}

/// A copy found the key (a client token's, with `token`) in flight and could
/// not wait (longer).
pub(super) fn in_flight<B>(token: bool) -> Response<ResponseBody<B>> {
    let message = match token {
        true => "a request with this idempotency token is still in progress; retry later\n",
        false => "a request with this idempotency key is still in progress; retry later\n",
    };
    retry_later(StatusCode::CONFLICT, message, Outcome::InFlightRejected)
}

/// The retryable failure: 503 with `Retry-After` (a channel's normalize
/// layer turns it into the channel's failure reply).
pub(super) fn retry_later<B>(
    status: StatusCode,
    message: &'static str,
    outcome: Outcome,
) -> Response<ResponseBody<B>> {
    let mut res = text_response(status, message);
    res.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    res.extensions_mut().insert(outcome);
    res
}

/// A refusal with a status, a message and its outcome.
pub(super) fn refusal<B>(
    status: StatusCode,
    message: &'static str,
    outcome: Outcome,
) -> Response<ResponseBody<B>> {
    let mut res = text_response(status, message);
    res.extensions_mut().insert(outcome);
    res
}
