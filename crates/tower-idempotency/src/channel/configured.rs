//! Presets built from parts ([`Preset::builder`]): for senders without a
//! built-in preset.

use super::{Preset, CHANNEL_MAX_BODY, CHANNEL_WINDOW, DEFAULT_WAIT};
use crate::key::{Field, FingerprintSpec, KeySpec};
use crate::normalize::{FixedReply, Reply};
use http::StatusCode;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// What a configured preset does with a request that carries no key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum WithoutKey {
    /// The preset's failure reply (the default): the sender retries.
    #[default]
    Refuse,
    /// Forwarded unguarded (after verification, where the route verifies):
    /// for handshakes that carry no notification, such as Slack's
    /// `url_verification`.
    Pass,
}

/// Why [`PresetBuilder::build`] refused a preset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PresetError(String);

impl fmt::Display for PresetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PresetError {}

/// Builds a channel preset from parts; from [`Preset::builder`].
///
/// A configured preset is a channel's: POST only, its sender is the channel
/// (no principal scopes its keys), its name is what metrics and logs show
/// and the scope part of its stored keys (renaming a preset starts its keys
/// afresh). A header or query parameter it reads that is sent twice is
/// refused (an invalid key).
///
/// ```
/// use http::{HeaderName, StatusCode};
/// use tower_idempotency::key::{Field, FingerprintSpec};
/// use tower_idempotency::normalize::FixedReply;
/// use tower_idempotency::Preset;
///
/// let github = Preset::builder("github")
///     .key([Field::header(HeaderName::from_static("x-github-delivery"))])
///     .fingerprint(FingerprintSpec::Body)
///     .success(FixedReply::new(StatusCode::OK, None, Some("".into())))
///     .window(std::time::Duration::from_secs(72 * 3600))
///     .build()
///     .unwrap();
/// assert_eq!(github.name(), "github");
/// assert!(Preset::builder("stripe").key([Field::json("/id")]).build().is_err());
/// assert!(Preset::builder("Git Hub").key([Field::json("/id")]).build().is_err());
/// assert!(Preset::builder("github").build().is_err());
/// ```
#[derive(Debug, Clone)]
pub struct PresetBuilder {
    name: Arc<str>,
    key: Vec<Field>,
    fingerprint: FingerprintSpec,
    success: Option<FixedReply>,
    failure: Option<FixedReply>,
    without_key: WithoutKey,
    window: Duration,
    wait: Duration,
    max_body: usize,
}

impl Preset {
    /// A channel preset built from parts, named `name` (`[a-z0-9-]`, not a
    /// built-in preset's name). Defaults: no fingerprint (the key alone
    /// makes a copy the same notification: many senders re-sign or
    /// re-render a retry), the upstream's answer kept and replayed, the
    /// failure reply 500 with the layer's plain-text explanation as its body
    /// (a refused signature: 401 `signature invalid`), a request without the key
    /// refused, window 25 h, wait 4 s, body limit 64 KiB.
    pub fn builder(name: impl Into<Arc<str>>) -> PresetBuilder {
        PresetBuilder {
            name: name.into(),
            key: Vec::new(),
            fingerprint: FingerprintSpec::None,
            success: None,
            failure: None,
            without_key: WithoutKey::Refuse,
            window: CHANNEL_WINDOW,
            wait: DEFAULT_WAIT,
            max_body: CHANNEL_MAX_BODY,
        }
    }
}

impl PresetBuilder {
    /// Where the key is: one field, or several (a composite key, the
    /// values joined with `:`, each escaped).
    pub fn key(mut self, fields: impl IntoIterator<Item = Field>) -> Self {
        self.key = fields.into_iter().collect();
        self
    }

    /// What must match for a copy to be the same notification:
    /// [`FingerprintSpec::Body`], [`FingerprintSpec::Fields`] or
    /// [`FingerprintSpec::None`] (the default). A copy with the key of an
    /// earlier one and another fingerprint gets the failure reply.
    pub fn fingerprint(mut self, fingerprint: FingerprintSpec) -> Self {
        self.fingerprint = fingerprint;
        self
    }

    /// The reply every copy gets once the first succeeded. Defaults to the
    /// upstream's answer, kept and replayed.
    pub fn success(mut self, reply: FixedReply) -> Self {
        self.success = Some(reply);
        self
    }

    /// The retryable failure (a fingerprint mismatch, a shed request, a
    /// timeout, a copy in flight past the wait). Defaults to 500 with an
    /// empty body.
    pub fn failure(mut self, reply: FixedReply) -> Self {
        self.failure = Some(reply);
        self
    }

    /// What a request without the key gets. Defaults to
    /// [`WithoutKey::Refuse`].
    pub fn without_key(mut self, without: WithoutKey) -> Self {
        self.without_key = without;
        self
    }

    /// How long a success is replayed: longer than the sender keeps
    /// retrying. Defaults to 25 h.
    pub fn window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }

    /// How long a copy waits for the first to finish. Defaults to 4 s.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// The largest request body. Defaults to 64 KiB.
    pub fn max_body_bytes(mut self, bytes: usize) -> Self {
        self.max_body = bytes;
        self
    }

    /// The preset, or why not: a name that is empty, not `[a-z0-9-]` or a
    /// built-in preset's, or no key field.
    pub fn build(self) -> Result<Preset, PresetError> {
        check_name(&self.name)?;
        if self.key.is_empty() {
            return Err(PresetError(format!(
                "preset {}: no key field (a header, JSON pointer, form field, XML element or query parameter)",
                self.name
            )));
        }
        // Without a failure form of the sender's own, a refusal keeps the
        // layer's plain-text explanation (`signature invalid`, …), as the
        // built-in channels without one do.
        let failure = self.failure.or_else(|| {
            Some(FixedReply::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                None,
                None,
            ))
        });
        let spec = KeySpec::new(self.key, self.fingerprint).refuse_repeated();
        let mut reply = Reply::new(self.success, failure);
        if self.without_key == WithoutKey::Pass {
            reply = reply.keeping_unkeyed();
        }
        let mut preset = Preset::channel(self.name, spec, reply).with_window(self.window);
        preset.wait = self.wait;
        preset.max_body = self.max_body;
        preset.key_required = self.without_key == WithoutKey::Refuse;
        Ok(preset)
    }
}

/// A configured preset's name: `[a-z0-9-]`, not a built-in one.
fn check_name(name: &str) -> Result<(), PresetError> {
    if name.is_empty()
        || !name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return Err(PresetError(format!(
            "preset name {name:?}: use lower-case letters, digits and `-`"
        )));
    }
    if Preset::is_builtin_name(name) || name == "auto" {
        return Err(PresetError(format!(
            "preset name {name:?} is a built-in preset's: name a configured preset otherwise"
        )));
    }
    Ok(())
}
