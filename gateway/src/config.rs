//! The parts of the gateway's configuration file that a program embedding
//! the gateway can read the same way: [`VerifyConfig`], a route's `verify`
//! table (the channel's keys, and where each comes from: [`Secret`]).
//!
//! ```
//! use idempotency_gateway::config::VerifyConfig;
//!
//! let table: VerifyConfig = toml::from_str(r#"
//!     secrets = [{ env = "STRIPE_WEBHOOK_SECRET" }]
//!     tolerance = "5m"
//! "#).unwrap();
//! assert_eq!(table.secrets.len(), 1);
//! ```

use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use tower_idempotency::verify::{
    AdyenKeys, AlipayKeys, HmacSchemeBuilder, PayPalKeys, SigningKeyError, StandardWebhooksKeys,
    StripeKeys, VerifyLayer, WechatPayV2Keys, WechatPayV3Keys,
};

/// Where a key or secret comes from.
///
/// In TOML: `"…"` (see each field for how a plain string reads),
/// `{ value = "…" }`, `{ file = "path" }` (relative to the configuration
/// file) or `{ env = "VARIABLE" }`.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum Secret {
    /// A plain string: the secret itself for secrets, a file path for
    /// certificates and public keys (unless it starts with `-----BEGIN`).
    Plain(String),
    /// The value itself.
    Value {
        /// The value.
        value: String,
    },
    /// The contents of a file.
    File {
        /// The path, relative to the configuration file.
        file: PathBuf,
    },
    /// The value of an environment variable.
    Env {
        /// The variable's name.
        env: String,
    },
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Plain(_) | Self::Value { .. } => f.write_str("Secret(<redacted>)"),
            Self::File { file } => write!(f, "Secret(file {})", file.display()),
            Self::Env { env } => write!(f, "Secret(env {env})"),
        }
    }
}

/// How a plain string reads.
#[derive(Clone, Copy)]
enum Plain {
    Value,
    PathUnlessPem,
}

impl Secret {
    fn load(&self, plain: Plain, base: &Path) -> Result<Vec<u8>, VerifyConfigError> {
        let read = |path: &Path| {
            let path = base.join(path);
            std::fs::read(&path)
                .map_err(|e| VerifyConfigError(format!("cannot read {}: {e}", path.display())))
        };
        match self {
            Self::Plain(s) => match plain {
                Plain::PathUnlessPem if !s.trim_start().starts_with("-----BEGIN") => {
                    read(Path::new(s))
                }
                _ => Ok(s.as_bytes().to_vec()),
            },
            Self::Value { value } => Ok(value.as_bytes().to_vec()),
            Self::File { file } => read(file),
            Self::Env { env } => std::env::var(env)
                .map(String::into_bytes)
                .map_err(|_| VerifyConfigError(format!("environment variable {env} is not set"))),
        }
    }

    fn load_text(&self, plain: Plain, base: &Path) -> Result<String, VerifyConfigError> {
        let bytes = self.load(plain, base)?;
        String::from_utf8(bytes)
            .map(|s| s.trim().to_owned())
            .map_err(|_| VerifyConfigError("a secret is not UTF-8 text".into()))
    }
}

/// The `verify` table of one route: the keys of its channel.
///
/// Which fields a preset reads:
///
/// | preset | fields |
/// |---|---|
/// | `wechatpay-v3` | `platform_keys` (serial → certificate or public key), `api_v3_key` or `api_v3_key_file` (optional), `tolerance` (default `5m`) |
/// | `wechatpay-v2` | `api_keys` |
/// | `alipay` | `public_keys` |
/// | `stripe` | `secrets` (`whsec_…`), `tolerance` (default `300s`) |
/// | `standard-webhooks` | `secrets` (`whsec_…`), `public_keys` (`whpk_…`), `tolerance` (default `5m`) |
/// | `adyen` | `hmac_keys` (hex) |
/// | `paypal` | `webhook_id`, `certificates`, `tolerance` (default `5m`) |
///
/// Secrets (`secrets`, `api_keys`, `hmac_keys`, `api_v3_key`) read a plain
/// string as the secret; certificates and public keys (`platform_keys`,
/// `certificates`, `public_keys`) read it as a file path unless it is inline
/// PEM (or a `whpk_` key). Any of them may be `{ file = "…" }`,
/// `{ env = "…" }` or `{ value = "…" }`. A field the preset does not read is
/// an error, so a typo cannot switch verification off silently.
///
/// ```
/// use idempotency_gateway::config::VerifyConfig;
/// let config: VerifyConfig = serde_json::from_str(
///     r#"{ "secrets": ["whsec_test_secret"], "tolerance": "300s" }"#,
/// ).unwrap();
/// let layer = config.layer("stripe", std::path::Path::new(".")).unwrap();
/// assert!(layer.is_on());
/// assert!(config.layer("adyen", std::path::Path::new(".")).is_err());
/// ```
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct VerifyConfig {
    /// How far a signed timestamp may lie from now (`"300s"`, `"5m"`).
    #[serde(default)]
    pub tolerance: Option<String>,
    /// Stripe and Standard Webhooks signing secrets.
    #[serde(default)]
    pub secrets: Vec<Secret>,
    /// Alipay public keys; Standard Webhooks `whpk_` public keys.
    #[serde(default)]
    pub public_keys: Vec<Secret>,
    /// WeChat Pay v3 platform certificates or public keys by serial.
    #[serde(default)]
    pub platform_keys: BTreeMap<String, Secret>,
    /// The WeChat Pay v3 APIv3 key (decrypts `resource`).
    #[serde(default)]
    pub api_v3_key: Option<Secret>,
    /// A file holding the WeChat Pay v3 APIv3 key.
    #[serde(default)]
    pub api_v3_key_file: Option<PathBuf>,
    /// WeChat Pay v2 API keys.
    #[serde(default)]
    pub api_keys: Vec<Secret>,
    /// Adyen HMAC keys (hex).
    #[serde(default)]
    pub hmac_keys: Vec<Secret>,
    /// PayPal signing certificates.
    #[serde(default)]
    pub certificates: Vec<Secret>,
    /// The PayPal webhook id.
    #[serde(default)]
    pub webhook_id: Option<String>,
}

/// A `verify` table that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyConfigError(String);

impl fmt::Display for VerifyConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for VerifyConfigError {}

impl From<SigningKeyError> for VerifyConfigError {
    fn from(e: SigningKeyError) -> Self {
        Self(e.to_string())
    }
}

impl VerifyConfig {
    /// The fields that are set, by name.
    fn set_fields(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        let mut add = |set: bool, name| {
            if set {
                out.push(name)
            }
        };
        add(self.tolerance.is_some(), "tolerance");
        add(!self.secrets.is_empty(), "secrets");
        add(!self.public_keys.is_empty(), "public_keys");
        add(!self.platform_keys.is_empty(), "platform_keys");
        add(self.api_v3_key.is_some(), "api_v3_key");
        add(self.api_v3_key_file.is_some(), "api_v3_key_file");
        add(!self.api_keys.is_empty(), "api_keys");
        add(!self.hmac_keys.is_empty(), "hmac_keys");
        add(!self.certificates.is_empty(), "certificates");
        add(self.webhook_id.is_some(), "webhook_id");
        out
    }

    fn tolerance(&self) -> Result<Option<std::time::Duration>, VerifyConfigError> {
        self.tolerance
            .as_deref()
            .map(|t| {
                let d = humantime::parse_duration(t)
                    .map_err(|e| VerifyConfigError(format!("tolerance {t:?}: {e}")))?;
                // A duration of the config, as every other: at most a year.
                if d > tower_idempotency::dedup::MAX_SETTING {
                    return Err(VerifyConfigError(format!(
                        "tolerance {t:?}: must be at most a year (365d)"
                    )));
                }
                Ok(d)
            })
            .transpose()
    }

    /// Builds the verify layer of a route whose preset is `preset`; files are
    /// read relative to `base` (the configuration file's folder).
    pub fn layer(&self, preset: &str, base: &Path) -> Result<VerifyLayer, VerifyConfigError> {
        let allowed: &[&str] = match preset {
            "wechatpay-v3" => &[
                "platform_keys",
                "api_v3_key",
                "api_v3_key_file",
                "tolerance",
            ],
            "wechatpay-v2" => &["api_keys"],
            "alipay" => &["public_keys"],
            "stripe" => &["secrets", "tolerance"],
            "standard-webhooks" => &["secrets", "public_keys", "tolerance"],
            "adyen" => &["hmac_keys"],
            "paypal" => &["webhook_id", "certificates", "tolerance"],
            other => return Err(VerifyConfigError(format!("preset {other} has no verifier"))),
        };
        if let Some(field) = self.set_fields().into_iter().find(|f| !allowed.contains(f)) {
            return Err(VerifyConfigError(format!(
                "verify.{field} is not read by preset {preset} (it reads {})",
                allowed.join(", ")
            )));
        }
        let secret = |s: &Secret| s.load_text(Plain::Value, base);
        let key_file = |s: &Secret| s.load(Plain::PathUnlessPem, base);
        let tolerance = self.tolerance()?;
        let layer = match preset {
            "wechatpay-v3" => {
                let mut keys = WechatPayV3Keys::new();
                for (serial, key) in &self.platform_keys {
                    keys = key_file(key)
                        .and_then(|pem| Ok(keys.platform_key(serial.clone(), pem)?))
                        .map_err(|e| VerifyConfigError(format!("platform_keys.{serial}: {e}")))?;
                }
                let api_v3_key = match (&self.api_v3_key, &self.api_v3_key_file) {
                    (Some(s), _) => Some(secret(s)?),
                    (None, Some(file)) => Some(secret(&Secret::File { file: file.clone() })?),
                    (None, None) => None,
                };
                if let Some(key) = api_v3_key {
                    keys = keys.api_v3_key(key)?;
                }
                if let Some(t) = tolerance {
                    keys = keys.tolerance(t);
                }
                need(keys.serials().count(), "platform_keys")?;
                VerifyLayer::new(keys)
            }
            "wechatpay-v2" => {
                need(self.api_keys.len(), "api_keys")?;
                let keys = self
                    .api_keys
                    .iter()
                    .try_fold(WechatPayV2Keys::new(), |k, s| {
                        Ok::<_, VerifyConfigError>(k.api_key(secret(s)?)?)
                    })?;
                VerifyLayer::new(keys)
            }
            "alipay" => {
                need(self.public_keys.len(), "public_keys")?;
                let mut keys = AlipayKeys::new();
                for key in &self.public_keys {
                    keys = keys.public_key(key_file(key)?)?;
                }
                VerifyLayer::new(keys)
            }
            "stripe" => {
                need(self.secrets.len(), "secrets")?;
                let mut keys = StripeKeys::new();
                for s in &self.secrets {
                    keys = keys.secret(secret(s)?)?;
                }
                if let Some(t) = tolerance {
                    keys = keys.tolerance(t);
                }
                VerifyLayer::new(keys)
            }
            "standard-webhooks" => {
                need(
                    self.secrets.len() + self.public_keys.len(),
                    "secrets or public_keys",
                )?;
                let mut keys = StandardWebhooksKeys::new();
                for s in &self.secrets {
                    keys = keys.secret(&secret(s)?)?;
                }
                for k in &self.public_keys {
                    let k = match k {
                        Secret::Plain(s) if s.starts_with("whpk_") => s.clone(),
                        other => other.load_text(Plain::PathUnlessPem, base)?,
                    };
                    keys = keys.public_key(&k)?;
                }
                if let Some(t) = tolerance {
                    keys = keys.tolerance(t);
                }
                VerifyLayer::new(keys)
            }
            "adyen" => {
                need(self.hmac_keys.len(), "hmac_keys")?;
                let mut keys = AdyenKeys::new();
                for s in &self.hmac_keys {
                    keys = keys.hmac_key(&secret(s)?)?;
                }
                VerifyLayer::new(keys)
            }
            _ => {
                let id = self.webhook_id.clone().ok_or_else(|| {
                    VerifyConfigError("verify.webhook_id is required for paypal".into())
                })?;
                need(self.certificates.len(), "certificates")?;
                let mut keys = PayPalKeys::new(id);
                for c in &self.certificates {
                    keys = keys.certificate(key_file(c)?)?;
                }
                if let Some(t) = tolerance {
                    keys = keys.tolerance(t);
                }
                VerifyLayer::new(keys)
            }
        };
        Ok(layer.preset(preset.to_owned()))
    }
}

impl VerifyConfig {
    /// Builds the verify layer of a route whose preset is a configured one
    /// signed with `scheme` (its header, template and so on, from the
    /// preset): the table's `secrets` (any one verifies: rotation) and
    /// `tolerance` (default 5 minutes); files are read relative to `base`.
    /// Any other field is an error, as is a table without secrets.
    ///
    /// ```
    /// use idempotency_gateway::config::VerifyConfig;
    /// use tower_idempotency::verify::{HmacAlgorithm, HmacScheme};
    ///
    /// let config: VerifyConfig = toml::from_str(r#"secrets = ["It's a Secret to Everybody"]"#).unwrap();
    /// let scheme = HmacScheme::builder("github", HmacAlgorithm::Sha256, "x-hub-signature-256")
    ///     .prefix("sha256=");
    /// let layer = config.hmac_layer("github", scheme, std::path::Path::new(".")).unwrap();
    /// assert!(layer.is_on());
    /// ```
    pub fn hmac_layer(
        &self,
        preset: &str,
        scheme: HmacSchemeBuilder,
        base: &Path,
    ) -> Result<VerifyLayer, VerifyConfigError> {
        let allowed = ["secrets", "tolerance"];
        if let Some(field) = self.set_fields().into_iter().find(|f| !allowed.contains(f)) {
            return Err(VerifyConfigError(format!(
                "verify.{field} is not read by preset {preset} (it reads secrets, tolerance)"
            )));
        }
        need(self.secrets.len(), "secrets")?;
        let mut scheme = scheme;
        for s in &self.secrets {
            scheme = scheme.secret(s.load_text(Plain::Value, base)?);
        }
        if let Some(t) = self.tolerance()? {
            scheme = scheme.tolerance(t);
        }
        Ok(VerifyLayer::new(scheme.build()?).preset(preset.to_owned()))
    }
}

fn need(count: usize, what: &str) -> Result<(), VerifyConfigError> {
    if count == 0 {
        return Err(VerifyConfigError(format!(
            "verify.{what}: at least one key is required"
        )));
    }
    Ok(())
}
