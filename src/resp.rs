//! RESP: the seam between the filter and every transport. One [`Command`] goes out, one [`Reply`] comes
//! back, whatever carries them (the host's Redis interface writes the command's RESP bytes verbatim; the
//! HTTP bridge carries it in webdis's path form and answers raw RESP thanks to the `.raw` suffix).
//!
//! The codec is this module's own: encoding is a length-prefixed join, and decoding accepts only what
//! the filter's scripts answer (flat, small replies), with hard bounds ([`MAX_DEPTH`], [`MAX_ELEMENTS`],
//! [`MAX_BULK_BYTES`]), so a hostile or broken bridge cannot make it recurse or allocate without limit
//! (the `redis-protocol` crate recurses once per nesting level, unbounded). The unit tests check it
//! against `redis-protocol` as an independent decoder on random replies.

use crate::prelude::*;

use core::fmt;

use percent_encoding::{percent_encode, NON_ALPHANUMERIC};

use crate::quote::quoted;

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
        let size: usize = self.args.iter().map(|a| a.len() + 16).sum::<usize>() + 16;
        let mut out = Vec::with_capacity(size);
        push_header(&mut out, b'*', self.args.len());
        for arg in &self.args {
            push_header(&mut out, b'$', arg.len());
            out.extend_from_slice(arg);
            out.extend_from_slice(b"\r\n");
        }
        out
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
            Reply::Bulk(text) | Reply::Simple(text) => core::str::from_utf8(text).ok()?.parse().ok(),
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

/// Appends `<kind><n>\r\n` (an array or bulk string header).
fn push_header(out: &mut Vec<u8>, kind: u8, n: usize) {
    out.push(kind);
    out.extend_from_slice(n.to_string().as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// Deepest nesting of arrays accepted in a reply (the scripts answer flat arrays: depth 1).
pub const MAX_DEPTH: usize = 4;
/// Most elements accepted in one array (the acquire script answers 7).
pub const MAX_ELEMENTS: usize = 1024;
/// Longest bulk string, simple string or error accepted, bytes.
pub const MAX_BULK_BYTES: usize = 64 * 1024;

/// A reply that is not exactly one well-formed RESP value within the bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RespError {
    /// The bytes end before the value does.
    Truncated,
    /// Bytes follow the value (a transport delivers exactly one reply).
    TrailingBytes(usize),
    /// Not RESP.
    Malformed(String),
    /// Nested deeper than [`MAX_DEPTH`], an array longer than [`MAX_ELEMENTS`] or a string longer than
    /// [`MAX_BULK_BYTES`].
    TooLarge(String),
}

impl fmt::Display for RespError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RespError::Truncated => write!(f, "truncated RESP reply"),
            RespError::TrailingBytes(n) => write!(f, "{n} bytes after the RESP reply"),
            RespError::Malformed(why) => write!(f, "malformed RESP reply: {why}"),
            RespError::TooLarge(what) => write!(f, "RESP reply refused: {what}"),
        }
    }
}

impl core::error::Error for RespError {}

/// Decodes exactly one RESP2 reply from `bytes`.
///
/// ```text
/// *2\r\n:1\r\n$3\r\nabc\r\n   ->   Array([Integer(1), Bulk(b"abc")])
/// ```
///
/// # Errors
/// [`RespError`] when the bytes are not one complete reply within the bounds.
pub fn decode_reply(bytes: &[u8]) -> Result<Reply, RespError> {
    let mut reader = Reader { bytes, at: 0 };
    let reply = reader.value(0)?;
    match bytes.len().saturating_sub(reader.at) {
        0 => Ok(reply),
        rest => Err(RespError::TrailingBytes(rest)),
    }
}

/// The shape of a reply of integers read by [`decode_integers`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Integers {
    /// One integer reply (`:4`), in the first slot.
    Bare,
    /// An array of this many integers (`*3 :0 :1503 :1`, or webdis's bulk strings of digits).
    Array(usize),
}

/// Reads a reply made only of integers into `out` without allocating: a bare integer, or an array of at
/// most `out.len()` elements that are integers or bulk strings of decimal digits (webdis re-encodes
/// integers inside arrays that way). `None` for any other reply (errors included): decode it with
/// [`decode_reply`] then.
pub fn decode_integers(bytes: &[u8], out: &mut [i64]) -> Option<Integers> {
    let mut reader = Reader { bytes, at: 0 };
    let shape = match bytes.first()? {
        b':' => {
            reader.at = 1;
            *out.first_mut()? = reader.integer().ok()?;
            Integers::Bare
        }
        b'*' => {
            reader.at = 1;
            let count = reader.length().ok()??;
            if count > out.len() {
                return None;
            }
            for slot in out.iter_mut().take(count) {
                let kind = *reader.bytes.get(reader.at)?;
                reader.at += 1;
                *slot = match kind {
                    b':' => reader.integer().ok()?,
                    b'$' => {
                        let len = reader.length().ok()??;
                        let end = reader.at.checked_add(len)?;
                        let text = core::str::from_utf8(reader.bytes.get(reader.at..end)?).ok()?;
                        if text.starts_with('+') || reader.bytes.get(end..end.checked_add(2)?)? != b"\r\n" {
                            return None;
                        }
                        reader.at = end + 2;
                        text.parse().ok()?
                    }
                    _ => return None,
                };
            }
            Integers::Array(count)
        }
        _ => return None,
    };
    (reader.at == bytes.len()).then_some(shape)
}

/// Most elements accepted in the array of [`array_elements`] (a batch of acquire replies).
pub const MAX_BATCH_ELEMENTS: usize = 16 * MAX_ELEMENTS;

/// The raw bytes of each element of a flat array reply (integers, strings, errors; no nested array), as
/// the reply of a batch of calls carries them ([`crate::script::split_batch_reply`]).
///
/// # Errors
/// [`RespError`] when the bytes are not one array of at most [`MAX_BATCH_ELEMENTS`] such elements.
pub fn array_elements(bytes: &[u8]) -> Result<Vec<&[u8]>, RespError> {
    let mut reader = Reader { bytes, at: 0 };
    if bytes.first() != Some(&b'*') {
        return Err(RespError::Malformed("not an array".into()));
    }
    reader.at = 1;
    let count = reader.length()?.ok_or_else(|| RespError::Malformed("a null array".into()))?;
    if count > MAX_BATCH_ELEMENTS {
        return Err(RespError::TooLarge(format!("an array of {count} elements")));
    }
    let mut elements = Vec::with_capacity(count);
    for _ in 0..count {
        let start = reader.at;
        reader.skip_flat()?;
        elements.push(bytes.get(start..reader.at).unwrap_or_default());
    }
    match bytes.len().saturating_sub(reader.at) {
        0 => Ok(elements),
        rest => Err(RespError::TrailingBytes(rest)),
    }
}

/// A cursor over the reply bytes.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    /// One value at nesting `depth` (0 = the reply itself).
    fn value(&mut self, depth: usize) -> Result<Reply, RespError> {
        let kind = *self.bytes.get(self.at).ok_or(RespError::Truncated)?;
        self.at += 1;
        match kind {
            b'+' => Ok(Reply::Simple(self.line()?.to_vec())),
            b'-' => {
                let line = self.line()?;
                let text = core::str::from_utf8(line)
                    .map_err(|_| RespError::Malformed("an error reply not in UTF-8".into()))?;
                Ok(Reply::Error(text.to_string()))
            }
            b':' => Ok(Reply::Integer(self.integer()?)),
            b'$' => match self.length()? {
                None => Ok(Reply::Null),
                Some(len) => {
                    if len > MAX_BULK_BYTES {
                        return Err(RespError::TooLarge(format!("a bulk string of {len} bytes")));
                    }
                    let end = self.at.checked_add(len).ok_or(RespError::Truncated)?;
                    let body = self.bytes.get(self.at..end).ok_or(RespError::Truncated)?.to_vec();
                    self.at = end;
                    match self.bytes.get(self.at..self.at + 2) {
                        Some(b"\r\n") => {
                            self.at += 2;
                            Ok(Reply::Bulk(body))
                        }
                        Some(_) => Err(RespError::Malformed("a bulk string longer than its length".into())),
                        None => Err(RespError::Truncated),
                    }
                }
            },
            b'*' => match self.length()? {
                None => Ok(Reply::Null),
                Some(len) => {
                    if depth >= MAX_DEPTH {
                        return Err(RespError::TooLarge(format!("arrays nested deeper than {MAX_DEPTH}")));
                    }
                    if len > MAX_ELEMENTS {
                        return Err(RespError::TooLarge(format!("an array of {len} elements")));
                    }
                    let mut items = Vec::with_capacity(len);
                    for _ in 0..len {
                        items.push(self.value(depth + 1)?);
                    }
                    Ok(Reply::Array(items))
                }
            },
            other => Err(RespError::Malformed(format!("unknown type byte 0x{other:02x}"))),
        }
    }

    /// Moves past one value that is not an array, without copying it ([`array_elements`]).
    fn skip_flat(&mut self) -> Result<(), RespError> {
        let kind = *self.bytes.get(self.at).ok_or(RespError::Truncated)?;
        self.at += 1;
        match kind {
            b'+' | b'-' | b':' => self.line().map(|_| ()),
            b'$' => match self.length()? {
                None => Ok(()),
                Some(len) if len > MAX_BULK_BYTES => Err(RespError::TooLarge(format!("a bulk string of {len} bytes"))),
                Some(len) => {
                    let end = self.at.checked_add(len).ok_or(RespError::Truncated)?;
                    match self.bytes.get(end..end + 2) {
                        Some(b"\r\n") => {
                            self.at = end + 2;
                            Ok(())
                        }
                        Some(_) => Err(RespError::Malformed("a bulk string longer than its length".into())),
                        None => Err(RespError::Truncated),
                    }
                }
            },
            other => Err(RespError::Malformed(format!("not a flat element: type byte 0x{other:02x}"))),
        }
    }

    /// The bytes up to the next CRLF (which is consumed), at most [`MAX_BULK_BYTES`].
    fn line(&mut self) -> Result<&[u8], RespError> {
        let rest = self.bytes.get(self.at..).unwrap_or_default();
        let window = rest.get(..rest.len().min(MAX_BULK_BYTES + 2)).unwrap_or(rest);
        let Some(end) = window.windows(2).position(|pair| pair == b"\r\n") else {
            return if rest.len() > MAX_BULK_BYTES + 1 {
                Err(RespError::TooLarge(format!("a line longer than {MAX_BULK_BYTES} bytes")))
            } else {
                Err(RespError::Truncated)
            };
        };
        let line = rest.get(..end).unwrap_or_default();
        self.at += end + 2;
        Ok(line)
    }

    /// A signed decimal integer line.
    fn integer(&mut self) -> Result<i64, RespError> {
        let line = self.line()?;
        core::str::from_utf8(line)
            .ok()
            .filter(|text| !text.starts_with('+'))
            .and_then(|text| text.parse::<i64>().ok())
            .ok_or_else(|| RespError::Malformed(format!("not an integer: {}", quoted(line))))
    }

    /// A length line: `None` for -1 (null), else a non-negative length.
    fn length(&mut self) -> Result<Option<usize>, RespError> {
        match self.integer()? {
            -1 => Ok(None),
            n => usize::try_from(n).map(Some).map_err(|_| RespError::Malformed(format!("length {n}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;

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

    #[test]
    fn integer_replies_are_read_without_a_generic_value() {
        let mut out = [0i64; 7];
        assert_eq!(decode_integers(b":-4\r\n", &mut out), Some(Integers::Bare));
        assert_eq!(out[0], -4);
        assert_eq!(decode_integers(b"*3\r\n:0\r\n$4\r\n1503\r\n:2\r\n", &mut out), Some(Integers::Array(3)));
        assert_eq!(&out[..3], &[0, 1503, 2]);
        for other in [
            &b"-ERR x\r\n"[..],
            b"*8\r\n:1\r\n:1\r\n:1\r\n:1\r\n:1\r\n:1\r\n:1\r\n:1\r\n",
            b"*1\r\n$1\r\nx\r\n",
            b"*1\r\n$2\r\n+1\r\n",
            b":1\r\n:2\r\n",
            b"*2\r\n:1\r\n",
            b"*-1\r\n",
            b"",
        ] {
            assert_eq!(decode_integers(other, &mut out), None, "{:?}", String::from_utf8_lossy(other));
        }
    }

    #[test]
    fn hostile_replies_are_refused_without_recursing_or_allocating() {
        let deep = "*1\r\n".repeat(100_000);
        assert!(matches!(decode_reply(deep.as_bytes()), Err(RespError::TooLarge(_))));
        let nested_ok = format!("{}:1\r\n", "*1\r\n".repeat(MAX_DEPTH));
        assert!(decode_reply(nested_ok.as_bytes()).is_ok(), "{MAX_DEPTH} levels are accepted");
        assert!(matches!(decode_reply(b"*2147483647\r\n:1\r\n"), Err(RespError::TooLarge(_))));
        assert!(matches!(decode_reply(b"$4294967295\r\n"), Err(RespError::TooLarge(_))));
        assert!(decode_reply(b"$9223372036854775807\r\n").is_err(), "beyond usize on wasm32: malformed");
        assert!(matches!(decode_reply(b"$-2\r\n"), Err(RespError::Malformed(_))));
        assert!(matches!(decode_reply(b"$3\r\nabcd\r\n"), Err(RespError::Malformed(_))));
        assert_eq!(decode_reply(b"$3\r\nab"), Err(RespError::Truncated));
        let long_line = format!("+{}", "a".repeat(MAX_BULK_BYTES + 10));
        assert!(matches!(decode_reply(long_line.as_bytes()), Err(RespError::TooLarge(_))));
        assert!(matches!(decode_reply(b":12x\r\n"), Err(RespError::Malformed(_))));
        assert!(matches!(decode_reply(b":+1\r\n"), Err(RespError::Malformed(_))));
    }

    /// The decoder agrees with `redis-protocol` (an independent, well-kept implementation) on every reply
    /// within the bounds, and on whether bytes are one complete reply at all.
    #[cfg(not(target_arch = "wasm32"))]
    mod against_redis_protocol {
        use super::*;
        use proptest::prelude::*;
        use redis_protocol::resp2::types::OwnedFrame;

        fn from_frame(frame: OwnedFrame) -> Reply {
            match frame {
                OwnedFrame::SimpleString(text) => Reply::Simple(text),
                OwnedFrame::Error(text) => Reply::Error(text),
                OwnedFrame::Integer(value) => Reply::Integer(value),
                OwnedFrame::BulkString(bytes) => Reply::Bulk(bytes),
                OwnedFrame::Array(items) => Reply::Array(items.into_iter().map(from_frame).collect()),
                OwnedFrame::Null => Reply::Null,
            }
        }

        fn encode(reply: &Reply, out: &mut Vec<u8>) {
            match reply {
                Reply::Simple(text) => out.extend([&b"+"[..], text, b"\r\n"].concat()),
                Reply::Error(text) => out.extend([b"-", text.as_bytes(), b"\r\n"].concat()),
                Reply::Integer(value) => out.extend(format!(":{value}\r\n").bytes()),
                Reply::Bulk(bytes) => {
                    out.extend(format!("${}\r\n", bytes.len()).bytes());
                    out.extend(bytes);
                    out.extend(b"\r\n");
                }
                Reply::Array(items) => {
                    out.extend(format!("*{}\r\n", items.len()).bytes());
                    items.iter().for_each(|item| encode(item, out));
                }
                Reply::Null => out.extend(b"$-1\r\n"),
            }
        }

        fn reply() -> impl Strategy<Value = Reply> {
            let line = "[a-zA-Z0-9 ._:-]{0,20}";
            let leaf = prop_oneof![
                line.prop_map(|t: String| Reply::Simple(t.into_bytes())),
                line.prop_map(Reply::Error),
                any::<i64>().prop_map(Reply::Integer),
                proptest::collection::vec(any::<u8>(), 0..40).prop_map(Reply::Bulk),
                Just(Reply::Null),
            ];
            leaf.prop_recursive(3, 40, 8, |inner| proptest::collection::vec(inner, 0..8).prop_map(Reply::Array))
        }

        proptest! {
            #[test]
            fn well_formed_replies_decode_alike(reply in reply()) {
                let mut bytes = Vec::new();
                encode(&reply, &mut bytes);
                let theirs = redis_protocol::resp2::decode::decode(&bytes).unwrap().map(|(f, n)| (from_frame(f), n));
                prop_assert_eq!(theirs, Some((reply.clone(), bytes.len())));
                prop_assert_eq!(decode_reply(&bytes), Ok(reply));
            }

            #[test]
            fn cut_or_mangled_replies_are_refused_alike(reply in reply(), cut in any::<prop::sample::Index>(),
                                                        flip in any::<prop::sample::Index>(), byte in any::<u8>()) {
                let mut bytes = Vec::new();
                encode(&reply, &mut bytes);
                let truncated = &bytes[..cut.index(bytes.len())];
                prop_assert!(decode_reply(truncated).is_err());
                let mut mangled = bytes.clone();
                let at = flip.index(mangled.len());
                mangled[at] = byte;
                let theirs = match redis_protocol::resp2::decode::decode(&mangled) {
                    Ok(Some((frame, used))) if used == mangled.len() => Some(from_frame(frame)),
                    _ => None,
                };
                // Ours may refuse more (bounds, `:+1`), never accept what theirs refuses or read it otherwise.
                if let Ok(ours) = decode_reply(&mangled) {
                    prop_assert_eq!(Some(ours), theirs);
                }
            }
        }
    }
}
