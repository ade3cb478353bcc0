//! Test support: real `nats-server -js` processes on free loopback ports,
//! their JetStream files in temp dirs, killed on drop.
//!
//! If `nats-server` is not on PATH, the NATS tests panic when the `CI`
//! environment variable is set (CI must run them) and are skipped with a
//! loud warning otherwise.
#![allow(dead_code, unreachable_pub)]

#[allow(clippy::duplicate_mod)]
#[path = "../common/port.rs"]
mod port;

use port::free_port;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Whether `nats-server` is there; panics under CI if it is not.
pub fn nats_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    let available = *AVAILABLE.get_or_init(|| {
        Command::new("nats-server")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    if !available {
        if std::env::var_os("CI").is_some() {
            panic!(
                "nats-server is not on PATH but CI is set: CI must run the NATS tests \
                 (apt-get install -y nats-server)"
            );
        }
        static WARNED: OnceLock<()> = OnceLock::new();
        WARNED.get_or_init(|| {
            let _ = writeln!(
                std::io::stderr(),
                "\n\
                 ************************************************************************\n\
                 WARNING: nats-server not found on PATH: SKIPPING the NATS JetStream\n\
                 tests (they pass without running). Install it to run them:\n\
                 apt-get install -y nats-server\n\
                 ************************************************************************\n"
            );
        });
    }
    available
}

fn temp_dir(tag: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "tower-idempotency-nats-{}-{}-{tag}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

/// Whether a JetStream server answers on `port`: a real client handshake
/// (`CONNECT`, `PING`), then a JetStream API request answered.
fn jetstream_ready(port: u16, auth: &str) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(
        &format!("127.0.0.1:{port}").parse().unwrap(),
        Duration::from_millis(500),
    ) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let hello = format!(
        "CONNECT {{\"verbose\":false,\"pedantic\":false,\"headers\":true{auth}}}\r\n\
         SUB _INBOX.ready 1\r\nPUB $JS.API.INFO _INBOX.ready 0\r\n\r\nPING\r\n"
    );
    if s.write_all(hello.as_bytes()).is_err() {
        return false;
    }
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline {
        match s.read(&mut buf) {
            Ok(0) => return false,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(_) => {}
        }
        let text = String::from_utf8_lossy(&got);
        if text.contains("MSG _INBOX.ready") {
            // Answered by JetStream, not "not enabled"/"unavailable".
            return text.contains("\"memory\"") || text.contains("\"storage\"");
        }
    }
    false
}

/// One `nats-server -js` child process.
#[derive(Debug)]
pub struct NatsServer {
    child: Option<Child>,
    watchdog: Option<Child>,
    port: u16,
    dir: PathBuf,
    extra: Vec<String>,
}

impl NatsServer {
    /// Starts a server with JetStream on a free loopback port.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// The same with more `nats-server` arguments (`--user`, `--pass`).
    pub fn start_with(extra: &[&str]) -> Self {
        for _ in 0..10 {
            let port = free_port();
            let mut server = Self {
                child: None,
                watchdog: None,
                port,
                dir: temp_dir(&format!("js-{port}")),
                extra: extra.iter().map(|s| s.to_string()).collect(),
            };
            if server.spawn() {
                return server;
            }
        }
        panic!("could not start nats-server after 10 attempts");
    }

    fn spawn(&mut self) -> bool {
        let mut child = Command::new("nats-server")
            .arg("-js")
            .args(["-a", "127.0.0.1"])
            .arg("-p")
            .arg(self.port.to_string())
            .arg("-sd")
            .arg(self.dir.join("js"))
            .arg("-l")
            .arg(self.dir.join("nats.log"))
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn nats-server");
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return false;
            }
            if jetstream_ready(self.port, &self.auth()) {
                self.watchdog = watchdog(child.id());
                self.child = Some(child);
                return true;
            }
            std::thread::sleep(Duration::from_millis(30));
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }

    /// The `user` and `pass` fields of a `CONNECT`, from `--user`/`--pass`.
    fn auth(&self) -> String {
        let arg = |name: &str| {
            let i = self.extra.iter().position(|a| a == name)?;
            self.extra.get(i + 1).cloned()
        };
        match (arg("--user"), arg("--pass")) {
            (Some(u), Some(p)) => format!(",\"user\":\"{u}\",\"pass\":\"{p}\""),
            _ => String::new(),
        }
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `nats://127.0.0.1:port`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills the server with SIGKILL (no flush, no shutdown).
    pub fn kill(&mut self) {
        self.kill_watchdog();
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port and store directory.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "restart a stopped server only");
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.spawn() {
            assert!(
                Instant::now() < deadline,
                "nats-server did not restart on port {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn kill_watchdog(&mut self) {
        if let Some(mut w) = self.watchdog.take() {
            let _ = w.kill();
            let _ = w.wait();
        }
    }
}

/// A shell that kills `server_pid` once this test process is gone.
fn watchdog(server_pid: u32) -> Option<Child> {
    let script = format!(
        "while kill -0 {parent} 2>/dev/null; do sleep 0.3; done; kill -9 {server_pid} 2>/dev/null",
        parent = std::process::id()
    );
    Command::new("sh")
        .arg("-c")
        .arg(script)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One server shared by every test of this binary, started on first use
/// (never dropped: its watchdog kills it when the binary exits). `None`
/// when `nats-server` is absent (outside CI).
pub fn shared() -> Option<Arc<NatsServer>> {
    if !nats_available() {
        return None;
    }
    static SERVER: OnceLock<Arc<NatsServer>> = OnceLock::new();
    Some(SERVER.get_or_init(|| Arc::new(NatsServer::start())).clone())
}

/// A fresh server of its own (for tests that kill it), or `None` when
/// `nats-server` is absent (outside CI).
pub fn own() -> Option<NatsServer> {
    nats_available().then(NatsServer::start)
}
