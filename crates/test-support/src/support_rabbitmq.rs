//! Test support: a real `rabbitmq-server` on free loopback ports, in a temp
//! directory of its own (its node name, Mnesia and log directories, a HOME
//! with its own Erlang cookie, and its own `epmd`), killed on drop.
//!
//! If `rabbitmq-server` is not installed, the RabbitMQ tests panic when the
//! `CI` environment variable is set (CI must run them) and are skipped with
//! a loud warning otherwise.

use crate::common::{port, server};

use port::free_port;
use server::{Process, Ready};

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// The broker's start script (the package's `/usr/sbin/rabbitmq-server`
/// wraps it to run as the `rabbitmq` user in `/var/lib/rabbitmq`).
const SERVER: &str = "/usr/lib/rabbitmq/bin/rabbitmq-server";

/// Whether the broker is installed; panics under CI if it is not.
pub fn rabbitmq_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        server::installed(
            Path::new(SERVER).exists() && Command::new("epmd").arg("-help").output().is_ok(),
            &format!("{SERVER} (and epmd)"),
            "apt-get install -y rabbitmq-server",
        )
    })
}

/// Whether an AMQP 0-9-1 broker answers on `port`: the protocol header
/// sent, a `connection.start` method frame back.
pub fn amqp_answers(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(
        &format!("127.0.0.1:{port}").parse().unwrap(),
        Duration::from_millis(300),
    ) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"AMQP\x00\x00\x09\x01").is_err() {
        return false;
    }
    let mut head = [0u8; 11];
    // Frame type 1 (method) on channel 0; class 10 (connection), method 10
    // (start).
    s.read_exact(&mut head).is_ok() && head[0] == 1 && head[7..11] == [0, 10, 0, 10]
}

/// One broker: `epmd` and `rabbitmq-server` as children, the broker in a
/// process group of its own.
#[derive(Debug)]
pub struct RabbitServer {
    process: Option<Process>,
    epmd: Option<Process>,
    port: u16,
    dist_port: u16,
    epmd_port: u16,
    dir: PathBuf,
}

impl RabbitServer {
    /// Starts a broker on free loopback ports (it takes a few seconds).
    pub fn start() -> Self {
        for _ in 0..5 {
            let port = free_port();
            let dir = server::temp_dir("rabbitmq", &port.to_string());
            for sub in ["home", "mnesia", "log"] {
                std::fs::create_dir_all(dir.join(sub)).unwrap();
            }
            let cookie = dir.join("home/.erlang.cookie");
            std::fs::write(&cookie, format!("cookie{port}{}", std::process::id())).unwrap();
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&cookie, std::fs::Permissions::from_mode(0o400)).unwrap();
            }
            std::fs::write(dir.join("enabled_plugins"), "[].\n").unwrap();
            let mut server = Self {
                process: None,
                epmd: None,
                port,
                dist_port: free_port(),
                epmd_port: free_port(),
                dir,
            };
            if server.spawn() {
                return server;
            }
            server.kill();
        }
        panic!("could not start rabbitmq-server after 5 attempts");
    }

    fn spawn(&mut self) -> bool {
        use std::os::unix::process::CommandExt;
        if self.epmd.is_none() {
            self.epmd = Command::new("epmd")
                .args(["-port", &self.epmd_port.to_string()])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .ok()
                .map(|epmd| Process::watched(epmd, ""));
        }
        let d = &self.dir;
        let mut cmd = Command::new(SERVER);
        cmd.current_dir(d)
            .env("HOME", d.join("home"))
            .env("ERL_EPMD_PORT", self.epmd_port.to_string())
            .env(
                "RABBITMQ_NODENAME",
                format!("rabbit-{}@localhost", self.port),
            )
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", d.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", d.join("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d.join("enabled_plugins"))
            .env("RABBITMQ_CONFIG_FILE", d.join("rabbitmq"))
            .env("RABBITMQ_ADVANCED_CONFIG_FILE", d.join("advanced.config"))
            .env("RABBITMQ_PID_FILE", d.join("rabbit.pid"))
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::from(
                std::fs::File::create(d.join("out.log")).unwrap(),
            ))
            .stderr(Stdio::null());
        let mut child = cmd.spawn().expect("spawn rabbitmq-server");
        // A few seconds on a quiet machine; far more on a loaded one.
        let ready = server::wait_ready(
            &mut child,
            Duration::from_secs(120),
            Duration::from_millis(100),
            || amqp_answers(self.port),
        );
        // The whole group is killed on drop unless it answers.
        let process = Process::watched_group(child, &format!("rm -rf '{}'", d.display()));
        if ready == Ready::Up {
            self.process = Some(process);
        }
        ready == Ready::Up
    }

    /// The AMQP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `amqp://guest:guest@127.0.0.1:PORT/%2f` (RabbitMQ's default user,
    /// allowed from loopback).
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// A new virtual host `name` that `guest` may use (so that tests
    /// sharing this broker do not share a queue name); its URL.
    pub fn vhost(&self, name: &str) -> String {
        let ctl = |args: &[&str]| {
            let out = Command::new("/usr/lib/rabbitmq/bin/rabbitmqctl")
                .args(["-n", &format!("rabbit-{}@localhost", self.port)])
                .args(args)
                .env("HOME", self.dir.join("home"))
                .env("ERL_EPMD_PORT", self.epmd_port.to_string())
                .stdin(Stdio::null())
                .output()
                .expect("run rabbitmqctl");
            assert!(
                out.status.success(),
                "rabbitmqctl {args:?}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        };
        ctl(&["add_vhost", name]);
        ctl(&["set_permissions", "-p", name, "guest", ".*", ".*", ".*"]);
        format!("amqp://guest:guest@127.0.0.1:{}/{name}", self.port)
    }

    /// Kills the broker with SIGKILL (the start script and the Erlang VM,
    /// one process group); `epmd` stays. What it confirmed is on disk.
    pub fn kill(&mut self) {
        self.process = None;
    }

    /// Freezes the broker (SIGSTOP to its process group, `thaw` undoes
    /// it): its connections stay open and nothing on them is answered, as
    /// with a broker stuck on a full disk or a link that drops packets.
    pub fn freeze(&self) {
        self.signal("-STOP");
    }

    /// Lets a frozen broker run again (SIGCONT).
    pub fn thaw(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        let group = self.process.as_ref().expect("the broker runs").id();
        let ok = Command::new("kill")
            .args([sig, "--", &format!("-{group}")])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill {sig} the broker's process group {group}");
    }

    /// Starts the broker again on the same ports and data.
    pub fn restart(&mut self) {
        assert!(self.process.is_none(), "restart a killed broker only");
        assert!(
            self.spawn(),
            "rabbitmq-server did not restart on {}",
            self.port
        );
    }
}

impl Drop for RabbitServer {
    fn drop(&mut self) {
        self.kill();
        self.epmd = None;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A broker shared by every test of this binary (use distinct queue names),
/// started once on first use; its watchdog stops it when the test process
/// exits. `None` when RabbitMQ is not installed (see
/// [`rabbitmq_available`]).
pub fn shared_rabbitmq() -> Option<Arc<RabbitServer>> {
    static SLOT: Mutex<Option<Arc<RabbitServer>>> = Mutex::new(None);
    if !rabbitmq_available() {
        return None;
    }
    let mut slot = SLOT.lock().unwrap_or_else(|p| p.into_inner());
    Some(
        slot.get_or_insert_with(|| Arc::new(RabbitServer::start()))
            .clone(),
    )
}
