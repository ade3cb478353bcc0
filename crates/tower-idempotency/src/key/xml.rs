//! Reading the children of the root element of a flat XML body (WeChat Pay
//! v2 notifications), text and CDATA alike: one strict parse that the key
//! and the verifier share, so both read the same fields.

use std::borrow::Cow;

/// Reads the `wanted` children of the root element of a flat XML document
/// (the shape of WeChat Pay v2 notifications); see [`flat_fields`] for what
/// is refused.
pub(super) fn parse_flat_xml<'w>(
    body: &[u8],
    wanted: &[&'w str],
) -> Result<Vec<(&'w str, String)>, String> {
    let fields = flat_fields(body).map_err(Cow::into_owned)?;
    Ok(fields
        .into_iter()
        .filter_map(|(name, value)| {
            let hit = wanted.iter().copied().find(|w| *w == name)?;
            Some((hit, value))
        })
        .collect())
}

/// Every child of the root element of a flat XML document, as
/// `(name, text)` with CDATA and entities resolved, the text as sent (the
/// channel signs it untrimmed).
///
/// Refused, so that no two readers can read the document differently: more
/// than one root, a nested element where a field's text is expected, text or
/// CDATA outside the fields, a repeated field, a comment or processing
/// instruction inside the root, a DOCTYPE, and anything not well formed;
/// and, to bound the work, more than [`MAX_FIELDS`](super::MAX_FIELDS)
/// fields. Linear in the body: each name is looked up in a hash set of the
/// earlier ones.
pub fn flat_fields(body: &[u8]) -> Result<Vec<(String, String)>, Cow<'static, str>> {
    use quick_xml::events::Event;
    let bad = |e: quick_xml::Error| Cow::Owned(format!("XML body: {e}"));
    let mut reader = quick_xml::Reader::from_reader(body);
    let mut out: Vec<(String, String)> = Vec::new();
    let mut depth = 0usize;
    let mut current: Option<(String, String)> = None;
    let mut roots = 0usize;
    let name_of = |raw: &[u8]| {
        std::str::from_utf8(raw)
            .map(str::to_owned)
            .map_err(|_| Cow::Borrowed("XML element name is not UTF-8"))
    };
    let mut names = foldhash::HashSet::default();
    let mut push = |out: &mut Vec<(String, String)>, name: String, value: String| {
        if out.len() == super::MAX_FIELDS {
            return Err(Cow::Owned(format!(
                "XML body of more than {} fields",
                super::MAX_FIELDS
            )));
        }
        if !names.insert(name.clone()) {
            return Err(Cow::Owned(format!("repeated XML element <{name}>")));
        }
        out.push((name, value));
        Ok(())
    };
    loop {
        match reader.read_event().map_err(bad)? {
            Event::Start(e) => {
                match depth {
                    0 => {
                        roots += 1;
                        if roots > 1 {
                            return Err(Cow::Borrowed("more than one XML root element"));
                        }
                    }
                    1 => current = Some((name_of(e.name().as_ref())?, String::new())),
                    _ => {
                        let field = current.as_ref().map_or("", |(n, _)| n.as_str());
                        return Err(Cow::Owned(format!("nested XML element inside <{field}>")));
                    }
                }
                depth += 1;
            }
            Event::Empty(e) => match depth {
                0 => return Err(Cow::Borrowed("XML root element without fields")),
                1 => push(&mut out, name_of(e.name().as_ref())?, String::new())?,
                _ => {
                    let field = current.as_ref().map_or("", |(n, _)| n.as_str());
                    return Err(Cow::Owned(format!("nested XML element inside <{field}>")));
                }
            },
            Event::Text(t) => match current.as_mut() {
                Some((_, v)) if depth == 2 => {
                    v.push_str(&t.decode().map_err(|e| bad(e.into()))?);
                }
                _ if t.iter().all(u8::is_ascii_whitespace) => {}
                _ => return Err(Cow::Borrowed("XML text outside the fields")),
            },
            Event::GeneralRef(r) => match current.as_mut() {
                Some((_, v)) if depth == 2 => {
                    let reference = format!("&{};", r.decode().map_err(|e| bad(e.into()))?);
                    let text =
                        quick_xml::escape::unescape(&reference).map_err(|e| bad(e.into()))?;
                    v.push_str(&text);
                }
                _ => return Err(Cow::Borrowed("XML text outside the fields")),
            },
            Event::CData(c) => match current.as_mut() {
                Some((_, v)) if depth == 2 => {
                    let text = std::str::from_utf8(&c)
                        .map_err(|_| Cow::Borrowed("XML CDATA is not UTF-8"))?;
                    v.push_str(text);
                }
                _ => return Err(Cow::Borrowed("XML CDATA outside the fields")),
            },
            Event::End(_) => {
                if depth == 2
                    && let Some((name, value)) = current.take()
                {
                    push(&mut out, name, value)?;
                }
                depth = depth.saturating_sub(1);
            }
            Event::Comment(_) | Event::PI(_) if depth > 0 => {
                return Err(Cow::Borrowed(
                    "XML comment or processing instruction inside the root",
                ));
            }
            Event::DocType(_) => return Err(Cow::Borrowed("XML DOCTYPE")),
            Event::Eof => break,
            _ => {}
        }
    }
    if roots == 0 || depth != 0 {
        return Err(Cow::Borrowed("not a complete XML document"));
    }
    if out.is_empty() {
        return Err(Cow::Borrowed("XML root element without fields"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flat_xml_reads_cdata_and_text() {
        let xml = b"<xml><a><![CDATA[x y]]></a><skip>1</skip><b>12</b><c>a &amp; b</c></xml>";
        let got = parse_flat_xml(xml, &["a", "b", "c"]).unwrap();
        assert_eq!(
            got,
            vec![
                ("a", "x y".to_string()),
                ("b", "12".to_string()),
                ("c", "a & b".to_string()),
            ]
        );
    }

    #[test]
    fn flat_xml_refuses_what_two_readers_could_read_differently() {
        for xml in [
            &b"<xml><total_fee><a>100000</a></total_fee></xml>"[..],
            b"<xml><total_fee>1</total_fee><total_fee>2</total_fee></xml>",
            b"<xml><a>1</a>stray<b>2</b></xml>",
            b"<xml><a>1</a><![CDATA[x]]></xml>",
            b"<xml><a>1</a></xml><xml><a>2</a></xml>",
            b"<xml><a>1</a></xml>trailing",
            b"<xml><a>1<!-- c -->00</a></xml>",
            b"<!DOCTYPE x><xml><a>1</a></xml>",
            b"<xml><a>1</a><b/><b/></xml>",
            b"<xml><a><b/></a></xml>",
        ] {
            assert!(
                flat_fields(xml).is_err(),
                "{}",
                String::from_utf8_lossy(xml)
            );
        }
        let ok =
            flat_fields(b"<?xml version=\"1.0\"?>\n<xml>\n <a>1</a>\n <b/>\n</xml>\n").unwrap();
        assert_eq!(
            ok,
            vec![("a".into(), "1".into()), ("b".into(), String::new())]
        );
    }

    #[test]
    fn flat_xml_rejects_truncated() {
        assert!(parse_flat_xml(b"<xml><a>1</a>", &["a"]).is_err());
        assert!(parse_flat_xml(b"", &["a"]).is_err());
    }
}
