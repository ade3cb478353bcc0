//! PayPal: JSON webhook events keyed by the event `/id`.

use super::{failure_status, hours, status_only, Preset};
use crate::key::{Field, FingerprintSpec, KeySpec};
use crate::normalize::Reply;

pub(super) fn preset() -> Preset {
    Preset::channel(
        "paypal",
        KeySpec::new(
            [Field::json("/id")],
            FingerprintSpec::Fields(vec![Field::json("/event_type")]),
        ),
        Reply::new(status_only(200), failure_status(500)),
    )
    .with_window(hours(4 * 24))
}
