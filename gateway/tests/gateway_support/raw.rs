//! One HTTP/1.1 request written byte for byte (no client-side
//! normalisation of the request target), its answer read off the wire.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

/// An answer read off the wire.
#[derive(Debug)]
pub struct Raw {
    pub status: u16,
    pub head: String,
    pub body: String,
}

impl Raw {
    pub fn header(&self, name: &str) -> Option<String> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
        })
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed").as_deref() == Some("true")
    }
}

/// `METHOD target` exactly as written (no client-side normalisation), with
/// `headers` and `body`, over a fresh connection.
pub fn raw(
    addr: SocketAddr,
    method: &str,
    target: &[u8],
    headers: &[(&str, &str)],
    body: &[u8],
) -> Raw {
    let mut req = format!("{method} ").into_bytes();
    req.extend_from_slice(target);
    req.extend_from_slice(b" HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
    }
    req.extend_from_slice(format!("Content-Length: {}\r\n\r\n", body.len()).as_bytes());
    req.extend_from_slice(body);
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    stream.write_all(&req).unwrap();
    let mut out = Vec::new();
    let _ = stream.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Raw {
        status,
        head: head.to_owned(),
        body: body.to_owned(),
    }
}
