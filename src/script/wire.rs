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
        self.invoke(script, invocation);
        self.arg(itoa::Buffer::new().format(5 * limiters).as_bytes());
    }

    /// `EVALSHA <sha>` or `EVAL <source>`.
    pub(super) fn invoke(&mut self, script: &Script, invocation: Invocation) {
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
    }

    /// The five keys of limiter `name` ([`LimiterKeys`]) with `template`'s client id.
    pub(super) fn keys(&mut self, name: &str, template: &AcquireTemplate) {
        self.first = false;
        push_keys(self.out, self.encoding, name, template, template.value_suffix());
    }

    /// The bytes written so far, to write more arguments in place (never the first word).
    pub(super) fn out(&mut self) -> &mut Vec<u8> {
        self.first = false;
        self.out
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

/// The five keys of limiter `name` ([`LimiterKeys`]: the config hash, then `{name}` and `value` (`:value`, or a
/// sliding window counter's `:counter`: [`AcquireTemplate::value_suffix`]), `:value:<client>`,
/// `:permits`, `:permits:<client>`) with `template`'s client id, each an argument in the wire form, written
/// in place (no key is built on its own).
pub(super) fn push_keys(out: &mut Vec<u8>, encoding: Encoding, name: &str, template: &AcquireTemplate, value: &str) {
    let (open, close): (&[u8], &[u8]) = if name.contains('{') { (b"", b"") } else { (b"{", b"}") };
    push_arg(out, encoding, name.as_bytes());
    let client = template.client_suffix.0.as_slice();
    let value = value.as_bytes();
    for (suffix, per_client) in [(value, false), (b":value", true), (b":permits", false), (b":permits", true)] {
        let client: &[u8] = if per_client { client } else { b"" };
        push_arg_parts(out, encoding, &[open, name.as_bytes(), close, suffix, client]);
    }
}

/// One argument made of `parts` joined, in the wire form.
pub(super) fn push_arg_parts<P: AsRef<[u8]>>(out: &mut Vec<u8>, encoding: Encoding, parts: &[P]) {
    match encoding {
        Encoding::Resp => {
            push_length(out, b'$', parts.iter().map(|p| p.as_ref().len()).sum());
            for part in parts {
                out.extend_from_slice(part.as_ref());
            }
            out.extend_from_slice(b"\r\n");
        }
        Encoding::WebdisPath => {
            out.push(b'/');
            for part in parts {
                push_encoded(out, part.as_ref());
            }
        }
    }
}

/// `<kind><n>\r\n`. Most lengths of a call (its keys' and arguments') have one or two digits: those are
/// written in one copy, without formatting (about half of a settle's encoding was this formatting).
#[inline]
pub(super) fn push_length(out: &mut Vec<u8>, kind: u8, n: usize) {
    let digit = |d: usize| b"0123456789".get(d).copied().unwrap_or(b'0');
    match n {
        0..=9 => out.extend_from_slice(&[kind, digit(n), b'\r', b'\n']),
        10..=99 => out.extend_from_slice(&[kind, digit(n / 10), digit(n % 10), b'\r', b'\n']),
        _ => {
            out.push(kind);
            out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
            out.extend_from_slice(b"\r\n");
        }
    }
}

/// One RESP bulk string.
pub(super) fn push_bulk(out: &mut Vec<u8>, bytes: &[u8]) {
    push_length(out, b'$', bytes.len());
    out.extend_from_slice(bytes);
    out.extend_from_slice(b"\r\n");
}

/// By byte value: whether webdis's path form carries the byte as it is (an ASCII letter or digit); one
/// load per byte instead of two range checks.
// Every index is below 256: the loop's bound, and a byte's value.
#[allow(clippy::indexing_slicing)]
static PLAIN: [bool; 256] = {
    let mut table = [false; 256];
    let mut byte = 0;
    while byte < 256 {
        table[byte] = (byte as u8).is_ascii_alphanumeric();
        byte += 1;
    }
    table
};

/// Percent-encoded as webdis's path arguments need: everything but ASCII letters and digits, as
/// `percent_encode(bytes, NON_ALPHANUMERIC)` does (the unit tests compare the two). Runs of letters and
/// digits (most of a limiter name, all of a member's random bytes) are copied at once.
#[allow(clippy::indexing_slicing)] // PLAIN has an entry for every byte value.
pub(super) fn push_encoded(out: &mut Vec<u8>, bytes: &[u8]) {
    out.reserve(3 * bytes.len());
    let mut rest = bytes;
    loop {
        let run = rest.iter().position(|&byte| !PLAIN[usize::from(byte)]).unwrap_or(rest.len());
        let (plain, escaped) = rest.split_at(run);
        out.extend_from_slice(plain);
        let Some((&byte, tail)) = escaped.split_first() else { return };
        out.extend_from_slice(&[b'%', hex_digit(byte >> 4, b'A'), hex_digit(byte, b'A')]);
        rest = tail;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
    use super::*;

    /// Lengths of one, two and more digits are written as decimal text, the same as formatting them.
    #[test]
    fn a_length_is_its_decimal_text() {
        for n in [0, 1, 9, 10, 42, 99, 100, 101, 999, 65_536, usize::MAX] {
            let mut out = vec![b'x'];
            push_length(&mut out, b'$', n);
            assert_eq!(out, format!("x${n}\r\n").into_bytes());
        }
    }

    #[test]
    fn every_byte_is_percent_encoded_as_the_percent_encoding_crate_does() {
        let all: Vec<u8> = (0..=255).collect();
        let mut ours = Vec::new();
        push_encoded(&mut ours, &all);
        let theirs: String = percent_encoding::percent_encode(&all, percent_encoding::NON_ALPHANUMERIC).collect();
        assert_eq!(String::from_utf8(ours).unwrap(), theirs);
    }
}
