//! Stripe: JSON events keyed by the event `/id`.

use super::{failure_status, fixed, hours, Preset};
use crate::key::{Field, FingerprintSpec, KeySpec};
use crate::normalize::Reply;

pub(super) fn preset() -> Preset {
    Preset::channel(
        "stripe",
        KeySpec::new(
            [Field::json("/id")],
            FingerprintSpec::Fields(vec![Field::json("/type")]),
        ),
        Reply::new(
            fixed(200, "application/json", r#"{"received":true}"#),
            failure_status(500),
        ),
    )
    .with_window(hours(4 * 24))
}
