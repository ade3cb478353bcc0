//! Free loopback ports, for servers that must be told where to listen
//! (`redis-server`, the gateway's metrics listener). Also included by
//! `tests/support_redis`, which some tests use without `common`.

use std::net::SocketAddr;

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free loopback port")
}

/// A loopback address whose port was free a moment ago.
pub fn free_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}
