//! Client tokens (anti-resubmit tokens): the server hands out a
//! one-time token ([`IssueToken`](crate::token::IssueToken)); the submit
//! carries it in `Idempotency-Token`; the first submit consumes it and runs,
//! copies within the window wait and get its response replayed (or 409 in
//! strict mode), the same token with another body gets 422, and an unknown,
//! expired or other principal's token (or a used one after the window) gets
//! 400. See the [`token`](crate::token) module.

use super::Preset;
use crate::key::{Field, FingerprintSpec, KeySpec};
use http::HeaderName;

/// The request header that carries the token.
pub const TOKEN_HEADER: HeaderName = HeaderName::from_static("idempotency-token");

pub(super) fn preset() -> Preset {
    let mut preset = Preset::client_api(
        "client-token",
        KeySpec::new([Field::header(TOKEN_HEADER)], FingerprintSpec::Request),
        "`Idempotency-Token` header (ask for a token first)",
    );
    preset.consume_token = true;
    preset
}
