//! [`Upstream`]: where a [`Forward`](super::Forward) sends requests.

use crate::shed::{Shares, Slots, DEFAULT_QUEUE_WAIT};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderValue, Uri};
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// The service behind the gateway: `http[s]://HOST[:PORT][/BASE]`.
///
/// Requests keep their own path and query under the base path:
/// `/notify/wechat?x=1` to `https://pay.internal/api` goes to
/// `https://pay.internal/api/notify/wechat?x=1`.
///
/// ```
/// use idempotency_gateway::proxy::Upstream;
///
/// let up: Upstream = "https://pay.internal:8443/api/".parse().unwrap();
/// assert_eq!(up.authority(), "pay.internal:8443");
/// assert_eq!(up.base_path(), "/api");
/// assert!(up.is_https());
/// assert!("ftp://x".parse::<Upstream>().is_err());
/// ```
#[derive(Debug, Clone)]
pub struct Upstream {
    https: bool,
    authority: String,
    /// Base path without a trailing `/` (empty for none).
    base: String,
    host: HeaderValue,
    /// The scheme and authority parsed once: each request's URI is built
    /// from clones of them (a reference count) instead of a parse.
    scheme: Scheme,
    parsed_authority: Authority,
}

impl Upstream {
    /// The `HOST[:PORT]` part.
    pub fn authority(&self) -> &str {
        &self.authority
    }

    /// The base path, without a trailing `/` (`""` for none).
    pub fn base_path(&self) -> &str {
        &self.base
    }

    /// Whether the upstream is reached over TLS.
    pub fn is_https(&self) -> bool {
        self.https
    }

    /// The `Host` header the upstream gets.
    pub(crate) fn host(&self) -> &HeaderValue {
        &self.host
    }

    /// The URI a request with `path_and_query` is sent with, in origin
    /// form (`/BASE/path?query`: the connection is the upstream's).
    pub(crate) fn uri(&self, path_and_query: Option<&PathAndQuery>) -> Result<Uri, http::Error> {
        let path_and_query = match (self.base.is_empty(), path_and_query) {
            // No base path: the request's own, shared, not parsed again.
            (true, Some(pq)) => pq.clone(),
            (true, None) => PathAndQuery::from_static("/"),
            (false, pq) => {
                let pq = pq.map_or("/", PathAndQuery::as_str);
                PathAndQuery::try_from(format!("{}{pq}", self.base))?
            }
        };
        Ok(Uri::from(path_and_query))
    }

    /// The upstream's scheme and authority, as a connector dials them.
    pub(crate) fn target(&self) -> Uri {
        let mut parts = http::uri::Parts::default();
        parts.scheme = Some(self.scheme.clone());
        parts.authority = Some(self.parsed_authority.clone());
        parts.path_and_query = Some(PathAndQuery::from_static("/"));
        Uri::from_parts(parts).expect("a scheme and an authority make a URI")
    }
}

impl fmt::Display for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = if self.https { "https" } else { "http" };
        write!(f, "{scheme}://{}{}", self.authority, self.base)
    }
}

/// Why an upstream URL was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamError(&'static str);

impl fmt::Display for UpstreamError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for UpstreamError {}

impl FromStr for Upstream {
    type Err = UpstreamError;

    fn from_str(s: &str) -> Result<Self, UpstreamError> {
        const SHAPE: UpstreamError =
            UpstreamError("expected http://HOST:PORT[/BASE] or https://HOST:PORT[/BASE]");
        let uri: Uri = s.parse().map_err(|_| SHAPE)?;
        let https = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => return Err(SHAPE),
        };
        let authority = uri.authority().ok_or(SHAPE)?.clone();
        if authority.as_str().contains('@') {
            return Err(UpstreamError("credentials in the URL are not supported"));
        }
        if uri.query().is_some() {
            return Err(UpstreamError("the upstream URL cannot have a query"));
        }
        let host = HeaderValue::from_str(authority.as_str()).map_err(|_| SHAPE)?;
        Ok(Self {
            https,
            authority: authority.to_string(),
            base: uri.path().trim_end_matches('/').to_owned(),
            host,
            scheme: if https { Scheme::HTTPS } else { Scheme::HTTP },
            parsed_authority: authority,
        })
    }
}

/// A cap on the calls in flight to an upstream, shared by its clones (give
/// one to the [`Forward`](super::Forward) of every serving thread with
/// [`ForwardBuilder::call_limit`](super::ForwardBuilder::call_limit)).
///
/// A call holds its slot from the moment it is sent until the upstream's
/// answer has ended (its body read to the end, failed or dropped),
/// whoever waits for it: a call finished in the background after the
/// caller's reply deadline, or after the caller hung up, keeps its slot to
/// the end. So the cap also bounds the connections (descriptors) a hung
/// upstream can make the gateway hold. A call that finds no free slot waits
/// at most the queue wait for one ([`queue_wait`](Self::queue_wait), 50 ms
/// unless set); past it the call is not sent: the caller gets `503 Service
/// Unavailable` with `Retry-After` (a guarded route answers its retryable
/// failure and counts it as [`Outcome::Shed`](tower_idempotency::Outcome::Shed)).
///
/// A route with no cap of its own (no
/// [`RouteOptions::max_in_flight`](super::RouteOptions::max_in_flight))
/// holds at most half of the slots, and so do the unguarded requests
/// together: one slow route (a hung client API) cannot take every slot
/// from the others (the callbacks). The clones of a limit share these
/// shares, across every gateway built on them.
///
/// With the `metrics` feature the calls in flight are the gauge
/// `idempotency_upstream_calls` (install the recorder before building the
/// limit).
///
/// ```
/// use std::time::Duration;
/// use idempotency_gateway::proxy::CallLimit;
///
/// let limit = CallLimit::new(1024).queue_wait(Duration::ZERO);
/// assert_eq!(limit.max(), 1024);
/// assert_eq!(limit.in_flight(), 0);
/// assert_eq!(limit.get_queue_wait(), Duration::ZERO);
/// ```
#[derive(Clone)]
pub struct CallLimit {
    slots: Slots,
    shares: Shares,
    queue_wait: Duration,
    gauge: metrics::Gauge,
}

/// The cap of a [`ForwardBuilder`](super::ForwardBuilder) given none.
pub const DEFAULT_MAX_UPSTREAM_CALLS: usize = 1024;

impl CallLimit {
    /// At most `max` calls at once (at least one).
    pub fn new(max: usize) -> Self {
        let slots = Slots::new(max);
        Self {
            shares: Shares::new(slots.max()),
            slots,
            queue_wait: DEFAULT_QUEUE_WAIT,
            gauge: metrics::gauge!("idempotency_upstream_calls"),
        }
    }

    /// The longest a call waits for a free slot before it is refused; zero
    /// refuses at once. Defaults to 50 milliseconds.
    pub fn queue_wait(mut self, wait: Duration) -> Self {
        self.queue_wait = wait;
        self
    }

    /// The queue wait (see [`queue_wait`](Self::queue_wait)).
    pub fn get_queue_wait(&self) -> Duration {
        self.queue_wait
    }

    /// The cap.
    pub fn max(&self) -> usize {
        self.slots.max()
    }

    /// The calls holding a slot now.
    pub fn in_flight(&self) -> usize {
        self.slots.in_flight()
    }

    /// The cap of the route `name` when it has none of its own: half of
    /// this one, shared by every clone.
    pub(crate) fn share(&self, name: &str) -> Slots {
        self.shares.get(name)
    }

    /// A slot, waiting at most the queue wait for one.
    pub(crate) async fn acquire(&self) -> Option<CallPermit> {
        let permit = self.slots.acquire_within(self.queue_wait).await?;
        self.gauge.increment(1.0);
        Some(CallPermit {
            _permit: permit,
            gauge: self.gauge.clone(),
        })
    }
}

impl fmt::Debug for CallLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CallLimit")
            .field("max", &self.max())
            .field("in_flight", &self.in_flight())
            .field("queue_wait", &self.queue_wait)
            .finish()
    }
}

/// One call's slot of a [`CallLimit`], given back when dropped.
pub(crate) struct CallPermit {
    _permit: tokio::sync::OwnedSemaphorePermit,
    gauge: metrics::Gauge,
}

impl Drop for CallPermit {
    fn drop(&mut self) {
        self.gauge.decrement(1.0);
    }
}
