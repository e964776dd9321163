//! RESP: the seam between the filter and every transport. One [`Command`] goes out, one [`Reply`] comes
//! back, whatever carries them (the host's Redis interface writes the command's RESP bytes verbatim; the
//! HTTP bridge carries it in webdis's path form and answers raw RESP thanks to the `.raw` suffix).
//!
//! Encoding and decoding use the `redis-protocol` crate (RESP2); this module only maps its frames to the
//! small [`Reply`] type the rest of the filter matches on.

use std::fmt;

use percent_encoding::{percent_encode, NON_ALPHANUMERIC};
use redis_protocol::resp2::types::{BorrowedFrame, OwnedFrame};

/// A Redis command: its name and arguments, each a binary-safe byte string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Command {
    args: Vec<Vec<u8>>,
}

impl Command {
    /// A command named `name` (e.g. `EVALSHA`) with no arguments yet.
    pub fn new(name: &str) -> Self {
        Command { args: vec![name.as_bytes().to_vec()] }
    }

    /// Appends one argument.
    #[must_use]
    pub fn arg(mut self, arg: impl AsRef<[u8]>) -> Self {
        self.args.push(arg.as_ref().to_vec());
        self
    }

    /// The name and arguments, in order.
    pub fn args(&self) -> &[Vec<u8>] {
        &self.args
    }

    /// The command as a RESP array of bulk strings, as Redis reads it from a connection:
    ///
    /// ```text
    /// *2\r\n$3\r\nGET\r\n$3\r\nkey\r\n
    /// ```
    pub fn to_resp(&self) -> Vec<u8> {
        let parts: Vec<BorrowedFrame<'_>> = self.args.iter().map(|a| BorrowedFrame::BulkString(a)).collect();
        let frame = BorrowedFrame::Array(&parts);
        let mut buffer = vec![0; frame.encode_len(false)];
        // The buffer has exactly the encoded length, which is the only way encoding can fail.
        match redis_protocol::resp2::encode::encode_borrowed(&mut buffer, &frame, false) {
            Ok(written) => buffer.truncate(written),
            Err(_) => buffer.clear(),
        }
        buffer
    }

    /// The command in webdis's form, for the body of `POST /`: every argument percent-encoded (all but
    /// ASCII letters and digits, so `/`, `.` and binary bytes are safe), joined by `/`, with the `.raw`
    /// suffix that makes webdis answer with the raw RESP reply.
    ///
    /// ```text
    /// EVALSHA/1f0e...%7Berl%3Ar%7D%3Avalue/....raw
    /// ```
    pub fn to_webdis_path(&self) -> Vec<u8> {
        let mut out = String::new();
        for (index, arg) in self.args.iter().enumerate() {
            if index > 0 {
                out.push('/');
            }
            out.extend(percent_encode(arg, NON_ALPHANUMERIC));
        }
        out.push_str(".raw");
        out.into_bytes()
    }
}

/// A decoded Redis reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `+OK`.
    Simple(Vec<u8>),
    /// `-ERR ...`: an error reply, text without the leading `-`.
    Error(String),
    /// `:42` (signed: RESP integers can be negative, as `TTL` answers -1 and -2).
    Integer(i64),
    /// `$3\r\nabc`.
    Bulk(Vec<u8>),
    /// `*N ...`.
    Array(Vec<Reply>),
    /// `$-1` or `*-1`.
    Null,
}

impl Reply {
    /// The reply as an integer: an integer reply, or a bulk/simple string of decimal digits (webdis re-encodes
    /// the integers inside arrays as bulk strings).
    pub fn as_integer(&self) -> Option<i64> {
        match self {
            Reply::Integer(value) => Some(*value),
            Reply::Bulk(text) | Reply::Simple(text) => std::str::from_utf8(text).ok()?.parse().ok(),
            _ => None,
        }
    }

    /// The first word of an error reply (`NOSCRIPT`, `NOAUTH`, `ERR`...), if this is one.
    pub fn error_code(&self) -> Option<&str> {
        match self {
            Reply::Error(text) => text.split_whitespace().next(),
            _ => None,
        }
    }
}

impl From<OwnedFrame> for Reply {
    fn from(frame: OwnedFrame) -> Self {
        match frame {
            OwnedFrame::SimpleString(text) => Reply::Simple(text),
            OwnedFrame::Error(text) => Reply::Error(text),
            OwnedFrame::Integer(value) => Reply::Integer(value),
            OwnedFrame::BulkString(bytes) => Reply::Bulk(bytes),
            OwnedFrame::Array(items) => Reply::Array(items.into_iter().map(Reply::from).collect()),
            OwnedFrame::Null => Reply::Null,
        }
    }
}

/// A reply that is not exactly one well-formed RESP value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RespError {
    /// The bytes end before the value does.
    Truncated,
    /// Bytes follow the value (a transport delivers exactly one reply).
    TrailingBytes(usize),
    /// Not RESP.
    Malformed(String),
}

impl fmt::Display for RespError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RespError::Truncated => write!(f, "truncated RESP reply"),
            RespError::TrailingBytes(n) => write!(f, "{n} bytes after the RESP reply"),
            RespError::Malformed(why) => write!(f, "malformed RESP reply: {why}"),
        }
    }
}

impl std::error::Error for RespError {}

/// Decodes exactly one RESP2 reply from `bytes`.
///
/// # Errors
/// [`RespError`] when the bytes are not one complete reply.
pub fn decode_reply(bytes: &[u8]) -> Result<Reply, RespError> {
    match redis_protocol::resp2::decode::decode(bytes) {
        Ok(Some((frame, used))) if used == bytes.len() => Ok(frame.into()),
        Ok(Some((_, used))) => Err(RespError::TrailingBytes(bytes.len().saturating_sub(used))),
        Ok(None) => Err(RespError::Truncated),
        Err(e) => Err(RespError::Malformed(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn commands_encode_as_arrays_of_bulk_strings() {
        let command = Command::new("GET").arg("k\r\n").arg([0u8, 255]);
        assert_eq!(command.to_resp(), b"*3\r\n$3\r\nGET\r\n$3\r\nk\r\n\r\n$2\r\n\x00\xff\r\n".to_vec());
    }

    #[test]
    fn webdis_paths_escape_everything_but_letters_and_digits() {
        let command = Command::new("EVALSHA").arg("{erl:a.b}:value").arg([0u8, 255, b'/']);
        assert_eq!(
            String::from_utf8(command.to_webdis_path()).unwrap(),
            "EVALSHA/%7Berl%3Aa%2Eb%7D%3Avalue/%00%FF%2F.raw"
        );
    }

    #[test]
    fn replies_decode_including_negative_integers_and_both_nulls() {
        assert_eq!(decode_reply(b":-2\r\n"), Ok(Reply::Integer(-2)));
        assert_eq!(decode_reply(b"$-1\r\n"), Ok(Reply::Null));
        assert_eq!(decode_reply(b"*-1\r\n"), Ok(Reply::Null));
        assert_eq!(
            decode_reply(b"*2\r\n$1\r\n7\r\n:3\r\n"),
            Ok(Reply::Array(vec![Reply::Bulk(b"7".to_vec()), Reply::Integer(3)]))
        );
        let error = decode_reply(b"-NOSCRIPT No matching script. Please use EVAL.\r\n").unwrap();
        assert_eq!(error.error_code(), Some("NOSCRIPT"));
    }

    #[test]
    fn integers_read_from_integer_and_digit_string_replies() {
        assert_eq!(Reply::Integer(5).as_integer(), Some(5));
        assert_eq!(Reply::Bulk(b"-12".to_vec()).as_integer(), Some(-12));
        assert_eq!(Reply::Bulk(b"x".to_vec()).as_integer(), None);
        assert_eq!(Reply::Null.as_integer(), None);
    }

    #[test]
    fn anything_but_one_complete_reply_is_an_error() {
        assert_eq!(decode_reply(b"*2\r\n:1\r\n"), Err(RespError::Truncated));
        assert_eq!(decode_reply(b""), Err(RespError::Truncated));
        assert_eq!(decode_reply(b":1\r\n:2\r\n"), Err(RespError::TrailingBytes(4)));
        assert!(matches!(decode_reply(b"<html>503</html>"), Err(RespError::Malformed(_))));
    }
}
