//! The sliding window counter's hash in Redis (`counter`): found, read and listed without writing
//! (`TYPE`, `HGETALL`, `PTTL`, `SCAN`), for `show` (`calendar_ops`), `explain`, `list` and the commands that
//! refuse it. A calendar quota keeps the same hash.

use redis::Value;

use crate::counter::{counter_key, Hash};
use crate::error::{AdminError, Result};
use crate::redis_io::{integer, Redis};

/// Whether `name` is a sliding window counter: no key `name` (a Redisson limiter's config hash) and a hash
/// at its counter key.
///
/// # Errors
/// Redis errors.
pub fn is_counter(redis: &mut Redis, name: &str) -> Result<bool> {
    Ok(redis.key_type(name)? == "none" && redis.key_type(&counter_key(name))? == "hash")
}

/// The names of the counter limiters whose name starts with `prefix`: the hashes `{name}:counter` (and
/// `name:counter` for a name holding a `{`), sorted.
///
/// # Errors
/// Redis errors.
pub fn names_under(redis: &mut Redis, prefix: &str) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for raw in redis.scan_prefix(&format!("{{{prefix}"), Some("hash"))? {
        let Ok(key) = String::from_utf8(raw) else { continue };
        let name = key.strip_prefix('{').and_then(|key| key.strip_suffix("}:counter"));
        if let Some(name) = name.filter(|name| !name.contains('{') && name.starts_with(prefix)) {
            names.push(name.to_string());
        }
    }
    for raw in redis.scan_prefix(prefix, Some("hash"))? {
        let Ok(key) = String::from_utf8(raw) else { continue };
        if let Some(name) = key.strip_suffix(":counter").filter(|name| name.contains('{')) {
            names.push(name.to_string());
        }
    }
    names.sort();
    names.dedup();
    Ok(names)
}

/// Counter limiter `name`'s hash, read without writing (no key: no field, TTL `-2`).
///
/// # Errors
/// A key of another type than a hash ([`AdminError::Redis`]), Redis errors.
pub fn read(redis: &mut Redis, name: &str) -> Result<Hash> {
    let key = counter_key(name);
    match redis.key_type(&key)?.as_str() {
        "none" => return Ok(Hash { ttl_ms: -2, ..Hash::default() }),
        "hash" => {}
        found => {
            return Err(AdminError::Redis {
                context: format!("reading the sliding window counter {key}"),
                reason: format!("it is a {found}, not a hash"),
            })
        }
    }
    let reply = redis.query(redis::cmd("HGETALL").arg(&key), &format!("reading the slices of {key}"))?;
    let mut hash = parse_fields(&reply);
    hash.ttl_ms = redis.pttl(&key)?;
    Ok(hash)
}

/// The fields of an `HGETALL` reply (RESP2: a flat array; RESP3: a map).
fn parse_fields(reply: &Value) -> Hash {
    let pairs: Vec<(&Value, &Value)> = match reply {
        Value::Array(items) => items.chunks(2).filter_map(|pair| Some((pair.first()?, pair.get(1)?))).collect(),
        Value::Map(pairs) => pairs.iter().map(|(field, value)| (field, value)).collect(),
        _ => Vec::new(),
    };
    let mut hash = Hash::default();
    for (field, value) in pairs {
        match (integer(field).and_then(|slice| u64::try_from(slice).ok()), integer(value)) {
            (Some(slice), Some(permits)) => hash.fields.push((slice, permits)),
            _ => hash.unreadable += 1,
        }
    }
    hash
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hgetall_replies_read_in_both_protocols() {
        let text = |t: &str| Value::BulkString(t.as_bytes().to_vec());
        let flat = Value::Array(vec![text("199980"), text("2"), text("x"), text("1"), text("199990"), text("-1")]);
        assert_eq!(parse_fields(&flat), Hash { fields: vec![(199_980, 2), (199_990, -1)], unreadable: 1, ttl_ms: 0 });
        let map = Value::Map(vec![(text("5"), Value::Int(7))]);
        assert_eq!(parse_fields(&map).fields, [(5, 7)]);
    }
}
