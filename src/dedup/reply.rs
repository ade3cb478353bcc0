//! The dedup layer's own answers: replays and refusals.

use super::{BODY_OMITTED_HEADER, REPLAYED_HEADER};
use crate::body::{text_response, ResponseBody};
use crate::outcome::Outcome;
use crate::store::CompletedRecord;
use http::{header, HeaderValue, Response, StatusCode};

/// A replay of a completed record.
pub(super) fn replay<B>(record: &CompletedRecord, outcome: Outcome) -> Response<ResponseBody<B>> {
    let stored = &record.response;
    let mut res = Response::new(ResponseBody::full(
        stored.body.clone(),
        stored.trailers.clone(),
    ));
    *res.status_mut() = stored.status;
    *res.headers_mut() = stored.headers.clone();
    if let Some(trailers) = &stored.trailers {
        // HTTP/1.1 sends only the trailers that `Trailer` announces.
        if !trailers.is_empty() && !res.headers().contains_key(header::TRAILER) {
            let names: Vec<&str> = trailers.keys().map(|k| k.as_str()).collect();
            if let Ok(v) = HeaderValue::from_str(&names.join(", ")) {
                res.headers_mut().insert(header::TRAILER, v);
            }
        }
    }
    res.headers_mut()
        .insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    if stored.body_omitted {
        res.headers_mut()
            .insert(BODY_OMITTED_HEADER, HeaderValue::from_static("true"));
    }
    res.extensions_mut().insert(outcome);
    res
}

/// A copy found the key in flight and could not wait (longer).
pub(super) fn in_flight<B>() -> Response<ResponseBody<B>> {
    retry_later(
        StatusCode::CONFLICT,
        "a request with this idempotency key is still in progress; retry later\n",
        Outcome::InFlightRejected,
    )
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
