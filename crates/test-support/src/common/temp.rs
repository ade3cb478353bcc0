//! A temporary directory removed when dropped, for the files of the
//! embedded queue. Included by the queue tests, which do not use `common`.

use std::path::PathBuf;
use tower_idempotency::store::OwnerToken;

/// A fresh directory under the system's temporary directory.
pub struct TempDir(PathBuf);

impl TempDir {
    /// Creates a directory whose name holds `tag` and a random part.
    pub fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "tower-idempotency-{tag}-{:032x}",
            OwnerToken::new().as_u128()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    /// The directory.
    #[allow(dead_code)] // each test binary uses what it needs
    pub fn path(&self) -> &std::path::Path {
        &self.0
    }

    /// The queue file in it.
    pub fn file(&self) -> PathBuf {
        self.0.join("queue.redb")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
