//! Serving threads (`--workers`): each runs its own single-threaded tokio
//! runtime, accepts on its own `SO_REUSEPORT` listener bound to the same
//! address (the kernel spreads new connections across them) and forwards
//! through its own gateway, so its upstream connections live on its thread
//! too. A request is then served from accept to reply on one thread, with
//! no wake-up handed to another; the threads share the store, the queue,
//! the task tracker, the connection cap and the TLS configuration.

use crate::serve::accept::{self, Limits};
use crate::start::store::GatewayStore;
use idempotency_gateway::proxy::Gateway;
use std::net::SocketAddr;
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::net::{TcpListener, TcpSocket};
use tokio::runtime::Runtime;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

/// What a listener queues before `accept`, as `TcpListener::bind` asks.
const BACKLOG: u32 = 1024;

/// One listener per serving thread, each registered with that thread's
/// runtime, all on one address.
pub(crate) struct Bound {
    threads: Vec<(Rt, TcpListener)>,
    /// The address they share (its port picked by the first for port 0).
    pub(crate) local: SocketAddr,
}

/// Binds `n` listeners to `addr` with `SO_REUSEPORT`.
///
/// First a plain listener (no `SO_REUSEPORT`) takes the address for a
/// moment: that fails if anything listens there already, another gateway
/// included, which `SO_REUSEPORT` alone would let share the port (and split
/// its notifications across two stores). Its port is the one the serving
/// threads then bind, which also settles port 0.
pub(crate) fn bind(addr: SocketAddr, n: usize) -> Result<Bound, String> {
    let mut at = std::net::TcpListener::bind(addr)
        .and_then(|probe| probe.local_addr())
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let mut threads = Vec::with_capacity(n);
    for _ in 0..n {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map(|rt| Rt(Some(rt)))
            .map_err(|e| format!("cannot start a serving thread's runtime: {e}"))?;
        let listener = {
            let _in = rt.0.as_ref().expect("just built").enter();
            listen(at).map_err(|e| format!("cannot listen on {addr}: {e}"))?
        };
        at = listener
            .local_addr()
            .map_err(|e| format!("cannot read the bound address: {e}"))?;
        threads.push((rt, listener));
    }
    Ok(Bound { threads, local: at })
}

/// A serving thread's runtime before its thread runs it: dropped (when
/// the start fails) without blocking, even inside the control runtime.
struct Rt(Option<Runtime>);

impl Drop for Rt {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.set_reuseport(true)?;
    socket.bind(addr)?;
    socket.listen(BACKLOG)
}

/// The running serving threads.
pub(crate) struct Workers {
    stop: CancellationToken,
    exit: CancellationToken,
    stopped: Vec<oneshot::Receiver<usize>>,
    drained: Vec<oneshot::Receiver<()>>,
    threads: Vec<JoinHandle<()>>,
}

impl Workers {
    /// Starts one thread per listener of `bound`, each serving with the
    /// gateway `gateway()` builds for it.
    pub(crate) fn start(
        bound: Bound,
        mut gateway: impl FnMut() -> Result<Gateway<GatewayStore>, String>,
        limits: &Limits,
    ) -> Result<Self, String> {
        let mut this = Self {
            stop: CancellationToken::new(),
            exit: CancellationToken::new(),
            stopped: Vec::new(),
            drained: Vec::new(),
            threads: Vec::new(),
        };
        for (i, (mut rt, listener)) in bound.threads.into_iter().enumerate() {
            let gateway = gateway()?;
            let (stop, exit, limits) = (this.stop.clone(), this.exit.clone(), limits.clone());
            let (stopped, stopped_rx) = oneshot::channel();
            let (drained, drained_rx) = oneshot::channel();
            let serve = async move {
                let open =
                    accept::accept_until(listener, gateway, &limits, stop.cancelled_owned()).await;
                let _ = stopped.send(open.count());
                open.shutdown().await;
                let _ = drained.send(());
                // The background work this thread's requests left on the
                // task tracker runs here until the drain is over.
                exit.cancelled().await;
            };
            // Short enough for the kernel's 15-byte thread names (top, perf).
            let thread = std::thread::Builder::new()
                .name(format!("gw-worker-{i}"))
                .spawn(move || {
                    let rt = rt.0.take().expect("taken once");
                    rt.block_on(serve);
                    rt.shutdown_timeout(Duration::from_secs(1));
                })
                .map_err(|e| format!("cannot start a serving thread: {e}"))?;
            this.stopped.push(stopped_rx);
            this.drained.push(drained_rx);
            this.threads.push(thread);
        }
        Ok(this)
    }

    /// Stops accepting on every thread (their listeners close); the number
    /// of connections still open.
    pub(crate) async fn stop(&mut self) -> usize {
        self.stop.cancel();
        let mut open = 0;
        for stopped in self.stopped.drain(..) {
            open += stopped.await.unwrap_or(0);
        }
        open
    }

    /// Waits until every thread's connections have closed (after
    /// [`stop`](Self::stop)).
    pub(crate) async fn drained(&mut self) {
        for drained in self.drained.drain(..) {
            let _ = drained.await;
        }
    }

    /// Ends the threads' runtimes, dropping what still runs on them, and
    /// waits for the threads.
    pub(crate) async fn exit(self) {
        self.exit.cancel();
        let threads = self.threads;
        let _ = tokio::task::spawn_blocking(move || {
            for thread in threads {
                let _ = thread.join();
            }
        })
        .await;
    }
}
