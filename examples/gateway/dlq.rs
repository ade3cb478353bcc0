//! `gateway dlq list` and `gateway dlq replay ID|--all`: the dead letters
//! of the queue that `--queue`/`--data-dir` name.

use crate::ack::QueueSettings;
use clap::Subcommand;
use std::io::Write;
use tower_idempotency::queue::{EntryId, Queue};

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
    /// Queue dead letters again (each at most once), due at once with fresh attempts
    Replay {
        /// The dead letter's ID (from `dlq list`)
        #[arg(
            value_name = "ID",
            required_unless_present = "all",
            conflicts_with = "all"
        )]
        id: Option<String>,
        /// Every dead letter
        #[arg(long)]
        all: bool,
    },
}

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
        let queue = settings.open().await?;
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
            Dlq::Replay { all: true, .. } => {
                let n = queue.replay_all().await.map_err(|e| e.to_string())?;
                writeln!(out, "replayed {n}").map_err(write)?;
            }
            Dlq::Replay { id, .. } => {
                let id = EntryId::new(id.clone().unwrap_or_default());
                if !queue.replay(&id).await.map_err(|e| e.to_string())? {
                    return Err(format!("no dead letter {id} (already replayed?)"));
                }
                writeln!(out, "replayed {id}").map_err(write)?;
            }
        }
        Ok(())
    })
}
