//! Test support: real `nats-server -js` processes on free loopback ports,
//! their JetStream files in temp dirs, killed on drop.
//!
//! If `nats-server` is not on PATH, the NATS tests panic when the `CI`
//! environment variable is set (CI must run them) and are skipped with a
//! loud warning otherwise.

use crate::common::{port, server};

use port::free_port;
use server::{Process, Ready};

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Whether `nats-server` is there; panics under CI if it is not.
pub fn nats_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let works = Command::new("nats-server")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        server::installed(
            works,
            "nats-server (on PATH)",
            "apt-get install -y nats-server",
        )
    })
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
    process: Option<Process>,
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
                process: None,
                port,
                dir: server::temp_dir("nats", &format!("js-{port}")),
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
        let auth = self.auth();
        let ready = server::wait_ready(
            &mut child,
            Duration::from_secs(15),
            Duration::from_millis(30),
            || jetstream_ready(self.port, &auth),
        );
        // Killed on drop unless it answers.
        let process = Process::watched(child, "");
        if ready == Ready::Up {
            self.process = Some(process);
        }
        ready == Ready::Up
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
        self.process.as_ref().map(Process::id)
    }

    /// Kills the server with SIGKILL (no flush, no shutdown).
    pub fn kill(&mut self) {
        self.process = None;
    }

    /// Starts the server again on the same port and store directory.
    pub fn restart(&mut self) {
        assert!(self.process.is_none(), "restart a stopped server only");
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
