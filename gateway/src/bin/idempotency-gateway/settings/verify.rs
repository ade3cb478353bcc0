//! A route's `verify` table: the channel's keys, read relative to the
//! config file, checked before the gateway starts.

use idempotency_gateway::config::VerifyConfig;
use idempotency_gateway::proxy::Target;
use std::path::Path;
use tower_idempotency::verify::VerifyLayer;

/// The verify layer of a route to `target` from its `verify` table; files are
/// read relative to `base` (the config file's folder). `Err` is the reason.
pub(crate) fn layer(
    config: &VerifyConfig,
    target: &Target,
    base: &Path,
) -> Result<VerifyLayer, String> {
    match target {
        Target::Auto => Err(
            "`verify`: an `auto` route cannot verify signatures (each channel \
                             has its own keys); give the route its channel's preset"
                .to_owned(),
        ),
        Target::Preset(preset) => config
            .layer(preset.name(), base)
            .map_err(|e| format!("`verify`: {e}")),
    }
}

/// The folder files named in the config file at `path` are relative to.
pub(crate) fn base(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}
