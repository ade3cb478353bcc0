//! The gateway example as a process, for the gateway tests: start it with
//! arguments, environment and a chosen stderr; read its `listening on` line.
#![allow(dead_code, unreachable_pub)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, SystemTime};

/// The built gateway example; panics with how to build it when it is
/// missing or older than its sources.
pub fn gateway_bin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let mut dir = exe.parent().unwrap();
    if dir.ends_with("deps") {
        dir = dir.parent().unwrap();
    }
    let bin = dir
        .join("examples")
        .join(format!("gateway{}", std::env::consts::EXE_SUFFIX));
    let build = "build it with `cargo build --all-features --example gateway` \
                 (a plain `cargo test` builds it; `cargo test --test gateway` does not)";
    let built = std::fs::metadata(&bin)
        .and_then(|m| m.modified())
        .unwrap_or_else(|_| panic!("{} is missing: {build}", bin.display()));
    let sources = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/gateway");
    if let Some(changed) = newest(&sources) {
        assert!(
            built >= changed,
            "{} is older than {}: {build}",
            bin.display(),
            sources.display()
        );
    }
    bin
}

/// The newest modification time of the files in `dir`.
fn newest(dir: &Path) -> Option<SystemTime> {
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(Result::ok)
        .filter_map(|e| e.metadata().and_then(|m| m.modified()).ok())
        .max()
}

/// A temporary file path unique to this process and call.
pub fn temp_path(tag: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!(
        "tower-idempotency-gw-{}-{}-{tag}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// A running gateway, killed on drop.
pub struct Proc {
    pub child: Child,
    pub addr: SocketAddr,
}

impl Proc {
    /// Starts the gateway with `args` and `env`, stderr to `stderr`; waits
    /// for its `listening on` line.
    pub fn start(args: &[&str], env: &[(&str, &str)], stderr: Stdio) -> Self {
        let mut cmd = Command::new(gateway_bin());
        cmd.args(args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn the gateway");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let _ = tx.send(lines.next());
            for _ in lines {}
        });
        let addr = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(Some(Ok(line))) => line
                .strip_prefix("listening on ")
                .and_then(|a| a.parse().ok())
                .unwrap_or_else(|| panic!("unexpected first line {line:?}")),
            other => {
                let _ = child.kill();
                panic!("the gateway did not announce itself: {other:?}");
            }
        };
        Self { child, addr }
    }

    /// Sends `sig` to the gateway.
    pub fn signal(&self, sig: libc::c_int) {
        let pid = libc::pid_t::try_from(self.child.id()).unwrap();
        // SAFETY: kill(2) with a pid this test spawned and still owns.
        let rc = unsafe { libc::kill(pid, sig) };
        assert_eq!(rc, 0, "kill({pid}, {sig})");
    }

    /// The gateway's resident memory in KiB (Linux `/proc/PID/status`).
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS in /proc/PID/status")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 request over a fresh connection; the whole answer as text
/// (`Connection: close`).
pub fn raw_http(addr: SocketAddr, request: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    stream.write_all(request.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = stream.read_to_string(&mut out);
    out
}

/// `GET path` with `Connection: close`; the status code and the body.
pub fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let text = raw_http(
        addr,
        &format!("GET {path} HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n"),
    );
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_owned();
    (status, body)
}
