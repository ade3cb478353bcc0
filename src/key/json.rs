//! Reading a few values out of a JSON body without building a tree: the body
//! is validated once, then each JSON pointer walks down borrowed raw values,
//! skipping everything else.

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
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
        current = match text.as_bytes().first()? {
            b'{' => de.deserialize_map(FindKey(&token)).ok()??,
            b'[' => {
                let index: usize = token.parse().ok()?;
                de.deserialize_seq(FindIndex(index)).ok()??
            }
            _ => return None,
        };
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

/// Finds one member of an object, skipping the others.
struct FindKey<'k>(&'k str);

impl<'de> Visitor<'de> for FindKey<'_> {
    type Value = Option<&'de RawValue>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut found = None;
        while let Some(key) = map.next_key::<Str<'de>>()? {
            if found.is_none() && key.0 == self.0 {
                found = Some(map.next_value::<&'de RawValue>()?);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(found)
    }
}

/// Finds one element of an array, skipping the others.
struct FindIndex(usize);

impl<'de> Visitor<'de> for FindIndex {
    type Value = Option<&'de RawValue>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut found = None;
        let mut i = 0;
        loop {
            if i == self.0 {
                match seq.next_element::<&'de RawValue>()? {
                    Some(v) => found = Some(v),
                    None => break,
                }
            } else if seq.next_element::<IgnoredAny>()?.is_none() {
                break;
            }
            i += 1;
        }
        Ok(found)
    }
}

impl<'de> DeserializeSeed<'de> for FindKey<'_> {
    type Value = Option<&'de RawValue>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

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
