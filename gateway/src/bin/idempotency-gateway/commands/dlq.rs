//! `idempotency-gateway dlq list|show|replay|delete`: the dead letters, through the
//! running gateway's admin API (its token from `--admin-token-file`, its
//! environment variable or the config file), found as `inspect` finds it;
//! with `--offline` only, directly on the queue that `--queue`/`--data-dir`
//! name, for a stopped gateway.

use crate::admin::dead::{ms_of, DeadFilter};
use crate::commands::client::{call, enc, failed, query, AdminAt, Format, Target};
use crate::commands::escape::{shown, shown_bytes};
use crate::start::ack::QueueSettings;
use clap::{Args, Subcommand};
use http::Method;
use serde_json::Value;
use std::io::Write;
use std::path::Path;
use tower_idempotency_queue::{DeadLetter, EntryId, Queue};

/// Subcommands.
#[derive(Subcommand, Debug, Clone)]
pub(crate) enum Command {
    /// The dead letters: through the running gateway's admin API (--config FILE, the
    /// gateway's own), or with --offline directly on the queue of a stopped gateway
    Dlq {
        /// Read and change the queue directly (--data-dir, --queue), not through the
        /// running gateway's admin API: stop a gateway using the embedded queue first
        #[arg(long, global = true)]
        offline: bool,
        #[command(subcommand)]
        action: Dlq,
    },
    /// What the running gateway holds for a key: its record and its journal
    Inspect(crate::commands::client::Inspect),
    /// Delete a completed record in the running gateway's store, so the next copy runs again
    Forget(crate::commands::client::Forget),
    /// The running gateway's journal of notifications, by time, route and outcome
    Journal(crate::commands::client::Journal),
    /// The channel's downloaded trade bill against the running gateway's journal: paid
    /// transactions that never ran, ran more than once or with another amount (exit 1 if any)
    Reconcile(crate::commands::reconcile::Reconcile),
    /// Hold a route of the running gateway: nothing reaches its upstream until `resume`
    /// (every instance on the same Redis or SQL store obeys)
    Pause(crate::commands::pause::Pause),
    /// Let a paused route of the running gateway reach its upstream again
    Resume(crate::commands::pause::Resume),
    /// Send a notification of a preset, signed as its channel signs it, and its copies;
    /// print each reply and whether it was replayed
    Send(crate::commands::send::Send),
    /// Write a test key or secret for every channel the gateway verifies to DIR, and
    /// print the routes whose `verify` lines check them
    TestKeys(crate::commands::test_keys::TestKeys),
}

/// The filters of `dlq list` and of a bulk `dlq replay`.
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct Filters {
    /// Dead-lettered at or after T (RFC 3339, or ms since the epoch)
    #[arg(long, value_name = "T")]
    since: Option<String>,
    /// Dead-lettered at or before T
    #[arg(long, value_name = "T")]
    until: Option<String>,
    /// Only notifications whose path is under this route prefix
    #[arg(long, value_name = "PREFIX")]
    route: Option<String>,
    /// Only the letters of this destination (an upstream a route's `deliver` names)
    #[arg(long, value_name = "NAME")]
    destination: Option<String>,
    /// Only those whose last error contains TEXT
    #[arg(long, value_name = "TEXT")]
    error: Option<String>,
}

impl Filters {
    fn pairs(&self) -> Vec<(&'static str, Option<&str>)> {
        vec![
            ("since", self.since.as_deref()),
            ("until", self.until.as_deref()),
            ("route", self.route.as_deref()),
            ("destination", self.destination.as_deref()),
            ("error", self.error.as_deref()),
        ]
    }

    fn filter(&self) -> Result<DeadFilter, String> {
        let q: Vec<(String, String)> = (self.pairs().into_iter())
            .filter_map(|(k, v)| v.map(|v| (k.to_owned(), v.to_owned())))
            .collect();
        DeadFilter::parse(&q, &[])
    }
}

/// What to do with the dead letters.
#[derive(Subcommand, Debug, Clone)]
pub(crate) enum Dlq {
    /// One line per dead letter, in the queue's order: ID, attempts, when, key, path, last error
    List {
        /// At most this many
        #[arg(long, value_name = "N", default_value_t = 1000)]
        limit: usize,
        #[command(flatten)]
        filters: Filters,
        #[command(flatten)]
        target: Target,
    },
    /// One dead letter in full: its attempts, error, headers and body
    Show {
        /// The dead letter's ID (from `dlq list`)
        id: String,
        #[command(flatten)]
        target: Target,
    },
    /// Queue dead letters again (each at most once), due at once with fresh attempts:
    /// one by ID, --all, or those the filters select
    Replay {
        /// The dead letter's ID (from `dlq list`)
        #[arg(
            value_name = "ID",
            required_unless_present_any = ["all", "since", "until", "route", "destination", "error"],
            conflicts_with_all = ["all", "since", "until", "route", "destination", "error"]
        )]
        id: Option<String>,
        /// Every dead letter
        #[arg(long, conflicts_with_all = ["since", "until", "route", "destination", "error"])]
        all: bool,
        #[command(flatten)]
        filters: Filters,
        /// Count what the filters select, replay nothing
        #[arg(long)]
        dry_run: bool,
        /// Replay dead letters that failed authentication (error `unauthenticated`) too;
        /// without it they are refused. One with no MAC (queued by an earlier version) is
        /// delivered only while `queue_accept_unsigned` is on; any other is dead-lettered again
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        target: Target,
    },
    /// Delete a dead letter for good (journaled); a later copy of it is queued again
    Delete {
        /// The dead letter's ID (from `dlq list`)
        id: String,
        /// Who deletes it, for the journal (default: $USER@hostname)
        #[arg(long, value_name = "NAME")]
        by: Option<String>,
        /// Why, for the journal
        #[arg(long, value_name = "TEXT")]
        reason: Option<String>,
        #[command(flatten)]
        target: Target,
    },
}

fn write_err(e: std::io::Error) -> String {
    format!("cannot write to stdout: {e}")
}

/// Says on stderr how many dead letters a bulk replay left out because they
/// failed authentication.
fn refused_note(refused: u64) {
    if refused > 0 {
        eprintln!(
            "{refused} dead letters failed authentication (`unauthenticated`) and were not \
             replayed (--force replays them)"
        );
    }
}

/// A dead letter's line of `dlq list` (`destination=` after the path, for
/// the letter of one of a route's destinations).
fn line(
    id: &str,
    attempts: u64,
    dead_at_ms: u64,
    (key, path, destination): (&str, &str, Option<&str>),
    error: &str,
) -> String {
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(dead_at_ms);
    let when = humantime::format_rfc3339_seconds(at);
    let error = error.replace(['\n', '\t'], " ");
    let destination =
        destination.map_or_else(String::new, |d| format!("\tdestination={}", shown(d)));
    format!(
        "{}\tattempts={attempts}\tdead_at={when}\tkey={}\tpath={}{destination}\terror={}",
        shown(id),
        shown(key),
        shown(path),
        shown(&error)
    )
}

/// Prints `dlq show` of a dead letter's JSON (as the admin API gives it).
fn show_text(out: &mut dyn Write, d: &Value) -> std::io::Result<()> {
    let s = |k: &str| shown(d[k].as_str().unwrap_or("?"));
    writeln!(out, "id: {}", s("id"))?;
    writeln!(out, "key: {}", s("key"))?;
    writeln!(out, "request: {} {}", s("method"), s("uri"))?;
    writeln!(out, "attempts: {}", d["attempts"])?;
    writeln!(out, "dead_at: {}", s("dead_at"))?;
    for a in d["attempt_errors"].as_array().into_iter().flatten() {
        let (at, e) = (a["at"].as_str().unwrap_or("?"), a["error"].as_str());
        writeln!(
            out,
            "attempt {} at {}: {}",
            a["attempt"],
            shown(at),
            shown(e.unwrap_or(""))
        )?;
    }
    if let Some(n) = d["attempts_not_kept"].as_u64().filter(|n| *n > 0) {
        writeln!(out, "({n} other attempts not kept)")?;
    }
    for h in d["headers"].as_array().into_iter().flatten() {
        let (name, value) = (h["name"].as_str(), h["value"].as_str());
        writeln!(
            out,
            "header: {}: {}",
            shown(name.unwrap_or("?")),
            shown(value.unwrap_or(""))
        )?;
    }
    use base64::Engine as _;
    let body = (d["body_base64"].as_str())
        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
        .unwrap_or_default();
    writeln!(out, "body: {}", shown_bytes(&body))
}

/// Runs `action` through the running gateway's admin API.
pub(crate) fn run_admin(action: &Dlq, token_file: &Path, at: &AdminAt) -> Result<(), String> {
    let token = crate::admin::listener::read_token(token_file)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    rt.block_on(admin(action, &token, at))
}

async fn admin(action: &Dlq, token: &str, at: &AdminAt) -> Result<(), String> {
    let mut out = std::io::stdout().lock();
    let target = match action {
        Dlq::List { target, .. }
        | Dlq::Show { target, .. }
        | Dlq::Replay { target, .. }
        | Dlq::Delete { target, .. } => target,
    };
    let json_out = target.format == Format::Json;
    let base = target.resolve(at);
    let ok = |(status, json): (u16, Value)| {
        if status == 200 {
            Ok(json)
        } else {
            Err(failed(status, &json))
        }
    };
    match action {
        Dlq::List { limit, filters, .. } => {
            let pairs = filters.pairs();
            let json = crate::commands::client::paged(
                &base,
                token,
                "/admin/dead",
                &pairs,
                "dead_letters",
                *limit,
            )
            .await?;
            if json_out {
                return writeln!(out, "{json}").map_err(write_err);
            }
            for d in json["dead_letters"].as_array().into_iter().flatten() {
                let s = |k: &str| d[k].as_str().unwrap_or_default();
                let l = line(
                    s("id"),
                    d["attempts"].as_u64().unwrap_or(0),
                    d["dead_at_ms"].as_u64().unwrap_or(0),
                    (s("key"), s("path"), d["destination"].as_str()),
                    s("error"),
                );
                writeln!(out, "{l}").map_err(write_err)?;
            }
        }
        Dlq::Show { id, .. } => {
            let path = format!("/admin/dead/{}", enc(id));
            let json = ok(call(&base, token, Method::GET, &path).await?)?;
            if json_out {
                return writeln!(out, "{json}").map_err(write_err);
            }
            show_text(&mut out, &json).map_err(write_err)?;
        }
        Dlq::Replay {
            id: Some(id),
            dry_run: false,
            force,
            ..
        } => {
            let mut path = format!("/admin/dead/{}/replay", enc(id));
            if *force {
                path.push_str("?force=true");
            }
            let (status, json) = call(&base, token, Method::POST, &path).await?;
            match status {
                200 if json_out => writeln!(out, "{json}").map_err(write_err)?,
                200 => writeln!(out, "replayed {}", shown(id)).map_err(write_err)?,
                404 => return Err(format!("no dead letter {} (already replayed?)", shown(id))),
                403 => return Err(crate::admin::dead::unauthenticated_refusal(&shown(id))),
                _ => return Err(failed(status, &json)),
            }
        }
        Dlq::Replay {
            filters,
            dry_run,
            force,
            ..
        } => {
            let mut pairs = filters.pairs();
            if *dry_run {
                pairs.push(("dry_run", Some("true")));
            }
            if *force {
                pairs.push(("force", Some("true")));
            }
            let path = format!("/admin/dead/replay?{}", query(&pairs));
            let json = ok(call(&base, token, Method::POST, &path).await?)?;
            if json_out {
                return writeln!(out, "{json}").map_err(write_err);
            }
            if *dry_run {
                let (m, t) = (&json["matched"], &json["dead_letters"]);
                writeln!(out, "would replay {m} of {t} dead letters").map_err(write_err)?;
            } else {
                writeln!(out, "replayed {}", json["replayed"]).map_err(write_err)?;
            }
            refused_note(json["refused_unauthenticated"].as_u64().unwrap_or(0));
        }
        Dlq::Delete { id, by, reason, .. } => {
            let by = by
                .clone()
                .unwrap_or_else(crate::commands::client::default_by);
            let pairs = [("by", Some(by.as_str())), ("reason", reason.as_deref())];
            let path = format!("/admin/dead/{}?{}", enc(id), query(&pairs));
            let (status, json) = call(&base, token, Method::DELETE, &path).await?;
            match status {
                200 if json_out => writeln!(out, "{json}").map_err(write_err)?,
                200 => writeln!(
                    out,
                    "deleted {} (a later copy of it is queued again)",
                    shown(id)
                )
                .map_err(write_err)?,
                404 => {
                    return Err(format!(
                        "no dead letter {} (replayed or deleted?)",
                        shown(id)
                    ))
                }
                _ => return Err(failed(status, &json)),
            }
        }
    }
    Ok(())
}

/// Runs `action` directly on the queue; `Err` is the message for exit
/// status 1.
pub(crate) fn run(action: &Dlq, settings: &QueueSettings) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    if let crate::start::ack::QueueSpec::Dir(dir) = &settings.spec {
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
        // A replay seals afresh under the queue's key (when it has one).
        let key = match settings.seal(queue.clone())? {
            either::Either::Left(sealed) => Some(sealed.key().clone()),
            either::Either::Right(_) => None,
        };
        let key = key.as_ref();
        let mut out = std::io::stdout().lock();
        let q = |e: tower_idempotency_queue::QueueError| e.to_string();
        match action {
            Dlq::List { limit, filters, .. } => {
                let filter = filters.filter()?;
                let (dead, _) = crate::admin::dead::page_all(&queue, &filter, *limit).await?;
                for d in dead {
                    writeln!(out, "{}", letter_line(&d)).map_err(write_err)?;
                }
            }
            Dlq::Show { id, .. } => {
                let Some(d) = queue.find_dead(&EntryId::new(id)).await.map_err(q)? else {
                    return Err(format!(
                        "no dead letter {} (replayed or deleted?)",
                        shown(id)
                    ));
                };
                show_text(&mut out, &crate::admin::dead::detail(&d)).map_err(write_err)?;
            }
            Dlq::Replay {
                id: Some(id),
                dry_run: false,
                force,
                ..
            } => match crate::admin::dead::replay_one(&queue, key, id, *force).await? {
                crate::admin::dead::ReplayOne::Replayed => {
                    writeln!(out, "replayed {}", shown(id)).map_err(write_err)?;
                }
                crate::admin::dead::ReplayOne::Absent => {
                    return Err(format!("no dead letter {} (already replayed?)", shown(id)));
                }
                crate::admin::dead::ReplayOne::Unauthenticated => {
                    return Err(crate::admin::dead::unauthenticated_refusal(&shown(id)));
                }
            },
            Dlq::Replay {
                all: true,
                force: true,
                dry_run: false,
                ..
            } => {
                let n = match key {
                    Some(key) => {
                        let key = key.clone();
                        queue.replay_all_with(&move |m| key.reseal(m)).await
                    }
                    None => queue.replay_all().await,
                };
                let n = n.map_err(q)?;
                writeln!(out, "replayed {n}").map_err(write_err)?;
            }
            Dlq::Replay {
                filters,
                dry_run,
                force,
                ..
            } => {
                // The filtered set, or every dead letter (`--all`, or a dry
                // run).
                let filter = filters.filter()?;
                let json =
                    crate::admin::dead::replay_selected(&queue, key, &filter, *dry_run, *force)
                        .await?;
                if *dry_run {
                    let (m, t) = (&json["matched"], &json["dead_letters"]);
                    writeln!(out, "would replay {m} of {t} dead letters").map_err(write_err)?;
                } else {
                    writeln!(out, "replayed {}", json["replayed"]).map_err(write_err)?;
                }
                refused_note(json["refused_unauthenticated"].as_u64().unwrap_or(0));
            }
            Dlq::Delete { id, by, reason, .. } => {
                let by = by
                    .clone()
                    .unwrap_or_else(crate::commands::client::default_by);
                let Some(d) = queue.delete_dead(&EntryId::new(id)).await.map_err(q)? else {
                    return Err(format!(
                        "no dead letter {} (replayed or deleted?)",
                        shown(id)
                    ));
                };
                tracing::info!(
                    id = %d.id, by, reason = reason.as_deref().unwrap_or("no reason given"),
                    "dead letter deleted offline; a later copy is queued again"
                );
                writeln!(
                    out,
                    "deleted {} (a later copy of it is queued again)",
                    shown(id)
                )
                .map_err(write_err)?;
            }
        }
        Ok(())
    })
}

fn letter_line(d: &DeadLetter) -> String {
    line(
        d.id.as_str(),
        u64::from(d.attempts),
        ms_of(d.dead_at),
        (
            &d.message.key,
            d.message.uri.path(),
            d.message.destination.as_deref(),
        ),
        &d.error,
    )
}
