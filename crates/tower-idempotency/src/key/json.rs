//! Reading a few values out of a JSON body without building a tree: one pass
//! over the body validates it and, on the way, borrows the raw value at each
//! wanted JSON pointer, skipping everything else.

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::fmt;

/// The JSON pointers a key spec reads, as a tree of their tokens, so that
/// one pass over a body finds them all.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(super) struct Paths {
    pointers: Vec<Cow<'static, str>>,
    root: Node,
}

/// One step down: the pointers that end here (their indices) and the tokens
/// that go further.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct Node {
    ends: Vec<usize>,
    children: Vec<(String, Node)>,
}

impl Paths {
    /// The tree of `pointers` (RFC 6901; one not starting with `/` other
    /// than the empty pointer never matches).
    pub(super) fn new<'p>(pointers: impl IntoIterator<Item = &'p Cow<'static, str>>) -> Self {
        let mut paths = Paths::default();
        for pointer in pointers {
            if paths.pointers.contains(pointer) {
                continue;
            }
            let index = paths.pointers.len();
            paths.pointers.push(pointer.clone());
            let tokens = match pointer.as_ref() {
                "" => Some(Vec::new()),
                p => p.strip_prefix('/').map(|rest| {
                    rest.split('/')
                        .map(|t| t.replace("~1", "/").replace("~0", "~"))
                        .collect()
                }),
            };
            let Some(tokens) = tokens else { continue };
            let mut node = &mut paths.root;
            for token in tokens {
                let at = match node.children.iter().position(|(t, _)| *t == token) {
                    Some(at) => at,
                    None => {
                        node.children.push((token, Node::default()));
                        node.children.len() - 1
                    }
                };
                node = &mut node.children[at].1;
            }
            node.ends.push(index);
        }
        paths
    }

    /// Whether there is any pointer to read.
    pub(super) fn is_empty(&self) -> bool {
        self.pointers.is_empty()
    }

    /// Checks that `body` is one JSON value and returns the raw value at
    /// each pointer (in the order given to [`Paths::new`], `None` where
    /// absent). Where a member name repeats, its first occurrence counts.
    pub(super) fn read<'a>(&self, body: &'a [u8]) -> Result<Found<'a, '_>, serde_json::Error> {
        // Checked whole first, as skipped strings are not checked on the way.
        let body = std::str::from_utf8(body).map_err(|e| {
            de::Error::custom(format_args!("invalid UTF-8 at byte {}", e.valid_up_to()))
        })?;
        let mut values = vec![None; self.pointers.len()];
        let mut de = serde_json::Deserializer::from_str(body);
        Walk {
            node: &self.root,
            out: &mut values,
        }
        .deserialize(&mut de)?;
        de.end()?;
        Ok(Found {
            paths: self,
            values,
        })
    }
}

/// The values one [`Paths::read`] found.
pub(super) struct Found<'a, 'p> {
    paths: &'p Paths,
    values: Vec<Option<&'a RawValue>>,
}

impl<'a> Found<'a, '_> {
    /// The value at `pointer` as text: strings unescaped, `null` as `None`,
    /// numbers and booleans as written, objects and arrays in canonical form
    /// (sorted keys, no spaces) so that re-serialised retries compare equal.
    pub(super) fn text_at(&self, pointer: &str) -> Option<Cow<'a, str>> {
        let at = self.paths.pointers.iter().position(|p| p == pointer)?;
        let text = self.values[at]?.get();
        match text.as_bytes().first()? {
            // A string without escapes is its bytes between the quotes: the
            // read checked it whole (UTF-8, no control characters).
            b'"' if !text.contains('\\') => Some(Cow::Borrowed(&text[1..text.len() - 1])),
            b'"' => serde_json::from_str::<Str<'a>>(text).ok().map(|s| s.0),
            b'n' => None,
            b'{' | b'[' => serde_json::from_str::<serde_json::Value>(text)
                .ok()
                .map(|v| Cow::Owned(v.to_string())),
            _ => Some(Cow::Borrowed(text)),
        }
    }
}

/// Reads one value: keeps it raw where pointers end, goes down into it
/// where they go further, skips it (still validating) otherwise.
struct Walk<'n, 'o, 'de> {
    node: &'n Node,
    out: &'o mut [Option<&'de RawValue>],
}

impl<'de> DeserializeSeed<'de> for Walk<'_, '_, 'de> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        if self.node.ends.is_empty() {
            return d.deserialize_any(self);
        }
        let raw = <&'de RawValue as de::Deserialize>::deserialize(d)?;
        for &i in &self.node.ends {
            self.out[i] = Some(raw);
        }
        if !self.node.children.is_empty() {
            // A pointer ends here and others go further: walk the kept value
            // again (it is valid: it was just read whole).
            let mut inner = serde_json::Deserializer::from_str(raw.get());
            let walk = Walk {
                node: self.node,
                out: self.out,
            };
            (&mut inner)
                .deserialize_any(walk)
                .map_err(de::Error::custom)?;
        }
        Ok(())
    }
}

impl<'de> Visitor<'de> for Walk<'_, '_, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut seen = Seen::new(self.node.children.len());
        while let Some(name) = map.next_key::<Str<'de>>()? {
            let child = self
                .node
                .children
                .iter()
                .position(|(token, _)| *token == name.0);
            match child {
                Some(at) if seen.first(at) => map.next_value_seed(Walk {
                    node: &self.node.children[at].1,
                    out: &mut *self.out,
                })?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut i = 0usize;
        loop {
            let child = self
                .node
                .children
                .iter()
                .find(|(token, _)| is_index(token) && token.parse::<usize>().ok() == Some(i));
            let more = match child {
                Some((_, node)) => seq
                    .next_element_seed(Walk {
                        node,
                        out: &mut *self.out,
                    })?
                    .is_some(),
                None => seq.next_element::<IgnoredAny>()?.is_some(),
            };
            if !more {
                return Ok(());
            }
            i += 1;
        }
    }

    skip_scalars!();
}

/// An array index token as RFC 6901 writes one: `0`, or digits without a
/// leading zero.
fn is_index(token: &str) -> bool {
    !token.is_empty()
        && token.bytes().all(|b| b.is_ascii_digit())
        && (token == "0" || !token.starts_with('0'))
}

/// Which of an object's wanted members were met already: the first of
/// repeated names counts.
struct Seen {
    small: u64,
    big: Vec<bool>,
}

impl Seen {
    fn new(n: usize) -> Self {
        Self {
            small: 0,
            big: if n > 64 { vec![false; n] } else { Vec::new() },
        }
    }

    /// Whether member `at` is met for the first time (and marks it met).
    fn first(&mut self, at: usize) -> bool {
        if self.big.is_empty() {
            let bit = 1u64 << at;
            let first = self.small & bit == 0;
            self.small |= bit;
            first
        } else {
            !std::mem::replace(&mut self.big[at], true)
        }
    }
}

/// A string borrowed from the input when it has no escapes.
pub(super) struct Str<'a>(pub(super) Cow<'a, str>);

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

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(body: &[u8], pointers: &[&'static str]) -> Vec<Option<String>> {
        let pointers: Vec<Cow<'static, str>> = pointers.iter().map(|p| Cow::Borrowed(*p)).collect();
        let paths = Paths::new(&pointers);
        let found = paths.read(body).unwrap();
        pointers
            .iter()
            .map(|p| found.text_at(p).map(Cow::into_owned))
            .collect()
    }

    #[test]
    fn walks_objects_and_arrays() {
        let body = br#" {"id":"a\"b","n":12,"z":null,"o":{"b":2, "a":[1, {"x":"y"}]},"arr":[{"k":"first"},{"k":"second"}],"s/l":1,"t~":2} "#;
        let got = texts(
            body,
            &[
                "/id",
                "/n",
                "/z",
                "/missing",
                "/o",
                "/o/a/1/x",
                "/arr/1/k",
                "/arr/2/k",
                "/id/deeper",
                "/arr/01/k",
                "/s~1l",
                "/t~0",
                "",
                "nope",
            ],
        );
        let want = [
            Some("a\"b"),
            Some("12"),
            None,
            None,
            Some(r#"{"a":[1,{"x":"y"}],"b":2}"#),
            Some("y"),
            Some("second"),
            None,
            None,
            None,
            Some("1"),
            Some("2"),
            Some(
                r#"{"arr":[{"k":"first"},{"k":"second"}],"id":"a\"b","n":12,"o":{"a":[1,{"x":"y"}],"b":2},"s/l":1,"t~":2,"z":null}"#,
            ),
            None,
        ];
        let want: Vec<Option<String>> = want.iter().map(|w| w.map(str::to_owned)).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn the_first_of_repeated_members_counts() {
        let body =
            br#"{"id":"first","o":{"k":1,"k":2},"id":"second","a":[0,1,2],"p":{},"p":{"q":1}}"#;
        let got = texts(
            body,
            &["/id", "/o/k", "/a/0", "/a/2", "/a/3", "/o/missing", "/p/q"],
        );
        let want = [
            Some("first"),
            Some("1"),
            Some("0"),
            Some("2"),
            None,
            None,
            None,
        ];
        let want: Vec<Option<String>> = want.iter().map(|w| w.map(str::to_owned)).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn unescaped_strings_are_borrowed() {
        let pointers = [Cow::Borrowed("/id")];
        let paths = Paths::new(&pointers);
        let found = paths.read(br#"{"id":"plain"}"#).unwrap();
        assert!(matches!(found.text_at("/id"), Some(Cow::Borrowed("plain"))));
        let found = paths.read(br#"{"id":"caf\u00e9 \"x\""}"#).unwrap();
        assert_eq!(found.text_at("/id").as_deref(), Some("café \"x\""));
        let found = paths.read(r#"{"id":"café ✓"}"#.as_bytes()).unwrap();
        assert!(matches!(
            found.text_at("/id"),
            Some(Cow::Borrowed("café ✓"))
        ));
        let found = paths.read(br#"{"id":""}"#).unwrap();
        assert!(matches!(found.text_at("/id"), Some(Cow::Borrowed(""))));
    }

    #[test]
    fn rejects_what_is_not_one_json_value_wherever_the_fault_is() {
        let pointers = [Cow::Borrowed("/id")];
        let paths = Paths::new(&pointers);
        for body in [
            &br#"{"id":"x""#[..],
            b"",
            br#"{"id":"x","rest":[1,2}"#,
            br#"{"id":"x"} trailing"#,
            br#"{"id":"x","bad":tru}"#,
            b"{\"id\":\"x\",\"s\":\"\xff\"}",
            // Control characters are escaped in JSON strings, read or skipped.
            b"{\"id\":\"a\nb\"}",
            b"{\"id\":\"x\",\"s\":\"a\tb\"}",
        ] {
            assert!(
                paths.read(body).is_err(),
                "{:?}",
                String::from_utf8_lossy(body)
            );
        }
    }
}
