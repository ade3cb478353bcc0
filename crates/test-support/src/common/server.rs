//! What every test server of `tests/support_*` does the same way: its
//! temporary directory, the check that its binaries are installed, the wait
//! until it answers, and its end (killed on drop, and by a watchdog once the
//! test process is gone, so that a server held in a static, never dropped,
//! or left by a killed test binary does not outlive it). Included by each
//! support module with `#[path]`, as `port.rs` is.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A fresh, empty directory `tower-idempotency-{kind}-{pid}-{n}-{tag}`
/// under the system's temporary directory.
pub fn temp_dir(kind: &str, tag: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "tower-idempotency-{kind}-{}-{}-{tag}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

/// `installed`, said aloud when it is false: a panic when the `CI`
/// environment variable is set (CI must run the tests of `what`), else a
/// warning that they are skipped, with how to `install` it. Call it once
/// per binary and server (in a `OnceLock`): the warning goes to the real
/// stderr, which the test harness does not capture.
pub fn installed(installed: bool, what: &str, install: &str) -> bool {
    if installed {
        return true;
    }
    if std::env::var_os("CI").is_some() {
        panic!("{what} not found but CI is set: CI must run its tests ({install})");
    }
    let _ = writeln!(
        std::io::stderr(),
        "\n\
         ************************************************************************\n\
         WARNING: {what} not found: SKIPPING its tests (they pass without\n\
         running). Install it to run them: {install}\n\
         ************************************************************************\n"
    );
    false
}

/// How a wait for a server to answer ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Ready {
    /// It answers.
    Up,
    /// It exited first (its port was taken, most likely).
    Exited,
    /// Neither within the time given; it still runs.
    TimedOut,
}

/// Asks `answers` every `every` until it says yes, `child` exits, or
/// `within` has passed.
pub fn wait_ready(
    child: &mut Child,
    within: Duration,
    every: Duration,
    mut answers: impl FnMut() -> bool,
) -> Ready {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return Ready::Exited;
        }
        if answers() {
            return Ready::Up;
        }
        std::thread::sleep(every);
    }
    Ready::TimedOut
}

/// A server's process, killed with SIGKILL on drop, and by its watchdog
/// once this test process is gone.
#[derive(Debug)]
pub struct Process {
    child: Child,
    /// The child leads a process group of its own (`process_group(0)`),
    /// which is killed whole.
    group: bool,
    watchdog: Option<Child>,
}

impl Process {
    /// `child`; once this test process is gone its watchdog kills it, then
    /// runs the shell commands `cleanup` (may be empty).
    pub fn watched(child: Child, cleanup: &str) -> Self {
        Self::new(child, false, cleanup)
    }

    /// The same for a child that leads its own process group: the whole
    /// group is killed.
    pub fn watched_group(child: Child, cleanup: &str) -> Self {
        Self::new(child, true, cleanup)
    }

    fn new(child: Child, group: bool, cleanup: &str) -> Self {
        let target = Self::target(child.id(), group);
        let script = format!(
            "while kill -0 {parent} 2>/dev/null; do sleep 0.3; done; \
             kill -9 {target} 2>/dev/null; {cleanup}",
            parent = std::process::id()
        );
        let watchdog = Command::new("sh")
            .arg("-c")
            .arg(script)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok();
        Self {
            child,
            group,
            watchdog,
        }
    }

    /// `kill`'s argument: the pid, or the group's (its negative).
    fn target(pid: u32, group: bool) -> String {
        if group {
            format!("-{pid}")
        } else {
            pid.to_string()
        }
    }

    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Stops the watchdog, for a server about to be stopped another way.
    pub fn disarm(&mut self) {
        if let Some(mut w) = self.watchdog.take() {
            let _ = w.kill();
            let _ = w.wait();
        }
    }

    /// Waits at most `within` for the process to exit; whether it did.
    pub fn wait_exit(&mut self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.disarm();
        if self.group {
            // The shell's `kill` takes a negative pid as a process group.
            let _ = Command::new("sh")
                .arg("-c")
                .arg(format!("kill -9 {}", Self::target(self.child.id(), true)))
                .status();
        } else {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}
