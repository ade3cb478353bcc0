//! The subcommands (`inspect`, `forget`, `journal`, `reconcile`, `pause`,
//! `resume`, `dlq`): each reads only the keys it needs of the flags and the
//! config file, and talks to the running gateway's admin API, but for
//! `dlq` without an admin token (or with `--offline`), which works on the
//! queue of a stopped gateway directly.

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
use std::path::PathBuf;
use std::process::ExitCode;

/// Runs `cmd`: exit status 0, 1 when it failed, 2 for a bad flag or file.
pub(crate) fn run(cmd: &Command, args: &Args) -> ExitCode {
    match cmd {
        Command::Reconcile(a) => match config::admin_only(args) {
            Ok((at, token)) => reconcile::run(a, token.as_ref(), &at),
            Err(msg) => usage_error(&msg),
        },
        Command::Inspect(a) => admin(args, |at, token| client::run(Call::Inspect(a), token, at)),
        Command::Forget(a) => admin(args, |at, token| client::run(Call::Forget(a), token, at)),
        Command::Journal(a) => admin(args, |at, token| client::run(Call::Journal(a), token, at)),
        Command::Pause(_) | Command::Resume(_) => {
            admin(args, |at, token| pause::run(cmd, token, at))
        }
        Command::Dlq { offline, action } => dead_letters(args, *offline, action),
        Command::Send(a) => failed_with(send::run(a, args.config.as_deref()), |msg| msg),
        Command::TestKeys(a) => failed_with(test_keys::run(a), |msg| msg),
    }
}

/// A command of the admin API: where it listens and its token, from the
/// flags and the config file, then `call`.
fn admin(
    args: &Args,
    call: impl FnOnce(&AdminAt, Option<&PathBuf>) -> Result<(), String>,
) -> ExitCode {
    let (at, token) = match config::admin_only(args) {
        Ok(found) => found,
        Err(msg) => return usage_error(&msg),
    };
    failed_with(call(&at, token.as_ref()), |msg| msg)
}

/// `dlq`: through the admin API when there is a token (and no
/// `--offline`), else on the queue itself.
fn dead_letters(args: &Args, offline: bool, action: &Dlq) -> ExitCode {
    if offline {
        eprintln!(
            "gateway: --offline: working on the queue directly (--data-dir, --queue); \
             stop a gateway using the embedded queue first"
        );
    } else {
        let (at, token) = match config::admin_only(args) {
            Ok(found) => found,
            Err(msg) => return usage_error(&msg),
        };
        if let Some(token) = token {
            return failed_with(dlq::run_admin(action, &token, &at), |msg| msg);
        }
        eprintln!(
            "gateway: no admin token (--admin-token-file): working on the queue directly \
             (--data-dir, --queue); stop a gateway using the embedded queue first"
        );
    }
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
            eprintln!("gateway: {}", shown(msg));
            ExitCode::FAILURE
        }
    }
}
