//! The failed attempts of an entry, as each queue keeps them: bounded in
//! count (the first and the latest) and in size (each error cut short),
//! and written as one line of printable ASCII so that every backend can
//! carry it (a redb row, a Redis field, a RabbitMQ or NATS header).

use super::{DeadLetter, EntryId, Message};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// One failed delivery attempt of an entry.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Attempt {
    /// Which attempt it was, from 1.
    pub number: u32,
    /// When it failed.
    pub at: SystemTime,
    /// Why (at most [`MAX_ERROR_LEN`] bytes of it).
    pub error: String,
}

impl Attempt {
    /// Attempt `number` (from 1), failed at `at` with `error` (cut to
    /// [`MAX_ERROR_LEN`] bytes, on a character boundary).
    pub fn new(number: u32, at: SystemTime, error: &str) -> Self {
        Self {
            number,
            at,
            error: cut(error).to_owned(),
        }
    }
}

/// The most attempts an entry keeps: its first, and the latest
/// `MAX_ATTEMPTS_KEPT - 1`. Those in between are counted, not kept.
pub const MAX_ATTEMPTS_KEPT: usize = 16;

/// The most bytes of one attempt's error that are kept (cut on a character
/// boundary): an upstream answering a huge error body does not grow an entry
/// without bound.
pub const MAX_ERROR_LEN: usize = 1024;

/// The attempts an entry keeps, and how many others it made but dropped.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct History {
    pub(crate) kept: Vec<Attempt>,
    pub(crate) not_kept: u32,
}

/// The latest time an attempt may carry (the end of year 9999, as far as
/// RFC 3339 goes): a later one is not a time this queue wrote.
const LATEST_MS: u64 = 253_402_300_799_999;

/// The version tag the encoding starts with.
const TAG: &str = "1";

impl History {
    /// The history `stored` (as [`encode`](Self::encode) wrote it), or an
    /// empty one when there is none or it cannot be read (written by
    /// another version, or by someone hostile): never an error.
    pub(crate) fn parse(stored: Option<&str>) -> Self {
        stored.and_then(Self::decode).unwrap_or_default()
    }

    /// Records one more failed attempt: kept if there is room, else the
    /// oldest after the first is dropped (and counted).
    pub(crate) fn push(&mut self, number: u32, at: SystemTime, error: &str) {
        if self.kept.len() >= MAX_ATTEMPTS_KEPT {
            self.kept.remove(1);
            self.not_kept = self.not_kept.saturating_add(1);
        }
        self.kept.push(Attempt {
            number,
            at,
            error: cut(error).to_owned(),
        });
    }

    /// [`parse`](Self::parse)`(stored)` with attempt `number` added,
    /// encoded.
    pub(crate) fn record(stored: Option<&str>, number: u32, at: SystemTime, error: &str) -> String {
        let mut history = Self::parse(stored);
        history.push(number, at, error);
        history.encode()
    }

    /// What a dead letter shows of its attempts: the history `stored`; or,
    /// for one written before histories were kept (or whose history cannot
    /// be read), its last error as the one attempt known, when it died. The
    /// attempts made but not shown are counted in `not_kept`.
    pub(crate) fn of_dead(
        stored: Option<&str>,
        attempts: u32,
        last_error: &str,
        dead_at: SystemTime,
    ) -> Self {
        let mut history = Self::parse(stored);
        if history.kept.is_empty() {
            history.push(attempts, dead_at, last_error);
        }
        let shown = history.kept.len() as u32;
        history.not_kept = history.not_kept.max(attempts.saturating_sub(shown));
        history
    }

    /// One line of printable ASCII: `1;not_kept;n@ms=error;n@ms=error…`
    /// (`n` the attempt's number, `ms` its time since the epoch), each
    /// error percent-escaped (`%`, `;`, control and non-ASCII bytes).
    pub(crate) fn encode(&self) -> String {
        let mut out = format!("{TAG};{}", self.not_kept);
        for a in &self.kept {
            let ms =
                a.at.duration_since(UNIX_EPOCH)
                    .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
            out.push(';');
            out.push_str(&a.number.to_string());
            out.push('@');
            out.push_str(&ms.to_string());
            out.push('=');
            escape_into(&a.error, &mut out);
        }
        out
    }

    fn decode(s: &str) -> Option<Self> {
        let mut parts = s.split(';');
        if parts.next()? != TAG {
            return None;
        }
        let not_kept = parts.next()?.parse().ok()?;
        let mut kept = Vec::new();
        for part in parts {
            if kept.len() >= MAX_ATTEMPTS_KEPT {
                return None;
            }
            let (head, error) = part.split_once('=')?;
            let (number, ms) = head.split_once('@')?;
            let number: u32 = number.parse().ok()?;
            let ms: u64 = ms.parse().ok().filter(|ms| *ms <= LATEST_MS)?;
            let error = unescape(error)?;
            kept.push(Attempt {
                number,
                at: UNIX_EPOCH.checked_add(Duration::from_millis(ms))?,
                error: cut(&error).to_owned(),
            });
        }
        Some(Self { kept, not_kept })
    }
}

/// A dead letter with its attempts: `history` as stored (see
/// [`History::of_dead`] for one stored without).
pub(crate) fn dead_letter(
    id: EntryId,
    message: Message,
    attempts: u32,
    error: String,
    dead_at: SystemTime,
    history: Option<&str>,
) -> DeadLetter {
    let history = History::of_dead(history, attempts, &error, dead_at);
    DeadLetter {
        id,
        message,
        attempts,
        error,
        dead_at,
        history: history.kept,
        attempts_not_kept: history.not_kept,
    }
}

/// `error` cut to at most [`MAX_ERROR_LEN`] bytes, on a character boundary.
pub(crate) fn cut(error: &str) -> &str {
    if error.len() <= MAX_ERROR_LEN {
        return error;
    }
    let mut end = MAX_ERROR_LEN;
    while !error.is_char_boundary(end) {
        end -= 1;
    }
    &error[..end]
}

fn escape_into(text: &str, out: &mut String) {
    for b in text.bytes() {
        if b == b'%' || b == b';' || !(0x20..0x7f).contains(&b) {
            out.push_str(&format!("%{b:02X}"));
        } else {
            out.push(char::from(b));
        }
    }
}

fn unescape(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(ms)
    }

    #[test]
    fn round_trips_hostile_text_as_one_ascii_line() {
        let mut h = History::default();
        h.push(1, at(1), "a;b%c\r\nd=é");
        h.push(2, at(2), "<img src=x onerror=alert(1)>");
        let line = h.encode();
        assert!(line.bytes().all(|b| (0x20..0x7f).contains(&b)), "{line}");
        assert_eq!(History::parse(Some(&line)), h);
    }

    #[test]
    fn keeps_the_first_and_the_latest_and_counts_the_rest() {
        let mut h = History::default();
        for i in 0..100u64 {
            h.push(i as u32 + 1, at(i), &format!("e{i}"));
        }
        assert_eq!(h.kept.len(), MAX_ATTEMPTS_KEPT);
        assert_eq!(h.not_kept, 100 - MAX_ATTEMPTS_KEPT as u32);
        assert_eq!(h.kept[0].error, "e0");
        assert_eq!(h.kept[1].error, format!("e{}", 100 - MAX_ATTEMPTS_KEPT + 1));
        assert_eq!(h.kept.last().unwrap().error, "e99");
        let huge = "é".repeat(300_000);
        h.push(101, at(7), &huge);
        let last = &h.kept.last().unwrap().error;
        assert!(last.len() <= MAX_ERROR_LEN && last.len() > MAX_ERROR_LEN - 4);
        assert!(h.encode().len() < MAX_ATTEMPTS_KEPT * (MAX_ERROR_LEN * 3 + 32));
    }

    #[test]
    fn a_malformed_history_reads_as_none() {
        for bad in [
            "",
            "2;0",
            "1;x",
            "1;0;12",
            "1;0;1=a",
            "1;0;x@1=a",
            "1;0;1@x=a",
            "1;0;1@1=%zz",
            "1;0;1@1=%",
            "1;0;1@1=%C3",
            "1;0;1@253402300800000=a",
        ] {
            assert_eq!(History::parse(Some(bad)), History::default(), "{bad}");
        }
        let many = format!("1;0{}", ";1@1=a".repeat(MAX_ATTEMPTS_KEPT + 1));
        assert_eq!(History::parse(Some(&many)), History::default());
    }

    #[test]
    fn an_old_dead_letter_shows_its_last_error() {
        let h = History::of_dead(None, 5, "boom", at(9));
        assert_eq!(
            h.kept,
            [Attempt {
                number: 5,
                at: at(9),
                error: "boom".into()
            }]
        );
        assert_eq!(h.not_kept, 4);
        let h = History::of_dead(Some("garbage"), 1, "boom", at(9));
        assert_eq!(h.kept.len(), 1);
        assert_eq!(h.not_kept, 0);
    }
}
