//! Refusing JSON bodies that repeat a member name: readers disagree on
//! which of the repeated members counts (the key reads the first, most
//! upstreams the last), so a signed body must not repeat any.

use super::json::Str;
use super::MAX_FIELDS;
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use std::borrow::Cow;
use std::fmt;

/// Checks that `body` is one JSON value in which no object repeats a member
/// name, at any depth: the readers that keep the first of repeated members
/// and those that keep the last (`JSON.parse`, Jackson) then read the same
/// document. An object of more than [`MAX_FIELDS`] members is refused too
/// (bounded work). `Err` names the first fault. Linear in the body: each
/// name is looked up in a hash set of its object's earlier ones.
pub(crate) fn unique_members(body: &[u8]) -> Result<(), String> {
    let mut de = serde_json::Deserializer::from_slice(body);
    de::Deserializer::deserialize_any(&mut de, Unique).map_err(|e| e.to_string())?;
    de.end().map_err(|e| e.to_string())
}

/// Walks one JSON value, refusing repeated member names.
struct Unique;

impl<'de> DeserializeSeed<'de> for Unique {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Unique {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut names: foldhash::HashSet<Cow<'de, str>> = foldhash::HashSet::default();
        while let Some(name) = map.next_key::<Str<'de>>()? {
            if names.len() == MAX_FIELDS {
                return Err(de::Error::custom(format_args!(
                    "JSON object of more than {MAX_FIELDS} members"
                )));
            }
            if names.contains(&name.0) {
                return Err(de::Error::custom(format_args!(
                    "repeated JSON member {:?}",
                    name.0
                )));
            }
            names.insert(name.0);
            map.next_value_seed(Unique)?;
        }
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Unique)?.is_some() {}
        Ok(())
    }

    skip_scalars!();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_members_are_refused_at_any_depth() {
        for body in [
            &br#"{"notificationItems":[],"notificationItems":[]}"#[..],
            br#"{"a":{"b":1,"b":2}}"#,
            br#"[{"x":1},{"y":{"z":1,"\u007a":2}}]"#,
            br#"{"a":1} {"a":1}"#,
            br#"{"a":1"#,
        ] {
            assert!(
                unique_members(body).is_err(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        assert!(unique_members(br#"{"a":{"b":1},"b":[{"b":1},{"b":2}],"c":"b"}"#).is_ok());
    }
}
