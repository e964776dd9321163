//! The I/O layer: one synchronous Redis connection, the filter's scripts run on it (`EVALSHA`, then
//! `EVAL` on `NOSCRIPT`), and the few plain commands the tool reads state with. Redis errors become
//! [`AdminError`]s here, named with what the tool was doing.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use edge_rate_limiter::key::LimiterKeys;
use edge_rate_limiter::resp::Command;
use edge_rate_limiter::script::{Invocation, Script};
use redis::{ErrorKind, RedisError, ServerErrorKind, Value};

use crate::error::{AdminError, Result};

/// An open connection to the Redis that holds the limiters.
pub struct Redis {
    con: redis::Connection,
    /// The URL as shown in messages (password hidden).
    url: String,
}

impl Redis {
    /// Connects to `url` (`redis://[user:password@]host:port/db`), failing after `timeout`; every later
    /// command fails after `timeout` too.
    ///
    /// # Errors
    /// [`AdminError::BadUrl`], [`AdminError::Unreachable`] (with the URL), [`AdminError::AuthFailed`].
    pub fn connect(url: &str, timeout: Duration) -> Result<Self> {
        let shown = redact_url(url);
        let client = redis::Client::open(url)
            .map_err(|error| AdminError::BadUrl { url: shown.clone(), reason: error.to_string() })?;
        let con = client.get_connection_with_timeout(timeout).map_err(|error| connect_error(&shown, &error))?;
        let timeouts = con.set_read_timeout(Some(timeout)).and_then(|()| con.set_write_timeout(Some(timeout)));
        timeouts.map_err(|error| connect_error(&shown, &error))?;
        Ok(Redis { con, url: shown })
    }

    /// Sends one command and returns its reply; `context` says what for, in error messages.
    ///
    /// # Errors
    /// [`AdminError::Unreachable`] when the connection fails, [`AdminError::Redis`] for error replies.
    pub fn query(&mut self, cmd: &redis::Cmd, context: &str) -> Result<Value> {
        cmd.query::<Value>(&mut self.con).map_err(|error| self.error(context, &error))
    }

    /// Runs one of the filter's scripts on a limiter's keys: `EVALSHA`, and `EVAL` with the source when
    /// Redis answers `NOSCRIPT` (its script cache was flushed, or it restarted).
    ///
    /// # Errors
    /// As [`Redis::query`]; a Lua error is an [`AdminError::Redis`] naming the script.
    pub fn run_script(&mut self, script: &Script, keys: &LimiterKeys, args: &[&[u8]]) -> Result<Value> {
        let context = format!("running the {} script on {}", script.name, keys.config);
        let by_sha = to_cmd(&script.command(Invocation::BySha, keys, args));
        match by_sha.query::<Value>(&mut self.con) {
            Err(error) if error.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                let by_source = to_cmd(&script.command(Invocation::BySource, keys, args));
                by_source.query::<Value>(&mut self.con).map_err(|error| self.error(&context, &error))
            }
            other => other.map_err(|error| self.error(&context, &error)),
        }
    }

    /// The Redis type of `key`: `none`, `string`, `hash`, `zset`...
    ///
    /// # Errors
    /// As [`Redis::query`].
    pub fn key_type(&mut self, key: &str) -> Result<String> {
        let reply = self.query(redis::cmd("TYPE").arg(key), &format!("reading the type of {key}"))?;
        Ok(text(&reply).unwrap_or_default())
    }

    /// `PTTL key`: ms until it expires, `-1` if it never does, `-2` if it does not exist.
    ///
    /// # Errors
    /// As [`Redis::query`].
    pub fn pttl(&mut self, key: &str) -> Result<i64> {
        let reply = self.query(redis::cmd("PTTL").arg(key), &format!("reading the TTL of {key}"))?;
        integer(&reply).ok_or_else(|| unexpected("PTTL", &reply))
    }

    /// Whether `key` exists.
    ///
    /// # Errors
    /// As [`Redis::query`].
    pub fn exists(&mut self, key: &str) -> Result<bool> {
        let reply = self.query(redis::cmd("EXISTS").arg(key), &format!("looking for {key}"))?;
        Ok(integer(&reply).unwrap_or(0) > 0)
    }

    /// Every key whose name starts with `prefix` (taken literally: glob characters are escaped) and of
    /// `key_type` (`hash`, `zset`...), if given, by `SCAN` to the end; sorted, without repeats.
    ///
    /// # Errors
    /// As [`Redis::query`].
    pub fn scan_prefix(&mut self, prefix: &str, key_type: Option<&str>) -> Result<Vec<Vec<u8>>> {
        self.scan(&format!("{}*", glob_escape(prefix)), key_type)
    }

    /// Every key matching the glob `pattern` (and of `key_type`, if given), by `SCAN` to the end.
    fn scan(&mut self, pattern: &str, key_type: Option<&str>) -> Result<Vec<Vec<u8>>> {
        let context = format!("scanning for {pattern}");
        let mut keys = Vec::new();
        let mut cursor = String::from("0");
        loop {
            let mut cmd = redis::cmd("SCAN");
            cmd.arg(&cursor).arg("MATCH").arg(pattern).arg("COUNT").arg(1000);
            if let Some(key_type) = key_type {
                cmd.arg("TYPE").arg(key_type);
            }
            let reply = self.query(&cmd, &context)?;
            let Value::Array(parts) = &reply else { return Err(unexpected("SCAN", &reply)) };
            let (Some(next), Some(Value::Array(batch))) = (parts.first().and_then(text), parts.get(1)) else {
                return Err(unexpected("SCAN", &reply));
            };
            keys.extend(batch.iter().filter_map(bytes));
            if next == "0" {
                break;
            }
            cursor = next;
        }
        keys.sort();
        keys.dedup();
        Ok(keys)
    }

    /// Redis's clock (`TIME`), ms since the epoch.
    ///
    /// # Errors
    /// As [`Redis::query`].
    pub fn time_ms(&mut self) -> Result<u64> {
        let reply = self.query(&redis::cmd("TIME"), "reading Redis's clock")?;
        let Value::Array(parts) = &reply else { return Err(unexpected("TIME", &reply)) };
        let number = |index: usize| parts.get(index).and_then(text).and_then(|t| t.parse::<u64>().ok());
        match (number(0), number(1)) {
            (Some(seconds), Some(micros)) => Ok(seconds.saturating_mul(1000).saturating_add(micros / 1000)),
            _ => Err(unexpected("TIME", &reply)),
        }
    }

    fn error(&self, context: &str, error: &RedisError) -> AdminError {
        if error.is_io_error() || error.is_timeout() || error.is_connection_dropped() {
            AdminError::Unreachable { url: self.url.clone(), reason: error.to_string() }
        } else {
            AdminError::Redis { context: context.to_string(), reason: error_text(error) }
        }
    }
}

/// The local clock, ms since the epoch (the clock Redisson clients and the gateway score permits with).
pub fn local_now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX))
}

/// A `redis` crate command with exactly the arguments of one of the filter's [`Command`]s.
fn to_cmd(command: &Command) -> redis::Cmd {
    let mut cmd = redis::Cmd::new();
    for arg in command.args() {
        cmd.arg(arg.as_slice());
    }
    cmd
}

fn connect_error(url: &str, error: &RedisError) -> AdminError {
    if error.kind() == ErrorKind::AuthenticationFailed
        || matches!(error.code(), Some("NOAUTH" | "WRONGPASS" | "NOPERM"))
    {
        AdminError::AuthFailed { url: url.to_string(), reason: error_text(error) }
    } else {
        AdminError::Unreachable { url: url.to_string(), reason: error.to_string() }
    }
}

/// A Redis error as one line: its code and detail (`ERR user_script:3: ...`).
fn error_text(error: &RedisError) -> String {
    match (error.code(), error.detail()) {
        (Some(code), Some(detail)) => format!("{code} {detail}"),
        _ => error.to_string(),
    }
}

fn unexpected(command: &str, reply: &Value) -> AdminError {
    unexpected_reply(format!("reading the reply of {command}"), reply)
}

/// The error for a reply of another shape than the command's: an [`AdminError::Redis`] with `context`
/// (what the tool was doing) and the reply.
pub fn unexpected_reply(context: String, reply: &Value) -> AdminError {
    AdminError::Redis { context, reason: format!("unexpected reply {reply:?}") }
}

/// `pattern` with the glob characters of Redis's `MATCH` escaped, so a name matches only itself.
pub fn glob_escape(pattern: &str) -> String {
    let mut escaped = String::with_capacity(pattern.len());
    for c in pattern.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

/// `redis://user:secret@host/0` as `redis://user:***@host/0`: URLs are printed in messages.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_string() };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _password)) => format!("{scheme}://{user}:***@{host}{path}"),
            None => url.to_string(),
        },
        None => url.to_string(),
    }
}

/// A bulk or simple string reply as bytes.
pub fn bytes(value: &Value) -> Option<Vec<u8>> {
    match value {
        Value::BulkString(bytes) => Some(bytes.clone()),
        Value::SimpleString(text) => Some(text.as_bytes().to_vec()),
        Value::Okay => Some(b"OK".to_vec()),
        _ => None,
    }
}

/// A string reply as UTF-8 text.
pub fn text(value: &Value) -> Option<String> {
    bytes(value).and_then(|bytes| String::from_utf8(bytes).ok())
}

/// An integer reply, or a string of decimal digits.
pub fn integer(value: &Value) -> Option<i64> {
    match value {
        Value::Int(number) => Some(*number),
        other => text(other)?.parse().ok(),
    }
}

/// A count: an [`integer`] reply that is not negative.
pub fn count(value: &Value) -> Option<u64> {
    integer(value).and_then(|n| u64::try_from(n).ok())
}

/// The `(member, score)` pairs of a `WITHSCORES` reply (RESP2: a flat array; RESP3: pairs); pairs that
/// are not a string and a number are left out.
pub fn scored_members(reply: &Value) -> Vec<(Vec<u8>, f64)> {
    let Value::Array(items) = reply else { return Vec::new() };
    let score = |value: &Value| match value {
        Value::Double(score) => Some(*score),
        other => text(other)?.parse::<f64>().ok(),
    };
    if items.iter().all(|item| matches!(item, Value::Array(_))) {
        items
            .iter()
            .filter_map(|pair| match pair {
                Value::Array(pair) => Some((bytes(pair.first()?)?, score(pair.get(1)?)?)),
                _ => None,
            })
            .collect()
    } else {
        items.chunks(2).filter_map(|pair| Some((bytes(pair.first()?)?, score(pair.get(1)?)?))).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_hidden_in_urls() {
        assert_eq!(redact_url("redis://:s3cret@10.0.0.1:6379/0"), "redis://:***@10.0.0.1:6379/0");
        assert_eq!(redact_url("redis://ops:s3cret@host/2"), "redis://ops:***@host/2");
        assert_eq!(redact_url("redis://127.0.0.1:6379/0"), "redis://127.0.0.1:6379/0");
        assert_eq!(redact_url("redis://user@host"), "redis://user@host");
        assert_eq!(redact_url("not a url"), "not a url");
    }

    #[test]
    fn commands_keep_every_argument_byte_for_byte() {
        let command = Command::new("EVALSHA").arg("abc").arg([0u8, 255, b'/']);
        let packed = to_cmd(&command).get_packed_command();
        assert_eq!(packed, b"*3\r\n$7\r\nEVALSHA\r\n$3\r\nabc\r\n$3\r\n\x00\xff/\r\n".to_vec());
    }

    #[test]
    fn replies_read_as_text_and_integers() {
        assert_eq!(integer(&Value::Int(-2)), Some(-2));
        assert_eq!(integer(&Value::BulkString(b"42".to_vec())), Some(42));
        assert_eq!(integer(&Value::Nil), None);
        assert_eq!(text(&Value::SimpleString("hash".into())), Some("hash".into()));
    }

    #[test]
    fn glob_characters_are_escaped() {
        assert_eq!(glob_escape("{erl:a*b}:value:"), "{erl:a\\*b}:value:");
        assert_eq!(glob_escape("x?[y]\\"), "x\\?\\[y\\]\\\\");
    }

    #[test]
    fn scored_members_read_resp2_and_resp3_shapes() {
        let flat = Value::Array(vec![Value::BulkString(b"a".to_vec()), Value::BulkString(b"12.5".to_vec())]);
        assert_eq!(scored_members(&flat), vec![(b"a".to_vec(), 12.5)]);
        let pairs = Value::Array(vec![Value::Array(vec![Value::BulkString(b"b".to_vec()), Value::Double(3.0)])]);
        assert_eq!(scored_members(&pairs), vec![(b"b".to_vec(), 3.0)]);
    }
}
