//! Reading a few values out of a JSON body without building a tree: the body
//! is validated once, then each JSON pointer walks down borrowed raw values,
//! skipping what comes before the member or element it wants and stopping
//! there (the body is already known to be valid, so the rest need not be
//! read again).

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::fmt;

/// Checks that `body` is one JSON value and returns it, borrowed.
pub(super) fn parse(body: &[u8]) -> Result<&RawValue, serde_json::Error> {
    serde_json::from_slice(body)
}

/// The value at `pointer` as text: strings unescaped, `null` as `None`,
/// numbers and booleans as written, objects and arrays in canonical form
/// (sorted keys, no spaces) so that re-serialised retries compare equal.
pub(super) fn text_at<'a>(root: &'a RawValue, pointer: &str) -> Option<Cow<'a, str>> {
    let value = value_at(root, pointer)?;
    let text = value.get();
    match text.as_bytes().first()? {
        b'"' => serde_json::from_str::<Str<'a>>(text).ok().map(|s| s.0),
        b'n' => None,
        b'{' | b'[' => serde_json::from_str::<serde_json::Value>(text)
            .ok()
            .map(|v| Cow::Owned(v.to_string())),
        _ => Some(Cow::Borrowed(text)),
    }
}

fn value_at<'a>(root: &'a RawValue, pointer: &str) -> Option<&'a RawValue> {
    if pointer.is_empty() {
        return Some(root);
    }
    let mut current = root;
    for token in pointer.strip_prefix('/')?.split('/') {
        let token: Cow<'_, str> = if token.contains('~') {
            Cow::Owned(token.replace("~1", "/").replace("~0", "~"))
        } else {
            Cow::Borrowed(token)
        };
        let text = current.get();
        let mut de = serde_json::Deserializer::from_str(text);
        let mut found = None;
        // The visitors stop with an error once they hold the value: the
        // document was validated whole, so the error only means "found".
        let _ = match text.as_bytes().first()? {
            b'{' => de.deserialize_map(FindKey(&token, &mut found)).map(drop),
            b'[' => {
                let index: usize = token.parse().ok()?;
                de.deserialize_seq(FindIndex(index, &mut found)).map(drop)
            }
            _ => return None,
        };
        current = found?;
    }
    Some(current)
}

/// A string borrowed from the input when it has no escapes.
struct Str<'a>(Cow<'a, str>);

impl<'de> de::Deserialize<'de> for Str<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Str<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Owned(v.to_owned())))
            }
        }
        d.deserialize_str(V)
    }
}

/// Finds the first member of an object with this name: skips the members
/// before it, puts it in the slot and stops.
struct FindKey<'k, 'o, 'de>(&'k str, &'o mut Option<&'de RawValue>);

impl<'de> Visitor<'de> for FindKey<'_, '_, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<Str<'de>>()? {
            if key.0 == self.0 {
                *self.1 = Some(map.next_value::<&'de RawValue>()?);
                return Err(de::Error::custom(FOUND));
            }
            map.next_value::<IgnoredAny>()?;
        }
        Ok(())
    }
}

/// Finds one element of an array: skips the elements before it, puts it in
/// the slot and stops.
struct FindIndex<'o, 'de>(usize, &'o mut Option<&'de RawValue>);

impl<'de> Visitor<'de> for FindIndex<'_, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        for _ in 0..self.0 {
            if seq.next_element::<IgnoredAny>()?.is_none() {
                return Ok(());
            }
        }
        *self.1 = seq.next_element::<&'de RawValue>()?;
        Err(de::Error::custom(FOUND))
    }
}

/// The error the visitors stop with once they hold the value.
const FOUND: &str = "found";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walks_objects_and_arrays() {
        let body = br#" {"id":"a\"b","n":12,"z":null,"o":{"b":2, "a":[1, {"x":"y"}]},"arr":[{"k":"first"},{"k":"second"}]} "#;
        let root = parse(body).unwrap();
        assert_eq!(text_at(root, "/id").unwrap(), "a\"b");
        assert_eq!(text_at(root, "/n").unwrap(), "12");
        assert_eq!(text_at(root, "/z"), None);
        assert_eq!(text_at(root, "/missing"), None);
        assert_eq!(text_at(root, "/o").unwrap(), r#"{"a":[1,{"x":"y"}],"b":2}"#);
        assert_eq!(text_at(root, "/o/a/1/x").unwrap(), "y");
        assert_eq!(text_at(root, "/arr/1/k").unwrap(), "second");
        assert_eq!(text_at(root, "/arr/2/k"), None);
        assert_eq!(text_at(root, "/id/deeper"), None);
    }

    #[test]
    fn the_first_of_repeated_members_counts_and_the_walk_stops_there() {
        let root = parse(br#"{"id":"first","o":{"k":1,"k":2},"id":"second","a":[0,1,2]}"#).unwrap();
        assert_eq!(text_at(root, "/id").unwrap(), "first");
        assert_eq!(text_at(root, "/o/k").unwrap(), "1");
        assert_eq!(text_at(root, "/a/0").unwrap(), "0");
        assert_eq!(text_at(root, "/a/2").unwrap(), "2");
        assert_eq!(text_at(root, "/a/3"), None);
        assert_eq!(text_at(root, "/o/missing"), None);
    }

    #[test]
    fn unescaped_strings_are_borrowed() {
        let root = parse(br#"{"id":"plain"}"#).unwrap();
        assert!(matches!(text_at(root, "/id"), Some(Cow::Borrowed("plain"))));
    }

    #[test]
    fn rejects_truncated_documents() {
        assert!(parse(br#"{"id":"x""#).is_err());
        assert!(parse(b"").is_err());
    }
}
