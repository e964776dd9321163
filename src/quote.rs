//! Quoting untrusted text for log lines and error messages: printable ASCII as it is, everything else
//! escaped, so a value from a request, a configuration or a Redis reply cannot forge a line (no control
//! characters reach the log).
//!
//! (`{:?}` would do much the same, but brings core's Unicode tables into the module: docs/deploying.md, "Module
//! size".)

use crate::prelude::*;

/// `bytes` between double quotes: printable ASCII as it is, `\"` and `\\` escaped, `\n`, `\r`, `\t`, and
/// every other byte as `\xNN`.
#[inline]
pub fn quoted(bytes: impl AsRef<[u8]>) -> String {
    quoted_bytes(bytes.as_ref())
}

/// [`quoted`] without the double quotes: untrusted text inside a message of its own shape.
pub fn escaped(text: &str) -> String {
    let quoted = quoted_bytes(text.as_bytes());
    quoted.get(1..quoted.len() - 1).unwrap_or_default().to_string()
}

/// [`quoted`], compiled once (not per argument type).
fn quoted_bytes(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() + 2);
    out.push('"');
    for &byte in bytes {
        match byte {
            b'"' => out.push_str("\\\""),
            b'\\' => out.push_str("\\\\"),
            b'\n' => out.push_str("\\n"),
            b'\r' => out.push_str("\\r"),
            b'\t' => out.push_str("\\t"),
            0x20..=0x7e => out.push(char::from(byte)),
            other => {
                out.push_str("\\x");
                out.push(char::from(hex_digit(other >> 4, b'a')));
                out.push(char::from(hex_digit(other & 0x0f, b'a')));
            }
        }
    }
    out.push('"');
    out
}

/// The hexadecimal digit of `nibble` (`0..=15`; higher bits are ignored), with `ten` (`b'a'` or `b'A'`)
/// as the digit for 10.
pub fn hex_digit(nibble: u8, ten: u8) -> u8 {
    match nibble & 0x0f {
        digit @ 0..=9 => b'0' + digit,
        digit => ten + (digit - 10),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_and_non_ascii_are_escaped() {
        assert_eq!(quoted("webdis"), "\"webdis\"");
        assert_eq!(quoted("a\"b\\c\nd\r\te"), "\"a\\\"b\\\\c\\nd\\r\\te\"");
        assert_eq!(quoted([0u8, 0x7f, 0xc3, 0xa9]), "\"\\x00\\x7f\\xc3\\xa9\"");
    }
}
