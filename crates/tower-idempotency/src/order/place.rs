//! [`Order`]: where a notification stands in its object's life.

use crate::key::{Field, FingerprintSpec, KeySpec};
use crate::store::Position;
use bytes::Bytes;
use http::request::Parts;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

/// How an order places a notification: the object, version and state
/// (when it has them) and the ranks of its states; a built-in order reads
/// more fields and places them its own way.
pub(super) enum Rule {
    /// `[object, version?, state?]`, as [`Order::builder`] sets them.
    Configured {
        /// Whether the second field read is the version.
        versioned: bool,
        /// The rank of each state, if the order has a state.
        ranks: Option<HashMap<String, u32>>,
    },
    /// A built-in order: the fields its reader names, in that order.
    Builtin(fn(&[Option<String>]) -> Placement),
    /// A built-in order that reads more than the body (a resource an
    /// earlier layer decrypted).
    #[cfg_attr(not(feature = "verify"), allow(dead_code))]
    Request(fn(&Parts, &Bytes) -> Placement),
}

/// An object's order: where each notification about it stands. See the
/// [module](super) for what it is; built by [`Order::builder`] or built in
/// ([`Order::stripe`], [`Order::alipay`], [`Order::paypal`]).
///
/// Cheap to clone.
#[derive(Clone)]
pub struct Order {
    pub(super) inner: Arc<Inner>,
}

pub(super) struct Inner {
    pub(super) name: Arc<str>,
    /// The fields read, in one pass over the body.
    pub(super) reader: KeySpec,
    pub(super) rule: Rule,
}

/// Where an [`Order`] placed a notification.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Placement {
    /// About `object`, at `position` in its life.
    Placed {
        /// The object's id, as the notification names it.
        object: String,
        /// Where the notification stands.
        position: Position,
    },
    /// The order cannot place it: forwarded as if there were no order.
    Unplaced(Unplaced),
}

/// Why an [`Order`] could not place a notification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unplaced {
    /// The body could not be read for the order's fields.
    Unreadable,
    /// It names no object.
    NoObject,
    /// It has no version, or one that is neither a whole number nor an
    /// RFC 3339 time.
    NoVersion,
    /// Its state is missing, or not one of the order's states (an event
    /// type outside the object's life).
    UnknownState,
}

impl Unplaced {
    /// A short name, for metrics and logs: `unreadable`, `no_object`,
    /// `no_version`, `unknown_state`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Unreadable => "unreadable",
            Self::NoObject => "no_object",
            Self::NoVersion => "no_version",
            Self::UnknownState => "unknown_state",
        }
    }
}

impl fmt::Display for Unplaced {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Order {
    /// The order's name: a preset's for a built-in order.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Stripe (see [`Order::stripe`]), Alipay ([`Order::alipay`]) or
    /// PayPal ([`Order::paypal`]) by the name of its preset; `None` for
    /// any other name.
    /// With the `verify` feature, `wechatpay-v3` too ([`Order::wechatpay_v3`]).
    pub fn builtin(name: &str) -> Option<Self> {
        match name {
            "stripe" => Some(Self::stripe()),
            "alipay" => Some(Self::alipay()),
            "paypal" => Some(Self::paypal()),
            #[cfg(feature = "verify")]
            "wechatpay-v3" => Some(Self::wechatpay_v3()),
            _ => None,
        }
    }

    /// Whether `name` is a built-in order's (whatever the features: a
    /// configured order cannot take `wechatpay-v3` either).
    pub fn is_builtin_name(name: &str) -> bool {
        matches!(name, "stripe" | "alipay" | "paypal" | "wechatpay-v3")
    }

    /// A built-in order of `name` that places a request with `place`.
    #[cfg(feature = "verify")]
    pub(super) fn built_in_request(
        name: &'static str,
        place: fn(&Parts, &Bytes) -> Placement,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                name: Arc::from(name),
                reader: KeySpec::new([], FingerprintSpec::None),
                rule: Rule::Request(place),
            }),
        }
    }

    /// A built-in order of `name`, reading `fields` and placing them with
    /// `place`.
    pub(super) fn built_in(
        name: &'static str,
        fields: impl IntoIterator<Item = Field>,
        place: fn(&[Option<String>]) -> Placement,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                name: Arc::from(name),
                reader: KeySpec::new(fields, FingerprintSpec::None),
                rule: Rule::Builtin(place),
            }),
        }
    }

    /// Where the request of `parts` and `body` stands.
    pub fn place(&self, parts: &Parts, body: &Bytes) -> Placement {
        if let Rule::Request(place) = &self.inner.rule {
            return place(parts, body);
        }
        let Ok(values) = self.inner.reader.values(parts, body) else {
            return Placement::Unplaced(Unplaced::Unreadable);
        };
        match &self.inner.rule {
            Rule::Builtin(place) => place(&values),
            Rule::Request(_) => unreachable!("placed above"),
            Rule::Configured { versioned, ranks } => {
                let mut values = values.into_iter();
                let Some(object) = values.next().flatten() else {
                    return Placement::Unplaced(Unplaced::NoObject);
                };
                let version = if *versioned {
                    match values.next().flatten().as_deref().and_then(version_of) {
                        Some(v) => v,
                        None => return Placement::Unplaced(Unplaced::NoVersion),
                    }
                } else {
                    0
                };
                let rank = match ranks {
                    None => 0,
                    Some(ranks) => {
                        match values.next().flatten().and_then(|s| ranks.get(&s).copied()) {
                            Some(rank) => rank,
                            None => return Placement::Unplaced(Unplaced::UnknownState),
                        }
                    }
                };
                Placement::Placed {
                    object,
                    position: Position::new(version, rank),
                }
            }
        }
    }
}

impl fmt::Debug for Order {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Order")
            .field("name", &self.inner.name)
            .field("fields", &self.inner.reader.key_fields())
            .finish_non_exhaustive()
    }
}

/// A version: a whole number, or an RFC 3339 time in microseconds since
/// the Unix epoch (`2024-05-01T12:00:00.25+02:00`, `…Z`).
pub(super) fn version_of(text: &str) -> Option<i64> {
    let text = text.trim();
    if let Ok(n) = text.parse::<i64>() {
        return Some(n);
    }
    rfc3339_micros(text)
}

/// An RFC 3339 time (with `Z` or an offset) in microseconds since the Unix
/// epoch; `humantime` reads the UTC form, the offset is applied here.
fn rfc3339_micros(text: &str) -> Option<i64> {
    if text.len() < 20 || !text.is_ascii() {
        return None;
    }
    let (utc, offset_secs) = match text.as_bytes()[text.len() - 1] {
        b'Z' | b'z' => (format!("{}Z", &text[..text.len() - 1]), 0i64),
        _ => {
            let (at, sign) = (text.len() - 6, text.as_bytes()[text.len() - 6]);
            let sign = match sign {
                b'+' => 1,
                b'-' => -1,
                _ => return None,
            };
            let offset = &text[at + 1..];
            let (h, m) = offset.split_once(':')?;
            let (h, m): (i64, i64) = (h.parse().ok()?, m.parse().ok()?);
            if h > 23 || m > 59 {
                return None;
            }
            (format!("{}Z", &text[..at]), sign * (h * 3600 + m * 60))
        }
    };
    let utc = utc.replacen(['t', ' '], "T", 1);
    let time = humantime::parse_rfc3339(&utc).ok()?;
    let since = time.duration_since(std::time::UNIX_EPOCH).ok()?;
    let micros = i64::try_from(since.as_micros()).ok()?;
    // 10:00+02:00 is 08:00 UTC.
    micros.checked_sub(offset_secs * 1_000_000)
}

/// An event read as `[object, version, state]` (the fields of a built-in
/// order, in that order): placed when all three are there, the state ranked
/// by `rank` (`None`: a state outside the object's life).
pub(super) fn object_version_state(
    values: &[Option<String>],
    rank: fn(&str) -> Option<u32>,
) -> Placement {
    let [object, created, event_type] = values else {
        return Placement::Unplaced(Unplaced::Unreadable);
    };
    let Some(rank) = event_type.as_deref().and_then(rank) else {
        return Placement::Unplaced(Unplaced::UnknownState);
    };
    let Some(object) = object.clone() else {
        return Placement::Unplaced(Unplaced::NoObject);
    };
    let Some(version) = created.as_deref().and_then(version_of) else {
        return Placement::Unplaced(Unplaced::NoVersion);
    };
    Placement::Placed {
        object,
        position: Position::new(version, rank),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_numbers_or_times() {
        assert_eq!(version_of("1712345678"), Some(1_712_345_678));
        assert_eq!(version_of("-3"), Some(-3));
        assert_eq!(version_of("1970-01-01T00:00:01Z"), Some(1_000_000));
        assert_eq!(version_of("1970-01-01T00:00:01.25Z"), Some(1_250_000));
        assert_eq!(
            version_of("2019-06-28T18:03:50+01:00"),
            version_of("2019-06-28T17:03:50Z")
        );
        assert_eq!(
            version_of("2019-06-28T16:03:50-01:00"),
            version_of("2019-06-28T17:03:50Z")
        );
        assert!(version_of("2019-06-28T18:03:50+01:00").unwrap() > 1_561_000_000_000_000);
        for bad in [
            "",
            "1.5",
            "soon",
            "2019-06-28",
            "2019-06-28T18:03:50+25:00",
            "2019-06-28T18:03:50",
        ] {
            assert_eq!(version_of(bad), None, "{bad}");
        }
    }
}
