//! An upstream on raw TCP that writes its answers in chosen segments, and
//! a raw client that reads an answer until the gateway closes it: for the
//! tests of what reaches the client byte for byte (framing, trailers).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How the raw upstream writes each answer.
#[derive(Clone)]
pub struct Answer {
    /// The head, up to and including the blank line: written with the
    /// first piece, in one segment.
    pub head: Vec<u8>,
    /// The rest, written one piece at a time with a flush and `pause`
    /// between pieces.
    pub pieces: Vec<Vec<u8>>,
    pub pause: Duration,
}

/// An upstream on raw TCP: reads each request (head and `Content-Length`
/// body), counts it and writes `answer` in its pieces; keeps the
/// connection for the next request.
pub struct RawUpstream {
    pub addr: SocketAddr,
    calls: Arc<AtomicUsize>,
    /// The last request's head, lower-cased.
    last: Arc<Mutex<String>>,
    task: tokio::task::JoinHandle<()>,
}

impl RawUpstream {
    pub async fn start(answer: Answer) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        let last: Arc<Mutex<String>> = Arc::default();
        let (counted, seen) = (calls.clone(), last.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    continue;
                };
                let (answer, calls, seen) = (answer.clone(), counted.clone(), seen.clone());
                tokio::spawn(async move {
                    let _ = stream.set_nodelay(true);
                    while let Some(request) = read_request(&mut stream).await {
                        *seen.lock().unwrap() = String::from_utf8_lossy(&request).to_lowercase();
                        calls.fetch_add(1, Ordering::SeqCst);
                        if write_answer(&mut stream, &answer).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Self {
            addr,
            calls,
            last,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    /// The last request's head and body, lower-cased.
    pub fn last(&self) -> String {
        self.last.lock().unwrap().clone()
    }
}

impl Drop for RawUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Reads one request's head and its `Content-Length` body; `None` when the
/// connection ends first.
pub async fn read_request(stream: &mut TcpStream) -> Option<Vec<u8>> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if stream.read(&mut byte).await.ok()? == 0 {
            return None;
        }
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).to_ascii_lowercase();
    let len = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).await.ok()?;
    buf.extend_from_slice(&body);
    Some(buf)
}

pub async fn write_answer(stream: &mut TcpStream, answer: &Answer) -> std::io::Result<()> {
    let mut first = answer.head.clone();
    let mut pieces = answer.pieces.iter();
    first.extend_from_slice(pieces.next().map_or(&[][..], Vec::as_slice));
    stream.write_all(&first).await?;
    stream.flush().await?;
    for piece in pieces {
        tokio::time::sleep(answer.pause).await;
        stream.write_all(piece).await?;
        stream.flush().await?;
    }
    Ok(())
}

/// A 200 of `len` bytes of `x` (`Content-Length` framing) in `pieces`
/// segments.
pub fn sized(len: usize, pieces: usize, pause: Duration) -> Answer {
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ncontent-length: {len}\r\n\r\n"
    );
    let body = vec![b'x'; len];
    Answer {
        head: head.into_bytes(),
        pieces: body
            .chunks(len.div_ceil(pieces))
            .map(<[u8]>::to_vec)
            .collect(),
        pause,
    }
}

/// What the client read: the head as text, the body's bytes.
pub struct Read {
    pub head: String,
    pub body: Vec<u8>,
}

impl Read {
    pub fn status(&self) -> u16 {
        self.head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0)
    }

    pub fn header(&self, name: &str) -> Option<String> {
        let name = format!("{}:", name.to_ascii_lowercase());
        self.head.lines().find_map(|l| {
            l.to_ascii_lowercase()
                .starts_with(&name)
                .then(|| l[name.len()..].trim().to_owned())
        })
    }
}

/// Sends `request` over a fresh connection and reads the answer until the
/// gateway closes it (the request says `Connection: close`); a read that
/// waits longer than `patience` ends it. The raw bytes after the head.
pub async fn exchange(addr: SocketAddr, request: &str, patience: Duration) -> Read {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match tokio::time::timeout(patience, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
        }
    }
    let at = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(out.len(), |i| i + 4);
    Read {
        head: String::from_utf8_lossy(&out[..at]).into_owned(),
        body: out[at..].to_vec(),
    }
}

pub fn post(path: &str, key: &str, extra: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: gw\r\nConnection: close\r\nIdempotency-Key: {key}\r\n\
         Content-Type: application/json\r\n{extra}Content-Length: 2\r\n\r\n{{}}"
    )
}
