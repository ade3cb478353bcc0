//! `gateway dlq list` and `gateway dlq replay ID|--all|--since T --route P
//! --error TEXT [--dry-run]`: the dead letters of the queue that
//! `--queue`/`--data-dir` name.

use crate::ack::QueueSettings;
use clap::Subcommand;
use std::io::Write;
use tower_idempotency_queue::{EntryId, Queue};

/// Subcommands.
#[derive(Subcommand, Debug, Clone)]
pub enum Command {
    /// The dead letters of the queue (stop a gateway using the embedded queue first)
    Dlq {
        #[command(subcommand)]
        action: Dlq,
    },
    /// What the running gateway holds for a key: its record and its journal
    Inspect(crate::admin_cli::Inspect),
    /// Delete a completed record in the running gateway's store, so the next copy runs again
    Forget(crate::admin_cli::Forget),
    /// The running gateway's journal of notifications, by time, route and outcome
    Journal(crate::admin_cli::Journal),
    /// The channel's downloaded trade bill against the running gateway's journal: paid
    /// transactions that never ran, ran more than once or with another amount (exit 1 if any)
    Reconcile(crate::reconcile::Reconcile),
}

/// What to do with the dead letters.
#[derive(Subcommand, Debug, Clone)]
pub enum Dlq {
    /// One line per dead letter, oldest first: ID, attempts, when, key, path, last error
    List {
        /// At most this many
        #[arg(long, value_name = "N", default_value_t = 1000)]
        limit: usize,
    },
    /// Queue dead letters again (each at most once), due at once with fresh attempts:
    /// one by ID, --all, or those the filters select
    Replay {
        /// The dead letter's ID (from `dlq list`)
        #[arg(
            value_name = "ID",
            required_unless_present_any = ["all", "since", "until", "route", "error"],
            conflicts_with_all = ["all", "since", "until", "route", "error"]
        )]
        id: Option<String>,
        /// Every dead letter
        #[arg(long)]
        all: bool,
        /// Dead-lettered at or after T (RFC 3339, or ms since the epoch)
        #[arg(long, value_name = "T", conflicts_with = "all")]
        since: Option<String>,
        /// Dead-lettered at or before T
        #[arg(long, value_name = "T", conflicts_with = "all")]
        until: Option<String>,
        /// Only notifications whose path is under this route prefix
        #[arg(long, value_name = "PREFIX", conflicts_with = "all")]
        route: Option<String>,
        /// Only those whose last error contains TEXT
        #[arg(long, value_name = "TEXT", conflicts_with = "all")]
        error: Option<String>,
        /// Count what the filters select, replay nothing
        #[arg(long)]
        dry_run: bool,
        /// Replay dead letters that failed authentication (error `unauthenticated`) too;
        /// without it they are refused. One with no MAC (queued by an earlier version) is
        /// delivered only while `queue_accept_unsigned` is on; any other is dead-lettered again
        #[arg(long)]
        force: bool,
    },
}

/// Whether `d` was dead-lettered because it failed authentication.
fn unauthenticated(d: &tower_idempotency_queue::DeadLetter) -> bool {
    d.error == tower_idempotency_queue::UNAUTHENTICATED
}

/// The filters of a bulk `dlq replay`.
struct Filter {
    since_ms: u64,
    until_ms: u64,
    route: Option<String>,
    error: Option<String>,
}

impl Filter {
    fn matches(&self, d: &tower_idempotency_queue::DeadLetter) -> bool {
        let at = d
            .dead_at
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX));
        let path = d.message.uri.path();
        at >= self.since_ms
            && at <= self.until_ms
            && self.route.as_deref().is_none_or(|r| under(path, r))
            && self.error.as_deref().is_none_or(|e| d.error.contains(e))
    }
}

/// Whether `path` is `prefix` or below it (`/notify` covers `/notify/x`,
/// not `/notifyx`).
fn under(path: &str, prefix: &str) -> bool {
    let prefix = prefix.trim_end_matches('/');
    prefix.is_empty()
        || path == prefix
        || path
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with('/'))
}

/// Dead letters read at most, for a bulk replay.
const BULK: usize = 1_000_000;

/// Runs `cmd`; `Err` is the message for exit status 1.
pub fn run(cmd: &Command, settings: &QueueSettings) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    if let crate::ack::QueueSpec::Dir(dir) = &settings.spec {
        let file = dir.join("queue.redb");
        if !file.exists() {
            return Err(format!(
                "no queue at {} (see --data-dir, --queue)",
                file.display()
            ));
        }
    }
    rt.block_on(async {
        // A RabbitMQ queue's key records are the running gateways' (in
        // their store): a replay here leaves them as they are, and the
        // delivery that follows updates them.
        let records =
            tower_idempotency::store::Either::Left(tower_idempotency::store::MemoryStore::new());
        let queue = settings.open(&records).await?;
        let Command::Dlq { action } = cmd else {
            return Err("not a dlq command".into());
        };
        let mut out = std::io::stdout().lock();
        let write = |e: std::io::Error| format!("cannot write to stdout: {e}");
        match action {
            Dlq::List { limit } => {
                let dead = queue
                    .dead_letters(*limit)
                    .await
                    .map_err(|e| e.to_string())?;
                for d in dead {
                    let when = humantime::format_rfc3339_seconds(d.dead_at);
                    let error = d.error.replace(['\n', '\t'], " ");
                    writeln!(
                        out,
                        "{}\tattempts={}\tdead_at={when}\tkey={}\tpath={}\terror={error}",
                        d.id,
                        d.attempts,
                        d.message.key,
                        d.message.uri.path()
                    )
                    .map_err(write)?;
                }
            }
            Dlq::Replay {
                id: None,
                all: false,
                since,
                until,
                route,
                error,
                dry_run,
                force,
            } => {
                let time = |t: &Option<String>, default| match t {
                    Some(t) => crate::admin_api::parse_time(t),
                    None => Ok(default),
                };
                let filter = Filter {
                    since_ms: time(since, 0)?,
                    until_ms: time(until, u64::MAX)?,
                    route: route.clone(),
                    error: error.clone(),
                };
                let dead = queue.dead_letters(BULK).await.map_err(|e| e.to_string())?;
                let chosen: Vec<_> = dead
                    .iter()
                    .filter(|d| filter.matches(d) && (*force || !unauthenticated(d)))
                    .collect();
                if *dry_run {
                    writeln!(
                        out,
                        "would replay {} of {} dead letters",
                        chosen.len(),
                        dead.len()
                    )
                    .map_err(write)?;
                    return Ok(());
                }
                let mut n = 0;
                for d in chosen {
                    n += usize::from(queue.replay(&d.id).await.map_err(|e| e.to_string())?);
                }
                writeln!(out, "replayed {n}").map_err(write)?;
            }
            Dlq::Replay {
                all: true,
                force: true,
                ..
            } => {
                let n = queue.replay_all().await.map_err(|e| e.to_string())?;
                writeln!(out, "replayed {n}").map_err(write)?;
            }
            Dlq::Replay { all: true, .. } => {
                let dead = queue.dead_letters(BULK).await.map_err(|e| e.to_string())?;
                let (mut n, mut refused) = (0, 0);
                for d in &dead {
                    if unauthenticated(d) {
                        refused += 1;
                    } else {
                        n += usize::from(queue.replay(&d.id).await.map_err(|e| e.to_string())?);
                    }
                }
                writeln!(out, "replayed {n}").map_err(write)?;
                if refused > 0 {
                    eprintln!("{refused} dead letters failed authentication (`unauthenticated`) and were not replayed (--force replays them)");
                }
            }
            Dlq::Replay { id, force, .. } => {
                let id = EntryId::new(id.clone().unwrap_or_default());
                if !force {
                    let dead = queue.dead_letters(BULK).await.map_err(|e| e.to_string())?;
                    if dead.iter().any(|d| d.id == id && unauthenticated(d)) {
                        return Err(format!(
                            "dead letter {id} failed authentication (`unauthenticated`): it was not queued by a gateway holding this queue's key; replay it with --force only if you know where it came from"
                        ));
                    }
                }
                if !queue.replay(&id).await.map_err(|e| e.to_string())? {
                    return Err(format!("no dead letter {id} (already replayed?)"));
                }
                writeln!(out, "replayed {id}").map_err(write)?;
            }
        }
        Ok(())
    })
}
