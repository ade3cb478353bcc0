//! Standard Webhooks: keyed by the `webhook-id` header, answered 204.

use super::{failure_status, hours, status_only, Preset};
use crate::key::{Field, FingerprintSpec, KeySpec};
use crate::normalize::Reply;
use http::HeaderName;

pub(super) fn preset() -> Preset {
    Preset::channel(
        "standard-webhooks",
        KeySpec::new(
            [Field::header(HeaderName::from_static("webhook-id"))],
            FingerprintSpec::None,
        ),
        Reply::new(status_only(204), failure_status(500)),
    )
    .with_window(hours(30))
}
