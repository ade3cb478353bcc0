//! The gateway binary as a process, for the gateway tests: start it with
//! arguments, environment and a chosen stderr; read its `listening on` line.
//! [`storm`] sends the shared channel vectors through it; [`raw`] is an upstream and
//! a client on raw TCP, for what reaches the client byte for byte.
#![allow(dead_code, unreachable_pub)]

pub mod docs;
pub mod otlp;
pub mod raw;
pub mod segments;
pub mod storm;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::ops::{Deref, DerefMut};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// The gateway binary, which cargo builds for this package's tests.
pub fn gateway_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_idempotency-gateway"))
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

/// `Stripe-Signature` for `body` at `t` (Unix seconds): `t=T,v1=` and the
/// hex HMAC-SHA256 of `T.body`, keyed with the whole `whsec_…` secret.
pub fn stripe_signature(secret: &str, t: u64, body: &[u8]) -> String {
    use ring::hmac;
    let key = hmac::Key::new(hmac::HMAC_SHA256, secret.as_bytes());
    let mut msg = format!("{t}.").into_bytes();
    msg.extend_from_slice(body);
    let hex: String = hmac::sign(&key, &msg)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("t={t},v1={hex}")
}

/// A running gateway, killed on drop.
pub struct Proc {
    pub child: Child,
    pub addr: SocketAddr,
    /// Lines written to stdout after the first.
    more_stdout: Arc<Mutex<Vec<String>>>,
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
        let more_stdout: Arc<Mutex<Vec<String>>> = Arc::default();
        let more = more_stdout.clone();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let _ = tx.send(lines.next());
            for line in lines.map_while(Result::ok) {
                more.lock().unwrap().push(line);
            }
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
        Self {
            child,
            addr,
            more_stdout,
        }
    }

    /// The lines written to stdout after `listening on`.
    pub fn more_stdout(&self) -> Vec<String> {
        self.more_stdout.lock().unwrap().clone()
    }

    /// Waits for the gateway to exit; panics after `within`.
    pub fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the gateway did not exit within {within:?}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Sends `sig` to the gateway.
    pub fn signal(&self, sig: libc::c_int) {
        let pid = libc::pid_t::try_from(self.child.id()).unwrap();
        // SAFETY: kill(2) with a pid this test spawned and still owns.
        #[allow(unsafe_code)]
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

/// A gateway in front of an upstream, its stderr kept in a temporary file
/// and printed if the test fails.
pub struct Gateway {
    proc: Proc,
    log: PathBuf,
}

impl Gateway {
    /// `--listen 127.0.0.1:0 --upstream UPSTREAM ARGS...`
    pub fn start(upstream: &str, args: &[&str]) -> Self {
        let mut all = vec!["--listen", "127.0.0.1:0", "--upstream", upstream];
        all.extend_from_slice(args);
        let log = temp_path("log");
        let stderr = Stdio::from(std::fs::File::create(&log).unwrap());
        Self {
            proc: Proc::start(&all, &[], stderr),
            log,
        }
    }

    /// `http://ADDR{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.proc.addr)
    }

    /// What the gateway wrote to stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Deref for Gateway {
    type Target = Proc;

    fn deref(&self) -> &Proc {
        &self.proc
    }
}

impl DerefMut for Gateway {
    fn deref_mut(&mut self) -> &mut Proc {
        &mut self.proc
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "---- gateway {} stderr ----\n{}",
                self.proc.addr,
                self.log()
            );
        }
        let _ = std::fs::remove_file(&self.log);
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 request (its raw bytes) over a fresh connection; the whole
/// answer as text, read until the server closes.
pub fn raw_http(addr: SocketAddr, request: impl AsRef<[u8]>) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    stream.write_all(request.as_ref()).unwrap();
    let mut out = Vec::new();
    let _ = stream.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// `GET path` with `Connection: close`; the status code and the body.
pub fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let text = raw_http(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n"),
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

/// Runs `cmd`: exit status 2, nothing on stdout, `hint` in the message.
pub fn exits_2(mut cmd: Command, hint: &str) {
    let out = cmd
        .env("RUST_LOG", "off")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{cmd:?}: {stderr}");
    assert!(
        stderr.starts_with("idempotency-gateway: "),
        "{cmd:?}: {stderr}"
    );
    assert!(stderr.contains(hint), "{cmd:?}: {stderr:?} lacks {hint:?}");
    assert!(out.stdout.is_empty(), "{cmd:?}");
}

/// The tests of one binary that push a storm through the gateway (or take
/// brokers down under one) run alone: on a small machine, a storm and what
/// another test starts beside it (a broker of its own, a gateway killed
/// and restarted) compete for the cores, and a timing a storm asserts (every
/// copy acknowledged at its first try, within the broker's bound) is then
/// the other test's, not the gateway's. Every other test of such a binary
/// holds [`beside_storms`]. A test that panicked releases its hold too.
pub async fn one_storm_at_a_time() -> tokio::sync::RwLockWriteGuard<'static, ()> {
    STORMS.write().await
}

/// What a test of a binary with storms holds while it runs: any number of
/// them run together, never beside a storm (see [`one_storm_at_a_time`]).
pub async fn beside_storms() -> tokio::sync::RwLockReadGuard<'static, ()> {
    STORMS.read().await
}

static STORMS: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// `--queue-secret-file` of this test process's gateways on a shared queue
/// (Redis Streams, RabbitMQ, NATS), which refuse to start without one: one
/// file of 32 bytes, readable by its owner only, the same for every
/// gateway (those of one queue must share it).
pub fn queue_secret() -> &'static str {
    static FILE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    FILE.get_or_init(|| {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let path = temp_path("shared-queue-secret");
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .unwrap();
        file.write_all(b"shared-queue-secret-of-the-gateway-tests-0123456789\n")
            .unwrap();
        path.display().to_string()
    })
}
