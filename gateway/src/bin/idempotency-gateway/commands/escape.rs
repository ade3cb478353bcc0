//! Text a sender chose (keys, ids, bodies, notes) as the admin commands
//! print it for a terminal: control characters escaped, so that a body with
//! `ESC ] 52 ; c ; … BEL` (a clipboard write) or a cursor move reaches the
//! operator as text, not as a command to the terminal.

use std::fmt::Write as _;

/// `s` with every control character (C0, DEL, C1) escaped: `\e`, `\a`,
/// `\t`, `\n`, `\r`, `\\`, else `\xNN` or `\u{NN}`.
pub(crate) fn shown(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    push(&mut out, s);
    out
}

/// Bytes as [`shown`] text; bytes that are not UTF-8 as `\xNN`.
pub(crate) fn shown_bytes(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        push(&mut out, chunk.valid());
        for b in chunk.invalid() {
            let _ = write!(out, "\\x{b:02x}");
        }
    }
    out
}

fn push(out: &mut String, s: &str) {
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\u{1b}' => out.push_str("\\e"),
            '\u{7}' => out.push_str("\\a"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if (c as u32) < 0x20 || c == '\u{7f}' => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            // C1 controls (U+0080..U+009F: CSI as one character) and the
            // bidirectional overrides that reorder what follows.
            c if c.is_control()
                || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}') =>
            {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(shown("\u{1b}]52;c;aGk=\u{7}"), "\\e]52;c;aGk=\\a");
        assert_eq!(shown("a\u{9b}2J\u{202e}b"), "a\\u{9b}2J\\u{202e}b");
        assert_eq!(shown("订单 42\\n"), "订单 42\\\\n");
        assert_eq!(shown_bytes(b"\xff<xml>\x1b[2J"), "\\xff<xml>\\e[2J");
    }
}
