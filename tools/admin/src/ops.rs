//! The operations on one Redisson `RRateLimiter` in Redis (show, set-rate, try-set-rate, update-rate,
//! delete, list): they read its config and state, and change it with the filter's own scripts
//! (`edge_rate_limiter::script`) on the filter's own key layout (`edge_rate_limiter::key`). Each returns
//! a report (`report`); decoding is `model`'s, the connection `redis_io`'s.
//!
//! PER_CLIENT limiters keep one state per client instance (`{N}:value:<id>`, `{N}:permits:<id>`), and
//! the scripts touch only the client they are given. So that an operator's "reset" or "update" means the
//! whole limiter, `set-rate`, `update-rate` and `delete` also apply to every client found by `SCAN`.
//!
//! Every `now_ms` is ms since the epoch (the clock the operator chose). Every operation fails with the
//! errors of [`Redis`] (unreachable, error replies) besides those it lists.

use edge_rate_limiter::config::LimiterType;
use edge_rate_limiter::key::{redisson_suffix, LimiterKeys};
use edge_rate_limiter::script::{
    Script, AVAILABLE_PERMITS, DELETE, RULE_CONFIG_FIELD, SET_RATE, TRY_SET_RATE, UPDATE_RATE,
};
use redis::Value;

use crate::counter::counter_key;
use crate::counter_ops::is_counter;
use crate::error::{AdminError, Result};
use crate::model::{check_keep_alive, parse_config, summarize, Config, Update};
use crate::redis_io::{bytes, count, integer, scored_members, unexpected_reply, Redis};
use crate::report::{ChangeReport, DeleteReport, KeyTtl, ListEntry, ShowReport, State};

/// [`crate::report::ListEntry::layout`] of a Redisson limiter.
const SLIDING_LOG: &str = "sliding_log";

/// The client id used for the scripts' client keys when none is selected: the nil UUID, which no
/// Redisson instance or gateway ever has, so the scripts touch no real client's state through it.
pub const NO_CLIENT: &str = "00000000-0000-0000-0000-000000000000";

/// The keys of limiter `name` as the scripts see them for `client_id` (none selected: [`NO_CLIENT`]).
fn keys_for(name: &str, client_id: Option<&str>) -> LimiterKeys {
    LimiterKeys::new(name, client_id.unwrap_or(NO_CLIENT))
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
    if !hash_exists(redis, name)? {
        return Ok(None);
    }
    let mut cmd = redis::cmd("HMGET");
    cmd.arg(name).arg("rate").arg("interval").arg("type").arg("keepAliveTime");
    let context = format!("reading the config of {name}");
    let reply = redis.query(&cmd, &context)?;
    let values: Vec<Option<Vec<u8>>> = match &reply {
        Value::Array(items) => items.iter().map(bytes).collect(),
        _ => Vec::new(),
    };
    let fields: [Option<Vec<u8>>; 4] = values.try_into().map_err(|_| unexpected_reply(context, &reply))?;
    Ok(Some(parse_config(name, &fields)))
}

/// Whether there is a key `name` (a hash).
///
/// # Errors
/// [`AdminError::WrongType`] if `name` holds something else than a hash.
fn hash_exists(redis: &mut Redis, name: &str) -> Result<bool> {
    match redis.key_type(name)?.as_str() {
        "none" => Ok(false),
        "hash" => Ok(true),
        found => Err(AdminError::WrongType { key: name.to_string(), found: found.to_string() }),
    }
}

/// Limiter `name`'s config hash read without writing: `None` if there is no key `name`; else its config
/// (or why it is not one) and its `erlRuleConfig` record (the config a rule wrote, `rate_source: "config"`).
///
/// # Errors
/// [`AdminError::WrongType`], Redis errors.
pub fn peek_config(redis: &mut Redis, name: &str) -> Result<Option<(Result<Config>, Option<String>)>> {
    let Some(config) = read_config_if_any(redis, name)? else { return Ok(None) };
    let mut hget = redis::cmd("HGET");
    hget.arg(name).arg(RULE_CONFIG_FIELD);
    let record = bytes(&redis.query(&hget, &format!("reading the rule config record of {name}"))?)
        .map(|record| String::from_utf8_lossy(&record).into_owned());
    Ok(Some((config, record)))
}

/// One window of a limiter as [`peek_window`] reads it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Peeked {
    /// The value key (`None`: no such key).
    pub value: Option<Vec<u8>>,
    /// Every permit member with its score.
    pub members: Vec<(Vec<u8>, f64)>,
    /// The TTLs of the value and permits keys.
    pub ttl: Vec<KeyTtl>,
}

/// One window of limiter `name` read without writing (no script, unlike `show`'s availablePermits): its
/// value key, its permit members with their scores, and the TTLs of both keys.
///
/// # Errors
/// Redis errors (a key of another type: [`AdminError::Redis`] with `WRONGTYPE`).
pub fn peek_window(redis: &mut Redis, name: &str, value_key: &str, permits_key: &str) -> Result<Peeked> {
    let value = bytes(&redis.query(redis::cmd("GET").arg(value_key), &format!("reading the value of {name}"))?);
    let mut range = redis::cmd("ZRANGE");
    range.arg(permits_key).arg(0).arg(-1).arg("WITHSCORES");
    let members = scored_members(&redis.query(&range, &format!("reading the permits of {name}"))?);
    let ttl = vec![
        KeyTtl { key: value_key.to_string(), ttl_ms: redis.pttl(value_key)? },
        KeyTtl { key: permits_key.to_string(), ttl_ms: redis.pttl(permits_key)? },
    ];
    Ok(Peeked { value, members, ttl })
}

/// `show`: config, available permits (below zero while settled costs above their reservations are in
/// the window), the window with the filter's reservations in flight and settled costs (`model::Window`),
/// and TTLs; for a per-client limiter every client's (and the one `client_id` selects, even without state
/// yet).
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
    let keys = keys_for(name, client_id);
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
        // Below zero when settled costs passed their reservations (GIVE_BACK charges the excess).
        integer(&reply).ok_or_else(|| unexpected_reply(format!("reading the available permits of {name}"), &reply))?
    } else {
        i64::try_from(config.rate).unwrap_or(i64::MAX)
    };
    let window_start = now_ms.saturating_sub(config.interval_ms);
    let mut range = redis::cmd("ZRANGE");
    range.arg(permits_key).arg(format!("({window_start}")).arg("+inf").arg("BYSCORE").arg("WITHSCORES");
    let reply = redis.query(&range, &format!("reading the permits of {name}"))?;
    let members = scored_members(&reply);
    let mut zcount = redis::cmd("ZCOUNT");
    zcount.arg(permits_key).arg("-inf").arg(window_start);
    let expired = count(&redis.query(&zcount, &format!("counting the expired permits of {name}"))?).unwrap_or(0);
    let ttl = vec![
        KeyTtl { key: value_key.clone(), ttl_ms: redis.pttl(value_key)? },
        KeyTtl { key: permits_key.clone(), ttl_ms: redis.pttl(permits_key)? },
    ];
    Ok(State { client_id: client_id.map(str::to_string), available, window: summarize(&members, now_ms), expired, ttl })
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

/// The client ids with state in Redis for limiter `name`: the `<id>` of `{N}:value:<id>` and
/// `{N}:permits:<id>` keys, sorted, without repeats.
///
/// # Errors
/// Redis errors.
pub fn client_ids(redis: &mut Redis, name: &str) -> Result<Vec<String>> {
    let mut ids = Vec::new();
    for suffix in ["value", "permits"] {
        let prefix = format!("{}:", redisson_suffix(name, suffix));
        for key in redis.scan_prefix(&prefix, None)? {
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
        let context = format!("deleting client {id}'s state of {name}");
        removed += delete_client_keys(redis, &LimiterKeys::new(name, &id), &context)?;
    }
    Ok(removed)
}

/// Deletes the value and permits keys of the client of `keys`; returns how many keys were removed.
fn delete_client_keys(redis: &mut Redis, keys: &LimiterKeys, context: &str) -> Result<u64> {
    let mut del = redis::cmd("DEL");
    del.arg(&keys.client_value).arg(&keys.client_permits);
    Ok(count(&redis.query(&del, context)?).unwrap_or(0))
}

/// Runs `SET_RATE` or `TRY_SET_RATE` with `config` on limiter `name`, after checking that `name` is a
/// hash or nothing (a key of another type is left alone); returns the script's reply.
fn run_config_script(
    redis: &mut Redis,
    script: &Script,
    name: &str,
    config: &Config,
    client_id: Option<&str>,
) -> Result<Value> {
    hash_exists(redis, name)?;
    let args = config.script_args();
    redis.run_script(script, &keys_for(name, client_id), &arg_bytes(&args))
}

/// Refuses a command that writes a config on a sliding window counter (its rate is its rule's).
///
/// # Errors
/// [`AdminError::CounterLimiter`], Redis errors.
fn refuse_counter(redis: &mut Redis, name: &str) -> Result<()> {
    if is_counter(redis, name)? {
        return Err(AdminError::CounterLimiter(name.to_string()));
    }
    Ok(())
}

/// `set-rate`: writes the config and resets the state (Redisson `setRate`), of every client too.
/// A keep-alive of 0 means "never expires": a TTL left on the hash by an earlier keep-alive is removed.
///
/// # Errors
/// [`AdminError::CounterLimiter`], [`AdminError::WrongType`], Redis errors.
pub fn set_rate(redis: &mut Redis, name: &str, config: Config, client_id: Option<&str>) -> Result<ChangeReport> {
    refuse_counter(redis, name)?;
    run_config_script(redis, &SET_RATE, name, &config, client_id)?;
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
/// [`AdminError::CounterLimiter`], [`AdminError::WrongType`], Redis errors.
pub fn try_set_rate(redis: &mut Redis, name: &str, config: Config, client_id: Option<&str>) -> Result<ChangeReport> {
    refuse_counter(redis, name)?;
    let created = integer(&run_config_script(redis, &TRY_SET_RATE, name, &config, client_id)?) == Some(1);
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

/// `update-rate`: changes the config keeping consumed permits (Redisson 4.4+ `setRate` keeping state):
/// no burst when a rate goes up, no excess when it goes down. For a per-client limiter every client's
/// available permits are recomputed; a type change resets the state (of every client too).
///
/// # Errors
/// [`AdminError::CounterLimiter`], [`AdminError::NoLimiter`] and the other errors of [`read_config`],
/// keep-alive shorter than the interval ([`AdminError::Usage`]), Redis errors.
pub fn update_rate(
    redis: &mut Redis,
    name: &str,
    update: Update,
    client_id: Option<&str>,
    now_ms: u64,
) -> Result<ChangeReport> {
    refuse_counter(redis, name)?;
    let current = read_config(redis, name)?;
    let config = update.apply(&current);
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
    let keys = keys_for(name, client_id);
    if integer(&redis.run_script(&UPDATE_RATE, &keys, &argv)?) != Some(1) {
        return Err(AdminError::NoLimiter(name.to_string()));
    }
    if client_id.is_none() && config.limiter_type == LimiterType::PerClient {
        // Like Redisson's, the script writes the calling client's value; the tool is no client.
        delete_client_keys(redis, &keys, &format!("removing the tool's own client state of {name}"))?;
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

/// Removes the TTL of the config hash when the keep-alive is 0 ("never expires").
fn persist_without_keep_alive(redis: &mut Redis, name: &str, config: &Config) -> Result<()> {
    if config.keep_alive_ms == 0 {
        redis.query(redis::cmd("PERSIST").arg(name), &format!("removing the TTL of {name}"))?;
    }
    Ok(())
}

fn arg_bytes(args: &[String]) -> Vec<&[u8]> {
    args.iter().map(String::as_bytes).collect()
}

/// `delete`: removes every key of the limiter (Redisson `delete`), every client's state too, and its
/// sliding window counter's hash (`{name}:counter`: a rule with `layout: "sliding_window_counter"`).
///
/// # Errors
/// [`AdminError::NoLimiter`] when there was nothing to delete, [`AdminError::WrongType`] when the name is
/// not a hash (nothing is deleted), Redis errors.
pub fn delete(redis: &mut Redis, name: &str, client_id: Option<&str>) -> Result<DeleteReport> {
    hash_exists(redis, name)?;
    let removed = count(&redis.run_script(&DELETE, &keys_for(name, client_id), &[])?).unwrap_or(0);
    let counter = count(&redis.query(redis::cmd("DEL").arg(counter_key(name)), &format!("deleting {name}'s counter"))?);
    let keys_removed = removed + delete_client_state(redis, name)? + counter.unwrap_or(0);
    if keys_removed == 0 {
        return Err(AdminError::NoLimiter(name.to_string()));
    }
    Ok(DeleteReport { name: name.to_string(), keys_removed })
}

/// `list`: every hash whose name starts with `prefix` and has the fields `rate` and `interval`, with its
/// config (or why it is invalid) and, for overall limiters, the permits available at `now_ms`; and every
/// sliding window counter or calendar quota whose name starts with `prefix` (its hash `{name}:counter`); by
/// name.
///
/// # Errors
/// Redis errors.
pub fn list(redis: &mut Redis, prefix: &str, now_ms: u64) -> Result<Vec<ListEntry>> {
    let mut entries = Vec::new();
    for raw in redis.scan_prefix(prefix, Some("hash"))? {
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
                ListEntry { name, layout: SLIDING_LOG, config: Some(config), problem: None, available }
            }
            Some(Err(problem)) => ListEntry {
                name,
                layout: SLIDING_LOG,
                config: None,
                problem: Some(problem.to_string()),
                available: None,
            },
        };
        entries.push(entry);
    }
    for name in crate::counter_ops::names_under(redis, prefix)? {
        // The same hash: a calendar quota's fields are period starts (ms since the epoch).
        let periods = crate::calendar::looks_like_periods(&crate::counter_ops::read(redis, &name)?);
        let layout = if periods { crate::calendar::LAYOUT } else { crate::counter::LAYOUT };
        entries.push(ListEntry { name, layout, config: None, problem: None, available: None });
    }
    entries.sort_by(|a, b| (&a.name, a.layout).cmp(&(&b.name, b.layout)));
    Ok(entries)
}
