//! One rule for the files that must stay the gateway's own: a secret it
//! reads (the admin token, the queue's secret or key) is refused when its
//! group or others may access it, as ssh refuses such a key; a data file it
//! writes (the queue, its key, the pauses) is created readable and
//! writable by its owner only, even in a directory that others may read.

use std::path::Path;

/// Refuses the secret file `path` (`what`: how the message names it) when
/// any permission bit of its group or others is set.
pub(crate) fn check_secret_file(path: &Path, what: &str) -> Result<(), String> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let meta = std::fs::metadata(path)
            .map_err(|e| format!("cannot read the {what} {}: {e}", path.display()))?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(format!(
                "permissions {mode:04o} for the {what} {shown} are too open: it must not be \
                 accessible by others (chmod 600 {shown})",
                shown = path.display()
            ));
        }
    }
    #[cfg(not(unix))]
    let _ = (path, what);
    Ok(())
}

/// Creates the data file `path` empty, readable and writable by its owner
/// only (0600), or narrows an existing one to that, before whoever writes
/// it opens it.
pub(crate) fn owner_only_file(path: &Path) -> Result<(), String> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
        let shown = |e: std::io::Error| format!("cannot create {}: {e}", path.display());
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(path)
            .map_err(shown)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(shown)?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}
