//! A progress line on stderr for runs longer than a few seconds: rewritten
//! in place on a terminal, one line every few seconds in a log.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

/// Quiet for this long: short runs print nothing.
const QUIET: Duration = Duration::from_secs(3);

/// Reports `done / total` transactions of one system's run.
#[derive(Debug)]
pub(crate) struct Progress {
    done: Arc<AtomicUsize>,
    printed: Arc<AtomicBool>,
    task: JoinHandle<()>,
    terminal: bool,
}

impl Progress {
    /// Starts reporting the run of `label` over `total` transactions.
    pub(crate) fn start(label: &'static str, total: usize) -> Self {
        let done = Arc::new(AtomicUsize::new(0));
        let printed = Arc::new(AtomicBool::new(false));
        let terminal = std::io::stderr().is_terminal();
        let every = if terminal {
            Duration::from_secs(1)
        } else {
            Duration::from_secs(5)
        };
        let task = tokio::spawn({
            let (done, printed) = (done.clone(), printed.clone());
            async move {
                let start = Instant::now();
                tokio::time::sleep(QUIET).await;
                loop {
                    let n = done.load(Ordering::Relaxed);
                    let secs = start.elapsed().as_secs_f64();
                    let line = format!(
                        "retry_storm: {label}: {n}/{total} transactions ({:.0}%), {secs:.0} s",
                        100.0 * n as f64 / total.max(1) as f64
                    );
                    {
                        let mut err = std::io::stderr().lock();
                        let _ = if terminal {
                            write!(err, "\r{line:<72}")
                        } else {
                            writeln!(err, "{line}")
                        };
                        let _ = err.flush();
                    }
                    printed.store(true, Ordering::Relaxed);
                    tokio::time::sleep(every).await;
                }
            }
        });
        Self {
            done,
            printed,
            task,
            terminal,
        }
    }

    /// The counter the run adds each finished transaction to.
    pub(crate) fn counter(&self) -> Arc<AtomicUsize> {
        self.done.clone()
    }

    /// Stops reporting and clears the line on a terminal.
    pub(crate) fn finish(self) {
        self.task.abort();
        if self.terminal && self.printed.load(Ordering::Relaxed) {
            eprint!("\r{:<72}\r", "");
        }
    }
}
