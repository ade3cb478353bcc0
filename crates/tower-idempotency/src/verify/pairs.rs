//! Signing strings of `k=v` pairs joined with `&` (Alipay, WeChat Pay v2):
//! the names and values that would let one signed string stand for two
//! field maps.

use super::VerifyError;
use std::borrow::Cow;

/// Checks that the decoded `name` and `value` of a signed field hold no
/// field boundary of the signed string: a name with `&` or `=`, or a value
/// with an `&` followed (anywhere later in it) by `=`. The scheme signs the
/// decoded values as they are, so `notify_id=N&notify_time=T` is one field
/// `notify_id` holding `N&notify_time=T` or two fields: both sign the same
/// bytes, and a forger could fold a signed field into another to change the
/// key. Refused, the signed string reads as exactly one field map. An `&` or
/// `=` alone in a value (`Tom & Jerry`, `a=b`) reads as no boundary and is
/// kept.
pub(crate) fn check_pair(name: &str, value: &[u8]) -> Result<(), VerifyError> {
    let boundary = name.bytes().any(|b| b == b'&' || b == b'=')
        || value
            .iter()
            .position(|&b| b == b'&')
            .is_some_and(|at| value[at..].contains(&b'='));
    if boundary {
        return Err(VerifyError::Malformed(Cow::Owned(format!(
            "field {name:?} holds `&` or `=` where the signed string would read a field boundary"
        ))));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boundaries_are_refused_and_lone_separators_kept() {
        for (name, value) in [
            ("notify_id", &b"N&notify_time=T"[..]),
            ("a", b"&="),
            ("a", b"x&&y=z"),
            ("a=b", b"c"),
            ("a&b", b"c"),
        ] {
            assert!(check_pair(name, value).is_err(), "{name} {value:?}");
        }
        for (name, value) in [
            ("subject", &b"Tom & Jerry"[..]),
            ("a", b"b=c"),
            ("a", b"b=c&d"),
            ("a", b"&"),
            ("a", b""),
        ] {
            assert!(check_pair(name, value).is_ok(), "{name} {value:?}");
        }
    }
}
