//! The operations on one Redisson `RRateLimiter` (layout as Redisson 4.x, DESIGN.md): read its config
//! and state, and change it with the filter's own scripts (`edge_rate_limiter::script`) on the filter's
//! own key layout (`edge_rate_limiter::key`). Each operation returns a report (`serde` for `--json`;
//! `output` prints it as text).
//!
//! PER_CLIENT limiters keep one state per client instance (`{N}:value:<id>`, `{N}:permits:<id>`), and
//! the scripts touch only the client they are given. So that an operator's "reset" or "update" means the
//! whole limiter, `set-rate`, `update-rate` and `delete` also apply to every client found by `SCAN`.

use edge_rate_limiter::config::LimiterType;
use edge_rate_limiter::key::{redisson_suffix, LimiterKeys};
use edge_rate_limiter::script::{AVAILABLE_PERMITS, DELETE, SET_RATE, TRY_SET_RATE, UPDATE_RATE};
use redis::Value;
use serde::Serialize;

use crate::error::{AdminError, Result};
use crate::redis_io::{bytes, integer, Redis};

/// The client id used for the scripts' client keys when none is selected: the nil UUID, which no
/// Redisson instance or gateway ever has, so the scripts touch no real client's state through it.
pub const NO_CLIENT: &str = "00000000-0000-0000-0000-000000000000";

/// A limiter's config, as the fields of its hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Config {
    /// `rate`: permits per interval.
    pub rate: u64,
    /// `interval`: the window, ms.
    pub interval_ms: u64,
    /// `type`: `"0"` overall, `"1"` per client.
    #[serde(rename = "type", serialize_with = "serialize_type")]
    pub limiter_type: LimiterType,
    /// `keepAliveTime`: ms after which unused keys expire; 0 = never (absent, as Redisson < 3.36 writes).
    pub keep_alive_ms: u64,
}

fn serialize_type<S: serde::Serializer>(limiter_type: &LimiterType, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(type_name(*limiter_type))
}

/// The type as the tool names it: `overall` or `per-client`.
pub fn type_name(limiter_type: LimiterType) -> &'static str {
    match limiter_type {
        LimiterType::Overall => "overall",
        LimiterType::PerClient => "per-client",
    }
}

impl Config {
    /// The script arguments rate, interval, type, keepAliveTime, as text.
    fn script_args(&self) -> [String; 4] {
        [
            self.rate.to_string(),
            self.interval_ms.to_string(),
            self.limiter_type.redisson_ordinal().to_string(),
            self.keep_alive_ms.to_string(),
        ]
    }
}

/// The config from the values of `HMGET name rate interval type keepAliveTime`.
///
/// # Errors
/// [`AdminError::NotInitialized`] when `rate`, `interval` or `type` is missing,
/// [`AdminError::InvalidConfig`] when a field is not what Redisson writes.
pub fn parse_config(name: &str, fields: &[Option<Vec<u8>>; 4]) -> Result<Config> {
    let [rate, interval, limiter_type, keep_alive] = fields;
    let number = |field: &'static str, value: &Option<Vec<u8>>, min: u64| -> Result<u64> {
        let value = value.as_ref().ok_or(AdminError::NotInitialized { name: name.to_string(), field })?;
        let text = String::from_utf8_lossy(value);
        text.parse::<u64>().ok().filter(|n| *n >= min).ok_or_else(|| AdminError::InvalidConfig {
            name: name.to_string(),
            field,
            value: text.into_owned(),
        })
    };
    let rate = number("rate", rate, 1)?;
    let interval_ms = number("interval", interval, 1)?;
    let ordinal = number("type", limiter_type, 0)?;
    let limiter_type = i64::try_from(ordinal).ok().and_then(LimiterType::from_redisson_ordinal).ok_or_else(|| {
        AdminError::InvalidConfig { name: name.to_string(), field: "type", value: ordinal.to_string() }
    })?;
    let keep_alive_ms = match keep_alive {
        None => 0,
        some => number("keepAliveTime", some, 0)?,
    };
    Ok(Config { rate, interval_ms, limiter_type, keep_alive_ms })
}

/// Reads limiter `name`'s config.
///
/// # Errors
/// [`AdminError::NoLimiter`], [`AdminError::WrongType`], those of [`parse_config`], Redis errors.
pub fn read_config(redis: &mut Redis, name: &str) -> Result<Config> {
    match read_config_if_any(redis, name)? {
        Some(config) => config,
        None => Err(AdminError::NoLimiter(name.to_string())),
    }
}

/// `None` if there is no key `name`; else its config or why it is not one.
fn read_config_if_any(redis: &mut Redis, name: &str) -> Result<Option<Result<Config>>> {
    let found = redis.key_type(name)?;
    match found.as_str() {
        "none" => Ok(None),
        "hash" => {
            let mut cmd = redis::cmd("HMGET");
            cmd.arg(name).arg("rate").arg("interval").arg("type").arg("keepAliveTime");
            let reply = redis.query(&cmd, &format!("reading the config of {name}"))?;
            let values: Vec<Option<Vec<u8>>> = match &reply {
                Value::Array(items) => items.iter().map(bytes).collect(),
                _ => Vec::new(),
            };
            let fields: [Option<Vec<u8>>; 4] = values.try_into().map_err(|_| AdminError::Redis {
                context: format!("reading the config of {name}"),
                reason: format!("unexpected reply {reply:?}"),
            })?;
            Ok(Some(parse_config(name, &fields)))
        }
        _ => Err(AdminError::WrongType { key: name.to_string(), found }),
    }
}

/// What the tool knows of one permit member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    /// Length of its random part (16 for Redisson 4.x and the filter, 8 for Redisson 3.17-3.20).
    pub random_len: usize,
    /// Permits it took.
    pub permits: u32,
}

/// Decodes a member written by Lua `struct.pack('Bc0I', #random, random, permits)`: one length byte, the
/// random bytes, the permits as a 4-byte little-endian unsigned integer. `None` for any other shape.
pub fn decode_member(member: &[u8]) -> Option<Member> {
    let (&len, rest) = member.split_first()?;
    let random_len = usize::from(len);
    let permits: [u8; 4] = rest.get(random_len..)?.try_into().ok()?;
    Some(Member { random_len, permits: u32::from_le_bytes(permits) })
}

/// The permits currently in a limiter's window.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Window {
    /// Members (successful acquires) in the window.
    pub acquires: u64,
    /// Permits they took.
    pub permits: u64,
    /// Acquire time of the oldest, ms since the epoch.
    pub oldest_ms: Option<u64>,
    /// Its age at `now`, ms.
    pub oldest_age_ms: Option<u64>,
    /// Acquire time of the newest, ms since the epoch.
    pub newest_ms: Option<u64>,
    /// Its age at `now`, ms.
    pub newest_age_ms: Option<u64>,
    /// Members in the sorted set that the tool cannot decode (not Redisson's `Bc0I` format).
    pub unreadable: u64,
}

/// Summarizes the `(member, score)` pairs of the window.
pub fn summarize(members: &[(Vec<u8>, f64)], now_ms: u64) -> Window {
    let mut window = Window {
        acquires: 0,
        permits: 0,
        oldest_ms: None,
        oldest_age_ms: None,
        newest_ms: None,
        newest_age_ms: None,
        unreadable: 0,
    };
    for (member, score) in members {
        match decode_member(member) {
            Some(decoded) => {
                window.acquires += 1;
                window.permits += u64::from(decoded.permits);
            }
            None => window.unreadable += 1,
        }
        let score = score_ms(*score);
        window.oldest_ms = Some(window.oldest_ms.map_or(score, |oldest| oldest.min(score)));
        window.newest_ms = Some(window.newest_ms.map_or(score, |newest| newest.max(score)));
    }
    window.oldest_age_ms = window.oldest_ms.map(|ms| now_ms.saturating_sub(ms));
    window.newest_age_ms = window.newest_ms.map(|ms| now_ms.saturating_sub(ms));
    window
}

/// A sorted-set score (acquire time, ms) as an integer; negative or not finite scores count as 0.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn score_ms(score: f64) -> u64 {
    if score.is_finite() && score > 0.0 {
        score as u64
    } else {
        0
    }
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

/// One key's TTL.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KeyTtl {
    /// The key.
    pub key: String,
    /// `PTTL`: ms left, `-1` no expiry, `-2` no such key.
    pub ttl_ms: i64,
}

/// The state of one window (the overall one, or one client's).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct State {
    /// The client id (per-client limiters), `None` for the overall window.
    pub client_id: Option<String>,
    /// Permits available now (Redisson `availablePermits`).
    pub available: u64,
    /// The permits in the window.
    pub window: Window,
    /// Members older than the window still in the sorted set (released by the next acquire).
    pub expired: u64,
    /// TTLs of the value and permits keys.
    pub ttl: Vec<KeyTtl>,
}

/// What `show` reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ShowReport {
    /// The limiter name (its config hash).
    pub name: String,
    /// The config.
    pub config: Config,
    /// "now" of the report, ms since the epoch.
    pub now_ms: u64,
    /// TTL of the config hash.
    pub config_ttl_ms: i64,
    /// The overall window, or the selected client's (`--client-id`) of a per-client limiter.
    pub state: Option<State>,
    /// Per-client limiters: every client id with state in Redis, and each one's state.
    pub clients: Vec<State>,
}

/// `show`: config, available permits, the window and TTLs.
///
/// # Errors
/// [`read_config`]'s errors, Redis errors.
pub fn show(redis: &mut Redis, name: &str, client_id: Option<&str>, now_ms: u64) -> Result<ShowReport> {
    let config = read_config(redis, name)?;
    let config_ttl_ms = redis.pttl(name)?;
    let (state, clients) = match config.limiter_type {
        LimiterType::Overall => (Some(state_of(redis, name, &config, None, now_ms)?), Vec::new()),
        LimiterType::PerClient => {
            let mut clients = Vec::new();
            for id in client_ids(redis, name)? {
                clients.push(state_of(redis, name, &config, Some(&id), now_ms)?);
            }
            let selected = match client_id {
                Some(id) => match clients.iter().find(|state| state.client_id.as_deref() == Some(id)) {
                    Some(state) => Some(state.clone()),
                    None => Some(state_of(redis, name, &config, Some(id), now_ms)?),
                },
                None => None,
            };
            (selected, clients)
        }
    };
    Ok(ShowReport { name: name.to_string(), config, now_ms, config_ttl_ms, state, clients })
}

/// The state of the overall window (`client_id` None) or of one client's.
fn state_of(redis: &mut Redis, name: &str, config: &Config, client_id: Option<&str>, now_ms: u64) -> Result<State> {
    let keys = LimiterKeys::new(name, client_id.unwrap_or(NO_CLIENT));
    let (value_key, permits_key) = match config.limiter_type {
        LimiterType::Overall => (&keys.value, &keys.permits),
        LimiterType::PerClient => (&keys.client_value, &keys.client_permits),
    };
    // Redisson's availablePermits sets a missing value key to the rate (with no TTL, which would outlive
    // the limiter): a window with no value key is full, so say so without writing anything.
    let available = if redis.exists(value_key)? {
        let now = now_ms.to_string();
        let reply = redis.run_script(&AVAILABLE_PERMITS, &keys, &[now.as_bytes()])?;
        keep_value_ttl(redis, name, value_key, permits_key)?;
        integer(&reply).and_then(|n| u64::try_from(n).ok()).ok_or_else(|| AdminError::Redis {
            context: format!("reading the available permits of {name}"),
            reason: format!("unexpected reply {reply:?}"),
        })?
    } else {
        config.rate
    };
    let window_start = now_ms.saturating_sub(config.interval_ms);
    let mut range = redis::cmd("ZRANGE");
    range.arg(permits_key).arg(format!("({window_start}")).arg("+inf").arg("BYSCORE").arg("WITHSCORES");
    let reply = redis.query(&range, &format!("reading the permits of {name}"))?;
    let members = scored_members(&reply);
    let mut count = redis::cmd("ZCOUNT");
    count.arg(permits_key).arg("-inf").arg(window_start);
    let expired = integer(&redis.query(&count, &format!("counting the expired permits of {name}"))?).unwrap_or(0);
    let ttl = vec![
        KeyTtl { key: value_key.clone(), ttl_ms: redis.pttl(value_key)? },
        KeyTtl { key: permits_key.clone(), ttl_ms: redis.pttl(permits_key)? },
    ];
    Ok(State {
        client_id: client_id.map(str::to_string),
        available,
        window: summarize(&members, now_ms),
        expired: u64::try_from(expired).unwrap_or(0),
        ttl,
    })
}

/// Gives the value key back the TTL its `SET` in the availablePermits and updateRate scripts removed (a
/// plain `SET` drops a key's TTL): the permits key's, else the config hash's. Without it a limiter left
/// idle after `show` or `update-rate` would leave its value key behind forever, and a limiter re-created
/// later under that name would start from that stale value.
fn keep_value_ttl(redis: &mut Redis, name: &str, value_key: &str, permits_key: &str) -> Result<()> {
    if redis.pttl(value_key)? != -1 {
        return Ok(());
    }
    let ttl = match redis.pttl(permits_key)? {
        ttl if ttl > 0 => ttl,
        _ => redis.pttl(name)?,
    };
    if ttl > 0 {
        redis.query(redis::cmd("PEXPIRE").arg(value_key).arg(ttl), &format!("restoring the TTL of {value_key}"))?;
    }
    Ok(())
}

/// The `(member, score)` pairs of a `WITHSCORES` reply (RESP2: a flat array; RESP3: pairs).
fn scored_members(reply: &Value) -> Vec<(Vec<u8>, f64)> {
    let Value::Array(items) = reply else { return Vec::new() };
    let score = |value: &Value| match value {
        Value::Double(score) => Some(*score),
        other => crate::redis_io::text(other)?.parse::<f64>().ok(),
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

/// The client ids with state in Redis for limiter `name`: the `<id>` of `{N}:value:<id>` and
/// `{N}:permits:<id>` keys.
///
/// # Errors
/// Redis errors.
pub fn client_ids(redis: &mut Redis, name: &str) -> Result<Vec<String>> {
    let mut ids = Vec::new();
    for suffix in ["value", "permits"] {
        let prefix = format!("{}:", redisson_suffix(name, suffix));
        for key in redis.scan(&format!("{}*", glob_escape(&prefix)), None)? {
            if let Some(id) = key.strip_prefix(prefix.as_bytes()) {
                ids.push(String::from_utf8_lossy(id).into_owned());
            }
        }
    }
    ids.sort();
    ids.dedup();
    Ok(ids)
}

/// Deletes the per-client state of every client of limiter `name`; returns how many keys were removed.
fn delete_client_state(redis: &mut Redis, name: &str) -> Result<u64> {
    let mut removed = 0;
    for id in client_ids(redis, name)? {
        let keys = LimiterKeys::new(name, &id);
        let mut del = redis::cmd("DEL");
        del.arg(&keys.client_value).arg(&keys.client_permits);
        removed += integer(&redis.query(&del, &format!("deleting client {id}'s state of {name}"))?).unwrap_or(0);
    }
    Ok(u64::try_from(removed).unwrap_or(0))
}

/// Fails with [`AdminError::WrongType`] if `name` holds something else than a hash.
fn check_hash_or_none(redis: &mut Redis, name: &str) -> Result<bool> {
    match redis.key_type(name)?.as_str() {
        "none" => Ok(false),
        "hash" => Ok(true),
        found => Err(AdminError::WrongType { key: name.to_string(), found: found.to_string() }),
    }
}

/// What a changing command did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChangeReport {
    /// The limiter name.
    pub name: String,
    /// The command: `set-rate`, `try-set-rate`, `update-rate`.
    pub action: &'static str,
    /// `try-set-rate`: whether the limiter was created (false: it existed and was left as it is).
    pub changed: bool,
    /// The config in Redis afterwards.
    pub config: Config,
    /// Keys of per-client state removed (other clients than the one the script was given).
    pub client_keys_removed: u64,
    /// `update-rate` of a per-client limiter: clients whose available permits were recomputed.
    pub clients_updated: u64,
}

/// `set-rate`: writes the config and resets the state (Redisson `setRate`), of every client too.
/// A keep-alive of 0 means "never expires": a TTL left on the hash by an earlier keep-alive is removed.
///
/// # Errors
/// [`AdminError::WrongType`], Redis errors.
pub fn set_rate(redis: &mut Redis, name: &str, config: Config, client_id: Option<&str>) -> Result<ChangeReport> {
    check_hash_or_none(redis, name)?;
    let keys = LimiterKeys::new(name, client_id.unwrap_or(NO_CLIENT));
    let args = config.script_args();
    redis.run_script(&SET_RATE, &keys, &arg_bytes(&args))?;
    persist_without_keep_alive(redis, name, &config)?;
    let client_keys_removed = delete_client_state(redis, name)?;
    let config = read_config(redis, name)?;
    Ok(ChangeReport {
        name: name.to_string(),
        action: "set-rate",
        changed: true,
        config,
        client_keys_removed,
        clients_updated: 0,
    })
}

/// `try-set-rate`: creates the limiter unless it exists (Redisson `trySetRate`).
///
/// # Errors
/// [`AdminError::WrongType`], Redis errors.
pub fn try_set_rate(redis: &mut Redis, name: &str, config: Config, client_id: Option<&str>) -> Result<ChangeReport> {
    check_hash_or_none(redis, name)?;
    let keys = LimiterKeys::new(name, client_id.unwrap_or(NO_CLIENT));
    let args = config.script_args();
    let created = integer(&redis.run_script(&TRY_SET_RATE, &keys, &arg_bytes(&args))?) == Some(1);
    let config = read_config(redis, name)?;
    Ok(ChangeReport {
        name: name.to_string(),
        action: "try-set-rate",
        changed: created,
        config,
        client_keys_removed: 0,
        clients_updated: 0,
    })
}

/// The changes `update-rate` asks for; `None` keeps the current value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Update {
    /// New rate.
    pub rate: Option<u64>,
    /// New interval, ms.
    pub interval_ms: Option<u64>,
    /// New type.
    pub limiter_type: Option<LimiterType>,
    /// New keepAliveTime, ms.
    pub keep_alive_ms: Option<u64>,
}

/// `update-rate`: changes the config keeping consumed permits (Redisson 4.4+ `setRate` keeping state):
/// no burst when a rate goes up, no excess when it goes down. For a per-client limiter every client's
/// available permits are recomputed; a type change resets the state (of every client too).
///
/// # Errors
/// [`AdminError::NoLimiter`] and the other errors of [`read_config`], keep-alive shorter than the
/// interval ([`AdminError::Usage`]), Redis errors.
pub fn update_rate(
    redis: &mut Redis,
    name: &str,
    update: Update,
    client_id: Option<&str>,
    now_ms: u64,
) -> Result<ChangeReport> {
    let current = read_config(redis, name)?;
    let config = Config {
        rate: update.rate.unwrap_or(current.rate),
        interval_ms: update.interval_ms.unwrap_or(current.interval_ms),
        limiter_type: update.limiter_type.unwrap_or(current.limiter_type),
        keep_alive_ms: update.keep_alive_ms.unwrap_or(current.keep_alive_ms),
    };
    check_keep_alive(&config)?;
    let args = config.script_args();
    let now = now_ms.to_string();
    let mut argv = arg_bytes(&args);
    argv.push(now.as_bytes());
    let mut clients_updated = 0;
    let mut client_keys_removed = 0;
    let type_changed = config.limiter_type != current.limiter_type;
    // The first call writes the config (and, for the overall window, recomputes its value); with the
    // config unchanged from then on, each further call recomputes one client's value.
    let keys = LimiterKeys::new(name, client_id.unwrap_or(NO_CLIENT));
    if integer(&redis.run_script(&UPDATE_RATE, &keys, &argv)?) != Some(1) {
        return Err(AdminError::NoLimiter(name.to_string()));
    }
    if client_id.is_none() && config.limiter_type == LimiterType::PerClient {
        // Like Redisson's, the script writes the calling client's value; the tool is no client.
        let mut del = redis::cmd("DEL");
        del.arg(&keys.client_value).arg(&keys.client_permits);
        redis.query(&del, &format!("removing the tool's own client state of {name}"))?;
    }
    if type_changed {
        client_keys_removed = delete_client_state(redis, name)?;
    } else if config.limiter_type == LimiterType::PerClient {
        for id in client_ids(redis, name)? {
            let client_keys = LimiterKeys::new(name, &id);
            if client_id != Some(id.as_str()) {
                redis.run_script(&UPDATE_RATE, &client_keys, &argv)?;
            }
            keep_value_ttl(redis, name, &client_keys.client_value, &client_keys.client_permits)?;
            clients_updated += 1;
        }
    } else {
        keep_value_ttl(redis, name, &keys.value, &keys.permits)?;
    }
    persist_without_keep_alive(redis, name, &config)?;
    let config = read_config(redis, name)?;
    Ok(ChangeReport {
        name: name.to_string(),
        action: "update-rate",
        changed: true,
        config,
        client_keys_removed,
        clients_updated,
    })
}

/// Checks the rule the filter's configuration enforces too: keep-alive 0 or at least the interval (a
/// shorter expiry would forget permits still in the window).
///
/// # Errors
/// [`AdminError::Usage`].
pub fn check_keep_alive(config: &Config) -> Result<()> {
    if config.keep_alive_ms != 0 && config.keep_alive_ms < config.interval_ms {
        return Err(AdminError::Usage(format!(
            "keep-alive {} is shorter than the interval {}: use 0 (never expire) or at least the interval",
            crate::output::human_ms(config.keep_alive_ms),
            crate::output::human_ms(config.interval_ms)
        )));
    }
    Ok(())
}

fn persist_without_keep_alive(redis: &mut Redis, name: &str, config: &Config) -> Result<()> {
    if config.keep_alive_ms == 0 {
        redis.query(redis::cmd("PERSIST").arg(name), &format!("removing the TTL of {name}"))?;
    }
    Ok(())
}

fn arg_bytes(args: &[String]) -> Vec<&[u8]> {
    args.iter().map(String::as_bytes).collect()
}

/// What `delete` did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeleteReport {
    /// The limiter name.
    pub name: String,
    /// Keys removed (config, value and permits, and every client's).
    pub keys_removed: u64,
}

/// `delete`: removes every key of the limiter (Redisson `delete`), every client's state too.
///
/// # Errors
/// [`AdminError::NoLimiter`] when there was nothing to delete, [`AdminError::WrongType`] when the name is
/// not a hash (nothing is deleted), Redis errors.
pub fn delete(redis: &mut Redis, name: &str, client_id: Option<&str>) -> Result<DeleteReport> {
    check_hash_or_none(redis, name)?;
    let keys = LimiterKeys::new(name, client_id.unwrap_or(NO_CLIENT));
    let removed = integer(&redis.run_script(&DELETE, &keys, &[])?).and_then(|n| u64::try_from(n).ok()).unwrap_or(0);
    let keys_removed = removed + delete_client_state(redis, name)?;
    if keys_removed == 0 {
        return Err(AdminError::NoLimiter(name.to_string()));
    }
    Ok(DeleteReport { name: name.to_string(), keys_removed })
}

/// One line of `list`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ListEntry {
    /// The limiter name.
    pub name: String,
    /// Its config, if valid.
    pub config: Option<Config>,
    /// Why the config is not valid.
    pub problem: Option<String>,
    /// Overall limiters: permits available now; per-client ones: `None` (see `show`).
    pub available: Option<u64>,
}

/// `list`: every hash whose name starts with `prefix` and has the fields `rate` and `interval`.
///
/// # Errors
/// Redis errors.
pub fn list(redis: &mut Redis, prefix: &str, now_ms: u64) -> Result<Vec<ListEntry>> {
    let mut entries = Vec::new();
    for raw in redis.scan(&format!("{}*", glob_escape(prefix)), Some("hash"))? {
        let Ok(name) = String::from_utf8(raw) else { continue };
        let mut probe = redis::cmd("HMGET");
        probe.arg(&name).arg("rate").arg("interval");
        let has = match redis.query(&probe, &format!("reading {name}"))? {
            Value::Array(items) => items.iter().all(|item| !matches!(item, Value::Nil)),
            _ => false,
        };
        if !has {
            continue;
        }
        let entry = match read_config_if_any(redis, &name)? {
            // Expired or deleted since the scan.
            None => continue,
            Some(Ok(config)) => {
                let available = match config.limiter_type {
                    LimiterType::Overall => Some(state_of(redis, &name, &config, None, now_ms)?.available),
                    LimiterType::PerClient => None,
                };
                ListEntry { name, config: Some(config), problem: None, available }
            }
            Some(Err(problem)) => ListEntry { name, config: None, problem: Some(problem.to_string()), available: None },
        };
        entries.push(entry);
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(rate: &str, interval: &str, ty: &str, keep: Option<&str>) -> [Option<Vec<u8>>; 4] {
        [Some(rate.into()), Some(interval.into()), Some(ty.into()), keep.map(Into::into)]
    }

    #[test]
    fn configs_parse_as_redisson_writes_them() {
        let config = parse_config("n", &fields("5", "60000", "1", Some("3600000"))).unwrap();
        assert_eq!(
            config,
            Config { rate: 5, interval_ms: 60_000, limiter_type: LimiterType::PerClient, keep_alive_ms: 3_600_000 }
        );
        assert_eq!(parse_config("n", &fields("5", "1000", "0", None)).unwrap().keep_alive_ms, 0);
    }

    #[test]
    fn missing_and_invalid_fields_are_named() {
        let no_rate = [None, Some(b"1000".to_vec()), Some(b"0".to_vec()), None];
        assert_eq!(parse_config("n", &no_rate), Err(AdminError::NotInitialized { name: "n".into(), field: "rate" }));
        assert_eq!(
            parse_config("n", &fields("0", "1000", "0", None)),
            Err(AdminError::InvalidConfig { name: "n".into(), field: "rate", value: "0".into() })
        );
        assert_eq!(
            parse_config("n", &fields("5", "1000", "7", None)),
            Err(AdminError::InvalidConfig { name: "n".into(), field: "type", value: "7".into() })
        );
        assert!(matches!(
            parse_config("n", &fields("5", "x", "0", None)),
            Err(AdminError::InvalidConfig { field: "interval", .. })
        ));
    }

    #[test]
    fn members_decode_as_bc0i() {
        let mut member = vec![16u8];
        member.extend([7u8; 16]);
        member.extend(3u32.to_le_bytes());
        assert_eq!(decode_member(&member), Some(Member { random_len: 16, permits: 3 }));
        let mut old = vec![8u8];
        old.extend([1u8; 8]);
        old.extend(258u32.to_le_bytes());
        assert_eq!(decode_member(&old), Some(Member { random_len: 8, permits: 258 }));
        assert_eq!(decode_member(&member[..20]), None, "truncated");
        assert_eq!(decode_member(&[member.clone(), vec![0]].concat()), None, "trailing byte");
        assert_eq!(decode_member(b""), None);
    }

    #[test]
    fn windows_sum_permits_and_find_the_oldest_and_newest() {
        let member = |permits: u32| [vec![16u8], vec![0u8; 16], permits.to_le_bytes().to_vec()].concat();
        let members = vec![(member(1), 1_000.0), (member(2), 1_500.0), (b"junk".to_vec(), 1_200.0)];
        let window = summarize(&members, 2_000);
        assert_eq!((window.acquires, window.permits, window.unreadable), (2, 3, 1));
        assert_eq!((window.oldest_ms, window.oldest_age_ms), (Some(1_000), Some(1_000)));
        assert_eq!((window.newest_ms, window.newest_age_ms), (Some(1_500), Some(500)));
        assert_eq!(summarize(&[], 5).oldest_ms, None);
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

    #[test]
    fn keep_alive_must_cover_the_interval() {
        let config = Config { rate: 1, interval_ms: 60_000, limiter_type: LimiterType::Overall, keep_alive_ms: 1_000 };
        assert!(check_keep_alive(&config).is_err());
        assert!(check_keep_alive(&Config { keep_alive_ms: 0, ..config }).is_ok());
        assert!(check_keep_alive(&Config { keep_alive_ms: 60_000, ..config }).is_ok());
    }
}
