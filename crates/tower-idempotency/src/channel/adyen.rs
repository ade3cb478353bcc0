//! Adyen standard notifications: keyed by `pspReference:eventCode:success` of
//! the first item (Adyen's own duplicate rule), answered `[accepted]`.

use super::{failure_status, fixed, hours, Preset};
use crate::key::{Field, FingerprintSpec, KeySpec};
use crate::normalize::Reply;

const ITEM: &str = "/notificationItems/0/NotificationRequestItem";

pub(super) fn preset() -> Preset {
    Preset::channel(
        "adyen",
        KeySpec::new(
            [
                Field::json(format!("{ITEM}/pspReference")),
                Field::json(format!("{ITEM}/eventCode")),
                Field::json(format!("{ITEM}/success")),
            ],
            FingerprintSpec::Fields(vec![Field::json(format!("{ITEM}/amount"))]),
        ),
        Reply::new(
            fixed(200, "text/plain; charset=utf-8", "[accepted]"),
            failure_status(500),
        ),
    )
    .with_window(hours(31 * 24))
}
