//! Test support: real PostgreSQL and MariaDB servers on free loopback
//! ports, each in its own temp directory, killed on drop (and by a watchdog
//! when the test process is gone), and SQLite files in temp directories.
//!
//! If the server binaries are missing, the tests that need them panic when
//! the `CI` environment variable is set (CI must run them) and are skipped
//! with a loud warning otherwise. Debian: `apt-get install -y postgresql
//! mariadb-server` (PostgreSQL's binaries are found in
//! `/usr/lib/postgresql/*/bin` when they are not on PATH). As root,
//! PostgreSQL runs as the `postgres` user.

use crate::common::{port, server};

use port::free_port;
use server::{Process, Ready};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

fn on_path(bin: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join(bin))
            .find(|p| p.is_file())
    })
}

/// The directory of PostgreSQL's `initdb` and `postgres`.
fn pg_bin() -> Option<PathBuf> {
    static BIN: OnceLock<Option<PathBuf>> = OnceLock::new();
    BIN.get_or_init(|| {
        if let (Some(initdb), Some(_)) = (on_path("initdb"), on_path("postgres")) {
            return initdb.parent().map(Path::to_path_buf);
        }
        let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
            .filter(|d| d.join("initdb").is_file() && d.join("postgres").is_file())
            .collect();
        dirs.sort();
        dirs.pop()
    })
    .clone()
}

/// Whether PostgreSQL is installed; panics under CI if not.
pub fn postgres_available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        server::installed(
            pg_bin().is_some(),
            "PostgreSQL (initdb, postgres)",
            "apt-get install -y postgresql",
        )
    })
}

/// Whether MariaDB is installed; panics under CI if not.
pub fn mariadb_available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        server::installed(
            on_path("mariadbd").is_some() && on_path("mariadb-install-db").is_some()
                || Path::new("/usr/sbin/mariadbd").is_file(),
            "MariaDB (mariadbd, mariadb-install-db)",
            "apt-get install -y mariadb-server",
        )
    })
}

fn mariadbd() -> PathBuf {
    on_path("mariadbd").unwrap_or_else(|| PathBuf::from("/usr/sbin/mariadbd"))
}

/// A fresh directory under the system temp dir.
pub fn temp_dir(tag: &str) -> PathBuf {
    server::temp_dir("sql", tag)
}

fn is_root() -> bool {
    // The effective uid, from /proc (no unsafe libc call in tests).
    std::fs::read_to_string("/proc/self/status").is_ok_and(|status| {
        status
            .lines()
            .find(|l| l.starts_with("Uid:"))
            .and_then(|l| l.split_whitespace().nth(2))
            == Some("0")
    })
}

/// The uid and gid of `user`, from /etc/passwd.
fn user_ids(user: &str) -> Option<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|line| {
        let f: Vec<&str> = line.split(':').collect();
        (f.len() > 3 && f[0] == user).then(|| Some((f[2].parse().ok()?, f[3].parse().ok()?)))?
    })
}

/// `child`, watched: once this test process is gone (servers held in
/// statics are never dropped) it is killed and `dir` removed, the removal
/// tried again while the server's children are still writing into it.
fn watched(child: Child, dir: &Path) -> Process {
    let cleanup = format!(
        "for i in 1 2 3 4 5 6 7 8 9 10; do sleep 0.3; rm -rf '{dir}' 2>/dev/null; \
         [ -e '{dir}' ] || break; done",
        dir = dir.display()
    );
    Process::watched(child, &cleanup)
}

/// Waits until `log` contains `ready` (false if the child exits first).
fn wait_ready(child: &mut Child, log: &Path, ready: &str, what: &str) -> bool {
    let answers = || std::fs::read_to_string(log).is_ok_and(|l| l.contains(ready));
    match server::wait_ready(
        child,
        Duration::from_secs(60),
        Duration::from_millis(50),
        answers,
    ) {
        Ready::Up => true,
        Ready::Exited => false,
        Ready::TimedOut => panic!(
            "{what} did not start within 60 s: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        ),
    }
}

/// One database server process.
#[derive(Debug)]
pub struct DbServer {
    process: Option<Process>,
    dir: PathBuf,
    url: String,
}

impl DbServer {
    /// The connection URL (`postgres://…` or `mysql://…`).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Starts a PostgreSQL server (`initdb` into a temp dir, then
    /// `postgres`), as the `postgres` user when this process is root.
    pub fn postgres() -> Self {
        let bin = pg_bin().expect("postgres binaries");
        let dir = temp_dir("pg");
        let data = dir.join("data");
        let ids = if is_root() {
            user_ids("postgres")
        } else {
            None
        };
        if is_root() {
            let (uid, gid) = ids.expect("a `postgres` user (the Debian package creates it)");
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).expect("chown temp dir");
        }
        let as_user = |cmd: &mut Command| {
            if let Some((uid, gid)) = ids {
                cmd.uid(uid).gid(gid);
            }
        };
        let mut init = Command::new(bin.join("initdb"));
        init.arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"])
            .stdin(Stdio::null());
        as_user(&mut init);
        let out = init.output().expect("run initdb");
        assert!(
            out.status.success(),
            "initdb failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        for _ in 0..10 {
            let port = free_port();
            let log = dir.join(format!("postgres-{port}.log"));
            let log_file = std::fs::File::create(&log).expect("log file");
            if let Some((uid, gid)) = ids {
                let _ = std::os::unix::fs::chown(&log, Some(uid), Some(gid));
            }
            let mut cmd = Command::new(bin.join("postgres"));
            cmd.arg("-D")
                .arg(&data)
                .args(["-p", &port.to_string()])
                .arg("-k")
                .arg(&dir)
                .args(["-c", "listen_addresses=127.0.0.1"])
                .args(["-c", "fsync=off", "-c", "synchronous_commit=off"])
                .args(["-c", "full_page_writes=off", "-c", "max_connections=300"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log_file);
            as_user(&mut cmd);
            let mut child = cmd.spawn().expect("spawn postgres");
            if wait_ready(&mut child, &log, "ready to accept connections", "postgres") {
                return Self {
                    process: Some(watched(child, &dir)),
                    url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
                    dir,
                };
            }
        }
        panic!("could not start postgres after 10 attempts");
    }

    /// Starts a MariaDB server (`mariadb-install-db` into a temp dir, then
    /// `mariadbd`), with a database `idem` and no authentication.
    pub fn mariadb() -> Self {
        let dir = temp_dir("mariadb");
        let data = dir.join("data");
        let mut install = Command::new("mariadb-install-db");
        install
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .args(["--auth-root-authentication-method=normal", "--skip-test-db"])
            .stdin(Stdio::null());
        if is_root() {
            install.arg("--user=root");
        }
        let out = install.output().expect("run mariadb-install-db");
        assert!(
            out.status.success(),
            "mariadb-install-db failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        // A database is a directory of the data dir.
        std::fs::create_dir_all(data.join("idem")).expect("create database dir");
        for _ in 0..10 {
            let port = free_port();
            let log = dir.join(format!("mariadb-{port}.log"));
            let mut cmd = Command::new(mariadbd());
            cmd.arg("--no-defaults")
                .arg(format!("--datadir={}", data.display()))
                .arg(format!("--socket={}", dir.join("mysqld.sock").display()))
                .arg(format!("--port={port}"))
                .arg(format!("--log-error={}", log.display()))
                .arg(format!("--pid-file={}", dir.join("mysqld.pid").display()))
                .args(["--bind-address=127.0.0.1", "--skip-grant-tables"])
                .args(["--innodb-flush-log-at-trx-commit=2", "--skip-log-bin"])
                .args(["--innodb-buffer-pool-size=64M", "--max-connections=500"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            if is_root() {
                cmd.arg("--user=root");
            }
            let mut child = cmd.spawn().expect("spawn mariadbd");
            if wait_ready(&mut child, &log, "ready for connections", "mariadbd") {
                return Self {
                    process: Some(watched(child, &dir)),
                    url: format!("mysql://root@127.0.0.1:{port}/idem"),
                    dir,
                };
            }
        }
        panic!("could not start mariadbd after 10 attempts");
    }
}

impl Drop for DbServer {
    fn drop(&mut self) {
        self.process = None;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn shared(slot: &Mutex<Option<Arc<DbServer>>>, start: fn() -> DbServer) -> Arc<DbServer> {
    let mut slot = slot.lock().unwrap_or_else(|p| p.into_inner());
    slot.get_or_insert_with(|| Arc::new(start())).clone()
}

/// A PostgreSQL server shared by every test of this binary (use distinct
/// keys); `None` when PostgreSQL is not installed.
pub fn shared_postgres() -> Option<Arc<DbServer>> {
    static SLOT: Mutex<Option<Arc<DbServer>>> = Mutex::new(None);
    postgres_available().then(|| shared(&SLOT, DbServer::postgres))
}

/// A MariaDB server shared like [`shared_postgres`].
pub fn shared_mariadb() -> Option<Arc<DbServer>> {
    static SLOT: Mutex<Option<Arc<DbServer>>> = Mutex::new(None);
    mariadb_available().then(|| shared(&SLOT, DbServer::mariadb))
}

/// A SQLite database file in a fresh temp dir, removed on drop.
#[derive(Debug)]
pub struct SqliteFile {
    dir: PathBuf,
}

impl Default for SqliteFile {
    fn default() -> Self {
        Self::new()
    }
}

impl SqliteFile {
    /// A new, empty location.
    pub fn new() -> Self {
        Self {
            dir: temp_dir("sqlite"),
        }
    }

    /// The database file.
    pub fn path(&self) -> PathBuf {
        self.dir.join("idem.db")
    }

    /// `sqlite:PATH`.
    pub fn url(&self) -> String {
        format!("sqlite:{}", self.path().display())
    }
}

impl Drop for SqliteFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
