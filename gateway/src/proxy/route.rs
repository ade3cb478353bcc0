//! [`RouteTable`]: longest-prefix routing by path.

use std::fmt;

/// Values by path prefix; a path goes to the **longest** matching prefix.
///
/// A prefix matches its own path and every path below it: `/notify`
/// matches `/notify` and `/notify/wechat`, not `/notifyx`; `/` matches
/// everything. A trailing `/` is ignored (`/x/` is `/x`). Prefixes match
/// regardless of ASCII case (`/NOTIFY/wechat` is under `/notify`), so that a
/// case-insensitive upstream (IIS, many Java and PHP routers) can never be
/// reached under a guarded prefix by spelling it in other letters; two
/// prefixes that differ only in case are the same prefix. Escapes are
/// compared decoded, in the prefix and in the path, as an upstream that
/// decodes the path before routing reads them: `/hooks/pay%3Astripe` is
/// under `/hooks/pay:stripe`. Give [`find`](Self::find) the normal form of a
/// path (the [`Gateway`](super::Gateway) does): `find` decodes escapes, it
/// does not resolve `..`.
///
/// ```
/// use idempotency_gateway::proxy::RouteTable;
///
/// let mut routes = RouteTable::new();
/// routes.insert("/", "root").unwrap();
/// routes.insert("/notify", "notify").unwrap();
/// assert_eq!(routes.find("/notify/wechat"), Some((&"notify", "/wechat")));
/// assert_eq!(routes.find("/notifyx"), Some((&"root", "/notifyx")));
/// assert_eq!(routes.find("/NOTIFY/wechat"), Some((&"notify", "/wechat")));
/// routes.insert("/hooks/pay:stripe", "hooks").unwrap();
/// assert_eq!(routes.find("/hooks/pay%3astripe/x"), Some((&"hooks", "/x")));
/// assert!(routes.insert("/hooks/pay%3Astripe", "again").is_err());
/// assert!(routes.insert("/notify/", "again").is_err());
/// assert!(routes.insert("/Notify", "again").is_err());
/// assert!(routes.insert("//notify/./", "again").is_err());
/// ```
#[derive(Debug, Clone)]
pub struct RouteTable<T> {
    /// Longest first.
    entries: Vec<Entry<T>>,
}

#[derive(Debug, Clone)]
struct Entry<T> {
    /// The prefix in normal form without a trailing `/` (`""` for the root).
    prefix: String,
    /// The same with its escapes decoded: what paths are matched against.
    decoded: String,
    value: T,
}

/// Why a prefix was refused by [`RouteTable::insert`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RouteError {
    /// The prefix does not start with `/`.
    NotAbsolute(String),
    /// The prefix is routed twice.
    Duplicate(String),
    /// An acknowledge-then-deliver route without a queue, on `auto`, or on
    /// a client-API preset (whose reply is the handler's answer, which a
    /// queue cannot give).
    AckThenDeliver(String),
    /// The prefix is an `auto` route with a verifier: each channel has its
    /// own keys, so an `auto` route cannot verify.
    VerifyOnAuto(String),
}

impl fmt::Display for RouteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotAbsolute(p) => write!(f, "the prefix `{p}` must start with `/`"),
            Self::Duplicate(p) => write!(f, "the prefix `{p}` is routed twice"),
            Self::AckThenDeliver(why) => write!(f, "ack-then-deliver: {why}"),
            Self::VerifyOnAuto(p) => write!(
                f,
                "the prefix `{p}` is an `auto` route: it cannot verify signatures \
                 (each channel has its own keys); route the channel with its preset"
            ),
        }
    }
}

impl std::error::Error for RouteError {}

impl<T> Default for RouteTable<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> RouteTable<T> {
    /// An empty table: every path is unrouted.
    pub const fn new() -> Self {
        Self {
            entries: Vec::new(),
        }
    }

    /// Routes `prefix` (and every path below it) to `value`. The prefix is
    /// kept in normal form, as request paths are matched: `/a//b/` and
    /// `/a/./b` are `/a/b`.
    pub fn insert(&mut self, prefix: &str, value: T) -> Result<(), RouteError> {
        if !prefix.starts_with('/') {
            return Err(RouteError::NotAbsolute(prefix.to_owned()));
        }
        let normal = crate::proxy::path::normalize(prefix);
        let prefix = normal.trim_end_matches('/');
        let decoded = crate::proxy::path::decoded(prefix).into_owned();
        if self
            .entries
            .iter()
            .any(|e| e.decoded.eq_ignore_ascii_case(&decoded))
        {
            return Err(RouteError::Duplicate(display(prefix).to_owned()));
        }
        let at = self
            .entries
            .iter()
            .position(|e| e.decoded.len() < decoded.len())
            .unwrap_or(self.entries.len());
        let entry = Entry {
            prefix: prefix.to_owned(),
            decoded,
            value,
        };
        self.entries.insert(at, entry);
        Ok(())
    }

    /// The value of the longest prefix of `path` (ASCII case ignored,
    /// escapes decoded), and the rest of the path (`""` or starting with `/`).
    pub fn find<'p>(&self, path: &'p str) -> Option<(&T, &'p str)> {
        self.find_entry(path).map(|(_, value, rest)| (value, rest))
    }

    /// The longest prefix of `path` as it was routed (`/` for the root), its
    /// value and the rest of the path.
    pub(crate) fn find_entry<'p>(&self, path: &'p str) -> Option<(&str, &T, &'p str)> {
        self.entries.iter().find_map(|e| {
            let rest = strip_prefix(path, &e.decoded)?;
            (rest.is_empty() || rest.starts_with('/')).then(|| (display(&e.prefix), &e.value, rest))
        })
    }

    /// Every prefix (`/` for the root) and its value, longest first.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &T)> {
        self.entries.iter().map(|e| (display(&e.prefix), &e.value))
    }

    /// Whether no prefix is routed.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Applies `f` to every value, keeping the prefixes.
    pub(crate) fn map<U>(self, mut f: impl FnMut(&str, T) -> U) -> RouteTable<U> {
        RouteTable {
            entries: self
                .entries
                .into_iter()
                .map(|e| {
                    let value = f(display(&e.prefix), e.value);
                    Entry {
                        prefix: e.prefix,
                        decoded: e.decoded,
                        value,
                    }
                })
                .collect(),
        }
    }
}

fn display(prefix: &str) -> &str {
    if prefix.is_empty() {
        "/"
    } else {
        prefix
    }
}

/// The rest of `path` after `prefix` (decoded), if `path` starts with it
/// once its own escapes are decoded, ASCII case ignored.
fn strip_prefix<'p>(path: &'p str, prefix: &str) -> Option<&'p str> {
    if !path.contains('%') {
        let head = path.get(..prefix.len())?;
        return head
            .eq_ignore_ascii_case(prefix)
            .then(|| &path[prefix.len()..]);
    }
    let bytes = path.as_bytes();
    let mut at = 0;
    for want in prefix.bytes() {
        let got = match *bytes.get(at)? {
            b'%' => match (
                crate::proxy::path::hex(bytes.get(at + 1)),
                crate::proxy::path::hex(bytes.get(at + 2)),
            ) {
                (Some(h), Some(l)) => {
                    at += 3;
                    h * 16 + l
                }
                _ => {
                    at += 1;
                    b'%'
                }
            },
            b => {
                at += 1;
                b
            }
        };
        if !got.eq_ignore_ascii_case(&want) {
            return None;
        }
    }
    path.get(at..)
}
