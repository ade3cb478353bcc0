//! The subcommands. The admin commands (`inspect`, `forget`, `journal`,
//! `reconcile`, `pause`, `resume`, `dlq`) read only the keys they need of
//! the flags and the config file (`--config FILE`, the running gateway's
//! own) and talk to its admin API; without a token they say which flags
//! find it, and `dlq` works on a stopped gateway's queue directly only with
//! `--offline`. `send` and `test-keys` need no gateway of their own.

pub(crate) mod client;
pub(crate) mod dlq;
pub(crate) mod escape;
pub(crate) mod notification;
pub(crate) mod pause;
pub(crate) mod reconcile;
pub(crate) mod send;
pub(crate) mod signing;
pub(crate) mod test_keys;

use crate::settings::cli::Args;
use crate::settings::config;
use crate::usage_error;
use client::{AdminAt, Call};
use dlq::{Command, Dlq};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Runs `cmd`: exit status 0, 1 when it failed, 2 for a bad flag or file.
pub(crate) fn run(cmd: &Command, args: &Args) -> ExitCode {
    match cmd {
        Command::Reconcile(a) => match admin_at(args, "reconcile") {
            Ok((at, token)) => reconcile::run(a, &token, &at),
            Err(code) => code,
        },
        Command::Inspect(a) => admin(args, "inspect", |at, token| {
            client::run(Call::Inspect(a), token, at)
        }),
        Command::Forget(a) => admin(args, "forget", |at, token| {
            client::run(Call::Forget(a), token, at)
        }),
        Command::Journal(a) => admin(args, "journal", |at, token| {
            client::run(Call::Journal(a), token, at)
        }),
        Command::Pause(_) => admin(args, "pause", |at, token| pause::run(cmd, token, at)),
        Command::Resume(_) => admin(args, "resume", |at, token| pause::run(cmd, token, at)),
        Command::Dlq { offline, action } => dead_letters(args, *offline, action),
        Command::Send(a) => failed_with(send::run(a, args.config.as_deref()), |msg| msg),
        Command::TestKeys(a) => failed_with(test_keys::run(a), |msg| msg),
    }
}

/// Where the running gateway's admin API listens and the file of its
/// token, from the flags and the config file (as the gateway reads them);
/// `Err` is the exit status, the message printed: 2 for a bad file, 1 for
/// no token (the commands never guess one, nor fall back to anything
/// else).
fn admin_at(args: &Args, command: &str) -> Result<(AdminAt, PathBuf), ExitCode> {
    let (at, token) = config::admin_only(args).map_err(|msg| usage_error(&msg))?;
    let Some(token) = token else {
        let offline = if command == "dlq" {
            "; `dlq --offline` works on a stopped gateway's queue directly (--data-dir, --queue)"
        } else {
            ""
        };
        eprintln!(
            "idempotency-gateway: `{command}` asks the running gateway's admin API, and no admin token is \
             configured: give the gateway's config file with --config FILE (its admin_listen \
             and admin_token_file are read; IDEMPOTENCY_GATEWAY_CONFIG=FILE for every command), \
             or --admin-token-file FILE with --admin-listen ADDR or --admin URL{offline}"
        );
        return Err(ExitCode::FAILURE);
    };
    Ok((at, token))
}

/// A command of the admin API: where it listens and its token, from the
/// flags and the config file, then `call`.
fn admin(
    args: &Args,
    command: &str,
    call: impl FnOnce(&AdminAt, &Path) -> Result<(), String>,
) -> ExitCode {
    match admin_at(args, command) {
        Ok((at, token)) => failed_with(call(&at, &token), |msg| msg),
        Err(code) => code,
    }
}

/// `dlq`: through the admin API, or with `--offline` on the queue itself;
/// never the one for the other.
fn dead_letters(args: &Args, offline: bool, action: &Dlq) -> ExitCode {
    if !offline {
        return match admin_at(args, "dlq") {
            Ok((at, token)) => failed_with(dlq::run_admin(action, &token, &at), |msg| msg),
            Err(code) => code,
        };
    }
    eprintln!(
        "idempotency-gateway: --offline: working on the queue directly (--data-dir, --queue); \
         stop a gateway using the embedded queue first"
    );
    let queue = match config::queue_only(args) {
        Ok(queue) => queue,
        Err(msg) => return usage_error(&msg),
    };
    // The queue's URL in a message keeps its password out.
    failed_with(dlq::run(action, &queue), |msg| {
        crate::redact::redact_text(&msg)
    })
}

/// Exit status 0, or 1 with the message (as `shown`) on stderr.
fn failed_with(result: Result<(), String>, shown: impl FnOnce(String) -> String) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("idempotency-gateway: {}", shown(msg));
            ExitCode::FAILURE
        }
    }
}
