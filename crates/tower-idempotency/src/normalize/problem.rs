//! The layers' own refusals as RFC 9457 problem details
//! (`application/problem+json`), as the IETF Idempotency-Key draft answers
//! its 400, 409 and 422.

use crate::body::Rejection;
use crate::outcome::Outcome;
use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};

/// The `type` of every problem: the draft that defines the answers.
pub(super) const PROBLEM_TYPE: &str =
    "https://datatracker.ietf.org/doc/draft-ietf-httpapi-idempotency-key-header/";

/// `res` (a refusal of the layers, with its [`Rejection`] message) rewritten
/// as problem details naming the key's `header`; the status, `Retry-After`
/// and extensions are kept.
pub(super) fn rewrite<B: From<Bytes>>(res: Response<B>, header_name: &str) -> Response<B> {
    let (mut parts, body) = res.into_parts();
    let Some(Rejection(message)) = parts.extensions.get::<Rejection>() else {
        return Response::from_parts(parts, body);
    };
    let detail = String::from_utf8_lossy(message).trim().to_owned();
    let outcome = parts.extensions.get::<Outcome>().copied();
    let title = match (parts.status, outcome) {
        (StatusCode::BAD_REQUEST, Some(Outcome::KeyMissing)) => format!("{header_name} is missing"),
        (StatusCode::BAD_REQUEST, _) => format!("{header_name} is malformed"),
        (StatusCode::CONFLICT, _) => format!("A request is outstanding for this {header_name}"),
        (StatusCode::UNPROCESSABLE_ENTITY, _) => format!("{header_name} is already used"),
        (status, _) => status.canonical_reason().unwrap_or("Refused").to_owned(),
    };
    let json = serde_json::json!({
        "type": PROBLEM_TYPE,
        "title": title,
        "status": parts.status.as_u16(),
        "detail": detail,
    });
    drop(body);
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    parts
        .headers
        .insert(header::CONTENT_LANGUAGE, HeaderValue::from_static("en"));
    Response::from_parts(parts, B::from(Bytes::from(json.to_string())))
}
