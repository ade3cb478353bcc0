//! A bare hyper server that answers every request `200 ok`: the ceiling a
//! Rust server reaches on this machine at all, for `bench/benches/ab.sh`
//! and `bench/benches/gateway_instructions.sh` to put beside the gateway.
//!
//! ```text
//! cargo run --release -p idempotency-bench --example hyper_200 -- [--listen ADDR] [--workers N]
//! ```
//!
//! It is served the way the gateway serves, so that the two differ by
//! what the gateway does and nothing else: one single-threaded tokio
//! runtime per serving thread (`--workers`, default one per core), each
//! accepting on its own `SO_REUSEPORT` listener, HTTP/1.1 with keep-alive,
//! the same allocator (mimalloc). The request body is read to its end
//! before the answer, as a server that reads notifications must. It prints
//! `listening on ADDR` once every thread listens, and ends on SIGINT or
//! SIGTERM.

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use std::net::SocketAddr;
use tokio::net::{TcpListener, TcpSocket};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut listen: SocketAddr = "127.0.0.1:0".parse()?;
    let mut workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--listen" => listen = args.next().ok_or("--listen takes ADDR")?.parse()?,
            "--workers" => workers = args.next().ok_or("--workers takes N")?.parse()?,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    // The first listener settles port 0; the others bind the port it got.
    let mut threads = Vec::new();
    for _ in 0..workers.max(1) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let listener = {
            let _in = rt.enter();
            bind(listen)?
        };
        listen = listener.local_addr()?;
        threads.push(std::thread::spawn(move || rt.block_on(serve(listener))));
    }
    println!("listening on {listen}");
    // SIGINT or SIGTERM ends it (a script's background job ignores SIGINT
    // unless it is asked for), through `exit`, so that a profiler running
    // it writes its data.
    let control = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    control.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r,
            _ = term.recv() => Ok(()),
        }
    })?;
    drop(threads);
    std::process::exit(0)
}

fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.set_reuseport(true)?;
    socket.bind(addr)?;
    socket.listen(1024)
}

async fn serve(listener: TcpListener) {
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            continue;
        };
        let _ = tcp.set_nodelay(true);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(answer);
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(tcp), service)
                .await;
        });
    }
}

async fn answer(request: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    // Read to the end, as a server of notifications does; a broken body
    // still gets its answer.
    let _ = request.into_body().collect().await;
    Ok(Response::new(Full::new(Bytes::from_static(b"ok\n"))))
}
