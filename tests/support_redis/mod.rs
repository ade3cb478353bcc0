//! Test support: real `redis-server` processes on free loopback ports,
//! standalone or as a 3-master Cluster, killed on drop.
//!
//! If `redis-server` / `redis-cli` are not on PATH, the Redis tests panic when
//! the `CI` environment variable is set (CI must run them) and are skipped
//! with a loud warning otherwise.
#![allow(dead_code, unreachable_pub)]

// Shared with `common`; a test may include both.
#[allow(clippy::duplicate_mod)]
#[path = "../common/port.rs"]
mod port;

use port::free_port;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Whether the Redis binaries are there; panics under CI if they are not.
pub fn redis_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    let available = *AVAILABLE.get_or_init(|| {
        let works = |bin: &str| {
            Command::new(bin)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        works("redis-server") && works("redis-cli")
    });
    if !available {
        if std::env::var_os("CI").is_some() {
            panic!(
                "redis-server / redis-cli are not on PATH but CI is set: CI must run the Redis \
                 tests (apt-get install -y redis-server redis-tools)"
            );
        }
        // Written to the real stderr (not `eprintln!`, which the test
        // harness captures), once per test binary.
        static WARNED: OnceLock<()> = OnceLock::new();
        WARNED.get_or_init(|| {
            let _ = writeln!(
                std::io::stderr(),
                "\n\
                 ************************************************************************\n\
                 WARNING: redis-server / redis-cli not found on PATH: SKIPPING the Redis\n\
                 tests (they pass without running). Install them to run them:\n\
                 apt-get install -y redis-server redis-tools\n\
                 ************************************************************************\n"
            );
        });
    }
    available
}

fn temp_dir(tag: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "tower-idempotency-redis-{}-{}-{tag}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

/// Sends one inline command and returns the raw reply (up to 64 KiB).
pub fn raw_command(port: u16, cmd: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect_timeout(
        &format!("127.0.0.1:{port}").parse().unwrap(),
        Duration::from_millis(500),
    )?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.write_all(format!("{cmd}\r\n").as_bytes())?;
    let mut buf = vec![0u8; 65536];
    let mut len = 0;
    // Read until a full reply line (or bulk) has arrived.
    loop {
        let n = s.read(&mut buf[len..])?;
        if n == 0 {
            break;
        }
        len += n;
        let text = String::from_utf8_lossy(&buf[..len]);
        if let Some(rest) = text.strip_prefix('$') {
            if let Some((size, body)) = rest.split_once("\r\n") {
                let size: usize = size.parse().unwrap_or(0);
                if body.len() >= size + 2 {
                    break;
                }
                continue;
            }
        } else if text.ends_with("\r\n") {
            break;
        }
    }
    Ok(String::from_utf8_lossy(&buf[..len]).into_owned())
}

/// One `redis-server` child process.
#[derive(Debug)]
pub struct RedisServer {
    child: Option<Child>,
    watchdog: Option<Child>,
    port: u16,
    dir: PathBuf,
    extra: Vec<String>,
}

impl RedisServer {
    /// Starts a standalone server on a free loopback port.
    pub fn start() -> Self {
        Self::start_with(Vec::new(), "standalone")
    }

    fn start_with(extra: Vec<String>, tag: &str) -> Self {
        for _ in 0..10 {
            let port = free_port();
            let dir = temp_dir(&format!("{tag}-{port}"));
            let mut server = Self {
                child: None,
                watchdog: None,
                port,
                dir,
                extra: extra.clone(),
            };
            if server.spawn() {
                return server;
            }
        }
        panic!("could not start redis-server after 10 attempts");
    }

    /// Starts the process on `self.port`; false if it did not come up.
    fn spawn(&mut self) -> bool {
        let mut cmd = Command::new("redis-server");
        cmd.arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .args(["--daemonize", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(self.dir.join("redis.log"))
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut child = cmd.spawn().expect("spawn redis-server");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                // Exited: the port was taken, most likely.
                return false;
            }
            if raw_command(self.port, "PING").is_ok_and(|r| r.starts_with("+PONG")) {
                self.watchdog = watchdog(child.id());
                self.child = Some(child);
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:port/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Stops the server after saving its data set (`SHUTDOWN SAVE`), as a
    /// restart of a Redis with persistence would.
    pub fn stop(&mut self) {
        self.shutdown("SHUTDOWN SAVE");
    }

    /// Stops the server without saving (`SHUTDOWN NOSAVE`) and deletes any
    /// data set saved before: a restart after it is a restart of a Redis
    /// without persistence.
    pub fn stop_without_saving(&mut self) {
        self.shutdown("SHUTDOWN NOSAVE");
        let _ = std::fs::remove_file(self.dir.join("dump.rdb"));
    }

    fn shutdown(&mut self, command: &str) {
        self.kill_watchdog();
        let _ = raw_command(self.port, command);
        if let Some(mut child) = self.child.take() {
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port and directory (it loads the
    /// data set saved by [`stop`](Self::stop)).
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "restart a stopped server only");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.spawn() {
            assert!(
                Instant::now() < deadline,
                "redis-server did not restart on port {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl RedisServer {
    fn kill_watchdog(&mut self) {
        if let Some(mut w) = self.watchdog.take() {
            let _ = w.kill();
            let _ = w.wait();
        }
    }
}

/// A shell that kills `server_pid` once this test process is gone, so that
/// servers held in statics (never dropped) or left by a killed test binary
/// do not outlive it.
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

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill_watchdog();
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Three masters, no replicas, all 16384 slots assigned.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts three nodes and joins them with `redis-cli --cluster create`.
    pub fn start() -> Self {
        let nodes: Vec<RedisServer> = (0..3)
            .map(|_| {
                let extra = vec![
                    "--cluster-enabled".to_owned(),
                    "yes".to_owned(),
                    "--cluster-config-file".to_owned(),
                    "nodes.conf".to_owned(),
                    // The bus port defaults to port + 10000, which may be
                    // taken or out of range for an ephemeral port.
                    "--cluster-port".to_owned(),
                    free_port().to_string(),
                    "--cluster-node-timeout".to_owned(),
                    "2000".to_owned(),
                ];
                RedisServer::start_with(extra, "cluster")
            })
            .collect();
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for node in &nodes {
            create.arg(format!("127.0.0.1:{}", node.port));
        }
        let out = create
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = Self { nodes };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ok = cluster.nodes.iter().all(|n| {
                raw_command(n.port, "CLUSTER INFO").is_ok_and(|r| r.contains("cluster_state:ok"))
            });
            if ok {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "cluster did not reach cluster_state:ok"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        cluster
    }

    /// `redis://127.0.0.1:port/` of every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The nodes.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }
}

fn shared<T>(slot: &Mutex<Option<Arc<T>>>, start: impl FnOnce() -> T) -> Arc<T> {
    let mut slot = slot.lock().unwrap_or_else(|p| p.into_inner());
    slot.get_or_insert_with(|| Arc::new(start())).clone()
}

/// A standalone server shared by every test of this binary (use distinct
/// keys). Started on first use; its watchdog stops it when the test process
/// exits. `None` when Redis is not installed (see [`redis_available`]).
pub fn shared_standalone() -> Option<Arc<RedisServer>> {
    static SLOT: Mutex<Option<Arc<RedisServer>>> = Mutex::new(None);
    redis_available().then(|| shared(&SLOT, RedisServer::start))
}

/// A 3-master cluster shared like [`shared_standalone`].
pub fn shared_cluster() -> Option<Arc<RedisCluster>> {
    static SLOT: Mutex<Option<Arc<RedisCluster>>> = Mutex::new(None);
    redis_available().then(|| shared(&SLOT, RedisCluster::start))
}
