//! Test support: real `redis-server` processes on free loopback ports,
//! standalone or as a 3-master Cluster, killed on drop.
//!
//! If `redis-server` / `redis-cli` are not on PATH, the Redis tests panic when
//! the `CI` environment variable is set (CI must run them) and are skipped
//! with a loud warning otherwise.

use crate::common::{port, server};

use port::free_port;
use server::{Process, Ready};

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Whether the Redis binaries are there; panics under CI if they are not.
pub fn redis_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let works = |bin: &str| {
            Command::new(bin)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        server::installed(
            works("redis-server") && works("redis-cli"),
            "redis-server / redis-cli (on PATH)",
            "apt-get install -y redis-server redis-tools",
        )
    })
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
    process: Option<Process>,
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
            let dir = server::temp_dir("redis", &format!("{tag}-{port}"));
            let mut server = Self {
                process: None,
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
        let ready = server::wait_ready(
            &mut child,
            Duration::from_secs(10),
            Duration::from_millis(20),
            || raw_command(self.port, "PING").is_ok_and(|r| r.starts_with("+PONG")),
        );
        // Killed on drop unless it answers.
        let process = Process::watched(child, "");
        if ready == Ready::Up {
            self.process = Some(process);
        }
        ready == Ready::Up
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(Process::id)
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

    /// Sends `command`; kills the server if it has not exited 5 s later.
    fn shutdown(&mut self, command: &str) {
        let Some(mut process) = self.process.take() else {
            return;
        };
        process.disarm();
        let _ = raw_command(self.port, command);
        process.wait_exit(Duration::from_secs(5));
    }

    /// Starts the server again on the same port and directory (it loads the
    /// data set saved by [`stop`](Self::stop)).
    pub fn restart(&mut self) {
        assert!(self.process.is_none(), "restart a stopped server only");
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

impl Drop for RedisServer {
    fn drop(&mut self) {
        // Killed first: it may still write into its directory.
        self.process = None;
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
