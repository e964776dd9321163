//! The I/O layer: a synchronous connection to one Redis or to a Redis Cluster, the filter's scripts run on
//! it (`EVALSHA`, then `EVAL` on `NOSCRIPT`), and the few plain commands the tool reads state with. Redis
//! errors become [`AdminError`]s here, named with what the tool was doing.
//!
//! # Redis Cluster
//!
//! `erl-admin --cluster --url redis://[user:password@]host:port` (or `ERL_REDIS_CLUSTER=true`) connects
//! to a cluster through the `redis` crate's sync cluster client: the URL names a seed node (several seeds:
//! comma-separated, or `--url` repeated), the slot map comes from `CLUSTER SLOTS`. A limiter's keys share
//! one hash slot (its config hash `N` and `{N}:value...`, Redisson's `suffixName`), so every command on a
//! limiter goes to the master of that slot: plain commands by their first key, scripts by their first key
//! (`EVALSHA sha 5 N ...`), a `DEL` of one client's keys by their common slot. `NOSCRIPT` is per node:
//! the `EVAL` that follows it goes to the same master. `SCAN` runs on every master ([`Redis::scan_prefix`]),
//! `TIME` on any node.
//!
//! Wrong input gets a one-line error saying what to do: `--cluster` on a Redis without cluster support
//! ([`AdminError::NotACluster`]: the slot map has no master), a plain URL naming a cluster node
//! ([`AdminError::ClusterNode`]: found by `INFO cluster` on connecting, or by a `MOVED` reply when `INFO`
//! is not allowed).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use edge_rate_limiter::key::LimiterKeys;
use edge_rate_limiter::resp::Command;
use edge_rate_limiter::script::{Invocation, Script};
use redis::cluster::{ClusterClient, ClusterConnection};
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo, SingleNodeRoutingInfo};
use redis::{ConnectionLike, ErrorKind, IntoConnectionInfo, RedisError, ServerErrorKind, Value};

use crate::error::{AdminError, Result};

/// Retries of a cluster command after `MOVED`, `ASK`, `TRYAGAIN` or `CLUSTERDOWN` (the crate's default is
/// 16, with waits of seconds: too long for an operator waiting at a prompt).
const CLUSTER_RETRIES: u32 = 3;
/// Shortest and longest wait before such a retry, ms.
const CLUSTER_RETRY_WAIT_MS: (u64, u64) = (100, 1000);

/// An open connection to the Redis, or the Redis Cluster, that holds the limiters.
pub struct Redis {
    con: Connection,
    /// The URL (the seeds of a cluster, comma-separated) as shown in messages (passwords hidden).
    url: String,
}

/// The connection proper: to one Redis, or to every master of a cluster.
enum Connection {
    Single(redis::Connection),
    Cluster(Box<ClusterConnection>),
}

impl Redis {
    /// Connects to `url` (`redis://[user:password@]host:port/db`), failing after `timeout`; every later
    /// command fails after `timeout` too.
    ///
    /// # Errors
    /// [`AdminError::BadUrl`], [`AdminError::Unreachable`] (with the URL), [`AdminError::AuthFailed`],
    /// [`AdminError::ClusterNode`] when `url` names a node of a Redis Cluster.
    pub fn connect(url: &str, timeout: Duration) -> Result<Self> {
        let shown = redact_url(url);
        check_scheme(url, &shown)?;
        let client = redis::Client::open(url)
            .map_err(|error| AdminError::BadUrl { url: shown.clone(), reason: error.to_string() })?;
        let con = client.get_connection_with_timeout(timeout).map_err(|error| connect_error(&shown, &error))?;
        let timeouts = con.set_read_timeout(Some(timeout)).and_then(|()| con.set_write_timeout(Some(timeout)));
        timeouts.map_err(|error| connect_error(&shown, &error))?;
        let mut redis = Redis { con: Connection::Single(con), url: shown };
        redis.refuse_cluster_node()?;
        Ok(redis)
    }

    /// Connects to the Redis Cluster that `seeds` (`redis://[user:password@]host:port` URLs of some of its
    /// nodes, one is enough) belong to, failing after `timeout` per node; every later command fails after
    /// `timeout` too. The seeds share their user and password (the cluster's nodes all take them).
    ///
    /// # Errors
    /// [`AdminError::BadUrl`], [`AdminError::Unreachable`] (no seed answered), [`AdminError::AuthFailed`],
    /// [`AdminError::NotACluster`] when the seed has no cluster support.
    pub fn connect_cluster(seeds: &[String], timeout: Duration) -> Result<Self> {
        let shown = seeds.iter().map(|seed| redact_url(seed)).collect::<Vec<_>>().join(",");
        if seeds.is_empty() {
            return Err(AdminError::BadUrl { url: shown, reason: "no seed node given".to_string() });
        }
        for seed in seeds {
            let seed_shown = redact_url(seed);
            check_scheme(seed, &seed_shown)?;
            seed.as_str()
                .into_connection_info()
                .map_err(|error| AdminError::BadUrl { url: seed_shown, reason: error.to_string() })?;
        }
        let (min_wait, max_wait) = CLUSTER_RETRY_WAIT_MS;
        let client = ClusterClient::builder(seeds.iter().map(String::as_str))
            .connection_timeout(timeout)
            .response_timeout(timeout)
            .retries(CLUSTER_RETRIES)
            .min_retry_wait(min_wait)
            .max_retry_wait(max_wait)
            .build()
            .map_err(|error| AdminError::BadUrl { url: shown.clone(), reason: error_text(&error) })?;
        let con = client.get_connection().map_err(|error| cluster_connect_error(&shown, &error))?;
        con.set_write_timeout(Some(timeout)).map_err(|error| connect_error(&shown, &error))?;
        let mut redis = Redis { con: Connection::Cluster(Box::new(con)), url: shown };
        redis.require_masters(seeds, timeout)?;
        Ok(redis)
    }

    /// Fails with [`AdminError::NotACluster`] if the cluster connection knows no master (`PING` on every
    /// master reaches none): the seed answered `CLUSTER SLOTS` with an error (no cluster support), which
    /// the crate takes for an empty slot map, or no slot is assigned. The reason is the seed's own answer
    /// to `CLUSTER SLOTS`, asked again on a plain connection.
    fn require_masters(&mut self, seeds: &[String], timeout: Duration) -> Result<()> {
        let Connection::Cluster(con) = &mut self.con else { return Ok(()) };
        let all_masters = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
        match con.route_command(&redis::cmd("PING"), all_masters) {
            Ok(Value::Map(masters)) if masters.is_empty() => {
                Err(AdminError::NotACluster { url: self.url.clone(), reason: cluster_slots_answer(seeds, timeout) })
            }
            Ok(_) => Ok(()),
            Err(error) => Err(self.error("sending PING to every master", &error)),
        }
    }

    /// Fails with [`AdminError::ClusterNode`] if the Redis is a cluster node (`INFO cluster`): without
    /// `--cluster` the tool would see one master's keys only (`list`) or meet `MOVED`s halfway through a
    /// change. A Redis that does not allow `INFO` is taken as it is (a `MOVED` still says it).
    fn refuse_cluster_node(&mut self) -> Result<()> {
        let Connection::Single(con) = &mut self.con else { return Ok(()) };
        match redis::cmd("INFO").arg("cluster").query::<Value>(con) {
            Ok(reply)
                if text(&reply).is_some_and(|info| info.lines().any(|line| line.trim() == "cluster_enabled:1")) =>
            {
                Err(AdminError::ClusterNode { url: self.url.clone(), reason: "INFO: cluster_enabled:1".to_string() })
            }
            Ok(_) => Ok(()),
            Err(error) if error.is_io_error() || error.is_timeout() || error.is_connection_dropped() => {
                Err(self.error("reading INFO cluster", &error))
            }
            Err(_) => Ok(()),
        }
    }

    /// The connection as the `redis` crate's commands take it (the cluster one routes each command).
    fn con(&mut self) -> &mut dyn ConnectionLike {
        match &mut self.con {
            Connection::Single(con) => con,
            Connection::Cluster(con) => con.as_mut(),
        }
    }

    /// Sends one command and returns its reply; `context` says what for, in error messages. On a
    /// cluster the command goes to the master of its first key's slot (keyless ones: any node).
    ///
    /// # Errors
    /// [`AdminError::Unreachable`] when the connection fails, [`AdminError::Redis`] for error replies.
    pub fn query(&mut self, cmd: &redis::Cmd, context: &str) -> Result<Value> {
        cmd.query::<Value>(self.con()).map_err(|error| self.error(context, &error))
    }

    /// Runs one of the filter's scripts on a limiter's keys: `EVALSHA`, and `EVAL` with the source when
    /// Redis answers `NOSCRIPT` (its script cache was flushed, or it restarted). On a cluster both go to
    /// the master of the limiter's slot (the config hash is the first key), so `NOSCRIPT` is that node's.
    ///
    /// # Errors
    /// As [`Redis::query`]; a Lua error is an [`AdminError::Redis`] naming the script.
    pub fn run_script(&mut self, script: &Script, keys: &LimiterKeys, args: &[&[u8]]) -> Result<Value> {
        let context = format!("running the {} script on {}", script.name, keys.config);
        let by_sha = to_cmd(&script.command(Invocation::BySha, keys, args));
        match by_sha.query::<Value>(self.con()) {
            Err(error) if error.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                let by_source = to_cmd(&script.command(Invocation::BySource, keys, args));
                by_source.query::<Value>(self.con()).map_err(|error| self.error(&context, &error))
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
    /// `key_type` (`hash`, `zset`...), if given, by `SCAN` to the end (on a cluster: on every master);
    /// sorted, without repeats.
    ///
    /// # Errors
    /// As [`Redis::query`].
    pub fn scan_prefix(&mut self, prefix: &str, key_type: Option<&str>) -> Result<Vec<Vec<u8>>> {
        let pattern = format!("{}*", glob_escape(prefix));
        let context = format!("scanning for {pattern}");
        let scan = |cursor: &str| {
            let mut cmd = redis::cmd("SCAN");
            cmd.arg(cursor).arg("MATCH").arg(&pattern).arg("COUNT").arg(1000);
            if let Some(key_type) = key_type {
                cmd.arg("TYPE").arg(key_type);
            }
            cmd
        };
        let mut keys = match &mut self.con {
            Connection::Single(con) => scan_node(&mut |cursor| scan(cursor).query::<Value>(con), None),
            Connection::Cluster(con) => scan_cluster(con.as_mut(), &scan),
        }
        .map_err(|error| match error {
            ScanError::Redis(error) => self.error(&context, &error),
            ScanError::Reply(reply) => unexpected("SCAN", &reply),
        })?;
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
        } else if matches!(self.con, Connection::Single(_)) && matches!(error.code(), Some("MOVED" | "ASK")) {
            AdminError::ClusterNode { url: self.url.clone(), reason: error_text(error) }
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

/// Why a `SCAN` failed: an error of the connection or of Redis, or a reply of another shape.
enum ScanError {
    Redis(RedisError),
    Reply(Value),
}

/// One node's keys, by `SCAN` from cursor 0 to the end: `page` sends `SCAN <cursor> ...`; `first`, if
/// given, is the reply to cursor 0, already sent.
fn scan_node(
    page: &mut dyn FnMut(&str) -> redis::RedisResult<Value>,
    first: Option<Value>,
) -> Result<Vec<Vec<u8>>, ScanError> {
    let mut keys = Vec::new();
    let mut reply = match first {
        Some(reply) => reply,
        None => page("0").map_err(ScanError::Redis)?,
    };
    loop {
        let Value::Array(parts) = &reply else { return Err(ScanError::Reply(reply)) };
        let (Some(next), Some(Value::Array(batch))) = (parts.first().and_then(text), parts.get(1)) else {
            return Err(ScanError::Reply(reply));
        };
        keys.extend(batch.iter().filter_map(bytes));
        if next == "0" {
            return Ok(keys);
        }
        reply = page(&next).map_err(ScanError::Redis)?;
    }
}

/// Every master's keys: `SCAN 0` on all masters at once (the crate's own list of them, from the slot
/// map), each answer keyed by its node's `host:port`, then each master's further pages by its address.
fn scan_cluster(con: &mut ClusterConnection, scan: &dyn Fn(&str) -> redis::Cmd) -> Result<Vec<Vec<u8>>, ScanError> {
    let all_masters = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
    let replies = con.route_command(&scan("0"), all_masters).map_err(ScanError::Redis)?;
    let Value::Map(replies) = replies else { return Err(ScanError::Reply(replies)) };
    let mut keys = Vec::new();
    for (node, first) in replies {
        let address = text(&node).and_then(|address| {
            let (host, port) = address.rsplit_once(':')?;
            Some((host.to_string(), port.parse::<u16>().ok()?))
        });
        let Some((host, port)) = address else { return Err(ScanError::Reply(node)) };
        let mut page = |cursor: &str| {
            let by_address = SingleNodeRoutingInfo::ByAddress { host: host.clone(), port };
            con.route_command(&scan(cursor), RoutingInfo::SingleNode(by_address))
        };
        keys.extend(scan_node(&mut page, Some(first))?);
    }
    Ok(keys)
}

/// The first reachable seed's answer to `CLUSTER SLOTS`, as one line: its error (`ERR This instance has
/// cluster support disabled`), or that it lists no slot.
fn cluster_slots_answer(seeds: &[String], timeout: Duration) -> String {
    for seed in seeds {
        let Ok(client) = redis::Client::open(seed.as_str()) else { continue };
        let Ok(mut con) = client.get_connection_with_timeout(timeout) else { continue };
        if con.set_read_timeout(Some(timeout)).is_err() {
            continue;
        }
        return match redis::cmd("CLUSTER").arg("SLOTS").query::<Value>(&mut con) {
            Err(error) => format!("CLUSTER SLOTS: {}", error_text(&error)),
            Ok(_) => "CLUSTER SLOTS lists no slot with a master".to_string(),
        };
    }
    "CLUSTER SLOTS names no master".to_string()
}

/// Refuses the scheme `redis+cluster://`, which some clients use for a cluster: this tool says so with
/// `--cluster`.
fn check_scheme(url: &str, shown: &str) -> Result<()> {
    if url.starts_with("redis+cluster://") || url.starts_with("rediss+cluster://") {
        return Err(AdminError::BadUrl {
            url: shown.to_string(),
            reason: "erl-admin has no redis+cluster:// scheme: give --cluster and redis:// URLs of seed nodes"
                .to_string(),
        });
    }
    Ok(())
}

/// The error of connecting to a cluster: bad credentials, or no seed reachable (the crate puts each
/// seed's error in one message: "Failed to connect to each cluster node (host:port: reason; ...)").
fn cluster_connect_error(url: &str, error: &RedisError) -> AdminError {
    let reason = error.detail().map_or_else(|| error_text(error), str::to_string);
    let refused = ["WRONGPASS", "NOAUTH", "NOPERM", "AuthenticationFailed"];
    if error.kind() == ErrorKind::AuthenticationFailed || refused.iter().any(|code| reason.contains(code)) {
        AdminError::AuthFailed { url: url.to_string(), reason }
    } else if error.is_io_error() {
        AdminError::Unreachable { url: url.to_string(), reason }
    } else {
        connect_error(url, error)
    }
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
    // The user info ends at the last `@`: a password may hold `/`, `?`, `#` or `@` unencoded (host names
    // and Redis URL paths hold none).
    match rest.rsplit_once('@') {
        Some((userinfo, host_and_path)) => match userinfo.split_once(':') {
            Some((user, _password)) => format!("{scheme}://{user}:***@{host_and_path}"),
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
        assert_eq!(redact_url("redis://:a/b@c@10.0.0.1:6379/0"), "redis://:***@10.0.0.1:6379/0", "/ and @ in it");
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
