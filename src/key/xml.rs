//! Reading the children of the root element of a flat XML body (WeChat Pay
//! v2 notifications), text and CDATA alike.

/// Reads the `wanted` children of the root element of a flat XML document
/// (the shape of WeChat Pay v2 notifications), text and CDATA alike; checks
/// that the whole document is well formed.
pub(super) fn parse_flat_xml<'w>(
    body: &[u8],
    wanted: &[&'w str],
) -> Result<Vec<(&'w str, String)>, String> {
    use quick_xml::events::Event;
    let mut reader = quick_xml::Reader::from_reader(body);
    let mut out = Vec::new();
    let mut depth = 0usize;
    let mut current: Option<(&'w str, String)> = None;
    let mut saw_root = false;
    let find = |name: &[u8]| wanted.iter().copied().find(|w| w.as_bytes() == name);
    loop {
        match reader.read_event().map_err(|e| e.to_string())? {
            Event::Start(e) => {
                depth += 1;
                saw_root = true;
                if depth == 2 {
                    current = find(e.name().as_ref()).map(|name| (name, String::new()));
                }
            }
            Event::Empty(e) => {
                saw_root = true;
                if depth == 1 {
                    if let Some(name) = find(e.name().as_ref()) {
                        out.push((name, String::new()));
                    }
                }
            }
            Event::Text(t) if depth == 2 => {
                if let Some((_, v)) = current.as_mut() {
                    v.push_str(&t.decode().map_err(|e| e.to_string())?);
                }
            }
            Event::GeneralRef(r) if depth == 2 => {
                if let Some((_, v)) = current.as_mut() {
                    let reference = format!("&{};", r.decode().map_err(|e| e.to_string())?);
                    let text =
                        quick_xml::escape::unescape(&reference).map_err(|e| e.to_string())?;
                    v.push_str(&text);
                }
            }
            Event::CData(c) if depth == 2 => {
                if let Some((_, v)) = current.as_mut() {
                    v.push_str(&String::from_utf8_lossy(&c));
                }
            }
            Event::End(_) => {
                if depth == 2 {
                    if let Some((name, value)) = current.take() {
                        out.push((name, value.trim().to_string()));
                    }
                }
                depth = depth.saturating_sub(1);
            }
            Event::Eof => break,
            _ => {}
        }
    }
    if !saw_root || depth != 0 {
        return Err("not a complete XML document".into());
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
    fn flat_xml_rejects_truncated() {
        assert!(parse_flat_xml(b"<xml><a>1</a>", &["a"]).is_err());
        assert!(parse_flat_xml(b"", &["a"]).is_err());
    }
}
