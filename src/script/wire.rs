//! The wire forms of a script call: RESP (the host's Redis client) and webdis's percent-encoded path
//! (the HTTP bridge), written argument by argument.

use crate::prelude::*;

use crate::quote::hex_digit;

use super::acquire::{AcquireTemplate, Encoding};
use super::{Invocation, Script};

/// Writes a script call argument by argument in either wire form.
pub(super) struct ArgWriter<'a> {
    out: &'a mut Vec<u8>,
    encoding: Encoding,
    first: bool,
}

impl<'a> ArgWriter<'a> {
    /// A call of `count` words (the RESP array header is written now).
    pub(super) fn new(out: &'a mut Vec<u8>, encoding: Encoding, count: usize) -> Self {
        if encoding == Encoding::Resp {
            push_length(out, b'*', count);
        }
        ArgWriter { out, encoding, first: true }
    }

    pub(super) fn arg(&mut self, bytes: &[u8]) {
        if self.encoding == Encoding::WebdisPath && self.first {
            // webdis's path starts with the command, without a `/`.
            self.out.extend_from_slice(bytes);
        } else {
            push_arg(self.out, self.encoding, bytes);
        }
        self.first = false;
    }

    /// `EVALSHA <sha>` or `EVAL <source>`, and the number of keys of `limiters` limiters.
    pub(super) fn script(&mut self, script: &Script, invocation: Invocation, limiters: usize) {
        match invocation {
            Invocation::BySha => {
                self.arg(b"EVALSHA");
                self.arg(script.sha().as_bytes());
            }
            Invocation::BySource => {
                self.arg(b"EVAL");
                self.arg(script.source.as_bytes());
            }
        }
        self.arg(itoa::Buffer::new().format(5 * limiters).as_bytes());
    }

    /// The five keys of limiter `name` ([`LimiterKeys`]) with `template`'s client id.
    pub(super) fn keys(&mut self, name: &str, template: &AcquireTemplate) {
        let (open, close) = if name.contains('{') { ("", "") } else { ("{", "}") };
        self.arg(name.as_bytes());
        let mut key = Vec::with_capacity(name.len() + 64);
        for (suffix, per_client) in [(":value", false), (":value", true), (":permits", false), (":permits", true)] {
            key.clear();
            for part in [open, name, close, suffix] {
                key.extend_from_slice(part.as_bytes());
            }
            if per_client {
                key.extend_from_slice(&template.client_suffix.0);
            }
            self.arg(&key);
        }
    }

    /// How many bytes are written so far.
    pub(super) fn position(&self) -> usize {
        self.out.len()
    }

    pub(super) fn finish(self) {
        if self.encoding == Encoding::WebdisPath {
            self.out.extend_from_slice(b".raw");
        }
    }
}

/// One argument in the wire form: a RESP bulk string, or `/` and the percent-encoded bytes.
pub(super) fn push_arg(out: &mut Vec<u8>, encoding: Encoding, bytes: &[u8]) {
    match encoding {
        Encoding::Resp => push_bulk(out, bytes),
        Encoding::WebdisPath => {
            out.push(b'/');
            push_encoded(out, bytes);
        }
    }
}

/// One argument made of `parts` joined, in the wire form.
pub(super) fn push_arg_parts(out: &mut Vec<u8>, encoding: Encoding, parts: &[&str]) {
    match encoding {
        Encoding::Resp => {
            push_length(out, b'$', parts.iter().map(|p| p.len()).sum());
            for part in parts {
                out.extend_from_slice(part.as_bytes());
            }
            out.extend_from_slice(b"\r\n");
        }
        Encoding::WebdisPath => {
            out.push(b'/');
            for part in parts {
                push_encoded(out, part.as_bytes());
            }
        }
    }
}

/// `<kind><n>\r\n`.
pub(super) fn push_length(out: &mut Vec<u8>, kind: u8, n: usize) {
    out.push(kind);
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// One RESP bulk string.
pub(super) fn push_bulk(out: &mut Vec<u8>, bytes: &[u8]) {
    push_length(out, b'$', bytes.len());
    out.extend_from_slice(bytes);
    out.extend_from_slice(b"\r\n");
}

/// Percent-encoded as webdis's path arguments need: everything but ASCII letters and digits, as
/// `percent_encode(bytes, NON_ALPHANUMERIC)` does (the unit tests compare the two), one byte at a time.
pub(super) fn push_encoded(out: &mut Vec<u8>, bytes: &[u8]) {
    // Room for the worst case, then each byte written in place and the rest cut off: no capacity check
    // per byte (docs/deploying.md, "Lean guest").
    let start = out.len();
    out.resize(start + 3 * bytes.len(), 0);
    let mut at = start;
    for &byte in bytes {
        if byte.is_ascii_alphanumeric() {
            if let Some(slot) = out.get_mut(at) {
                *slot = byte;
            }
            at += 1;
        } else {
            if let Some(slot) = out.get_mut(at..at + 3) {
                slot.copy_from_slice(&[b'%', hex_digit(byte >> 4, b'A'), hex_digit(byte, b'A')]);
            }
            at += 3;
        }
    }
    out.truncate(at);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
    use super::*;

    #[test]
    fn every_byte_is_percent_encoded_as_the_percent_encoding_crate_does() {
        let all: Vec<u8> = (0..=255).collect();
        let mut ours = Vec::new();
        push_encoded(&mut ours, &all);
        let theirs: String = percent_encoding::percent_encode(&all, percent_encoding::NON_ALPHANUMERIC).collect();
        assert_eq!(String::from_utf8(ours).unwrap(), theirs);
    }
}
