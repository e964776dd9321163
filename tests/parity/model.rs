//! The oracle: a pure Rust model of ONE Redisson 4.x `RRateLimiter` and of the Redis keys it lives in.
//!
//! Written from DESIGN.md ("Facts: Redisson's RRateLimiter layout"), the seed articles on Redisson's scripts
//! and Redisson 4.x `RedissonRateLimiter.java` (`tryAcquireAsync`, `trySetRateAsync`, `setRateAsync`,
//! `setOrUpdateAsync`, `availablePermitsAsync`, `deleteAsync`), never from `src/script.rs`: the property
//! tests run the same operations through this model and through the project's scripts on a real Redis and
//! require identical results and identical keys.
//!
//! The model keeps the limiter's keys the way Redis does, so that every Redis effect the scripts rely on is
//! modelled explicitly rather than assumed:
//! - `SET` drops a key's TTL; `DECRBY`, `ZADD`, `ZREMRANGEBYSCORE`, `HSET`, `HSETNX` keep it;
//! - a sorted set whose last member is removed no longer exists (so a later `PEXPIRE` on it does nothing);
//! - `ZADD` of a member that is already there (same bytes) only moves its score;
//! - members are ordered by score, then by their bytes;
//! - a key whose TTL has run out is gone (see [`Limiter::advance`]).
//!
//! Time: the model has its own clock (`clock_ms`, virtual ms since the epoch) that only TTLs use; every
//! operation gets the acquire time `now_ms` as a parameter, as Redisson passes `System.currentTimeMillis()`
//! of the client (which may be skewed from the clock the TTLs run on).
//!
//! Where the project's scripts deliberately differ from Redisson (as documented in `src/script.rs`), the
//! model follows the gateway and says so on the operation:
//! - [`Limiter::gateway_acquire`]: creates a missing limiter with trySetRate instead of failing with "not
//!   initialized", answers code 2 instead of raising an error when more permits are asked than the rate,
//!   reports a reset time, and takes `now` as the oldest score when a rejection finds no member (Redisson's
//!   script fails on `tonumber(nil)` there), and scores an admitted member `max(now, newest score)` (stamps
//!   in order; docs/redisson.md, "Clocks");
//! - [`Limiter::try_set_rate`]: a trySetRate that creates the limiter also deletes value and permits keys
//!   left from an earlier life of the limiter, so it starts full;
//! - [`Limiter::set_rate`]: resets the overall keys and this client's keys whatever the type, and a
//!   keepAlive of 0 removes an earlier TTL of the hash (`PERSIST`);
//! - [`Limiter::update_rate`] and [`Limiter::available_permits`]: the value and permits keys they write take
//!   the hash's TTL, or none (`PERSIST`), so no key outlives the config (Redisson's plain `SET` leaves a
//!   value key without TTL behind an expiring limiter); updateRate with keepAlive 0 also `PERSIST`s the hash.
//!
//! Everything else is Redisson's, including the parts the gateway's scripts do not do yet (reported as
//! divergences, see the property tests).

use std::collections::BTreeMap;

/// Virtual milliseconds since the epoch (also used for durations, in ms). Signed like Lua numbers and
/// Redis scores, so the delay arithmetic below is the scripts' arithmetic.
pub type Ms = i64;

/// The gateway's clock guard for a window of `interval_ms`: `min(20, interval / 50)` ms (docs/redisson.md,
/// "Clocks"; the ACQUIRE and ACQUIRE_ALL scripts).
pub fn clock_guard(interval_ms: Ms) -> Ms {
    20.min(interval_ms / 50)
}

/// Redisson's `RateType`, stored in the hash's `type` field as its ordinal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RateType {
    /// `RateType.OVERALL`, `"0"`: one window for every client.
    Overall,
    /// `RateType.PER_CLIENT`, `"1"`: one window per client instance (Redisson: per `RedissonClient` id).
    PerClient,
}

impl RateType {
    /// The `type` field value (`RateType.ordinal()`).
    pub fn ordinal(self) -> i64 {
        match self {
            RateType::Overall => 0,
            RateType::PerClient => 1,
        }
    }
}

/// A limiter configuration as Redisson stores it in the hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateConfig {
    /// `rate`: permits per interval.
    pub rate: i64,
    /// `interval`: the window, ms.
    pub interval_ms: Ms,
    /// `type`.
    pub rate_type: RateType,
    /// `keepAliveTime`, ms; `0` = none. `None` = no such field: a limiter created by Redisson 3.x, whose
    /// trySetRate wrote only `rate`, `interval` and `type` (as an argument: write no such field).
    pub keep_alive_ms: Option<Ms>,
}

impl RateConfig {
    /// keepAliveTime as Redisson 4.x reads it: a missing field means none (`0`).
    pub fn keep_alive(&self) -> Ms {
        self.keep_alive_ms.unwrap_or(0)
    }
}

/// Which of the limiter's windows a value or permits key belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Scope {
    /// `suffix(N, "value")`, `suffix(N, "permits")`.
    Overall,
    /// `... + ":" + id` of client number `.0` (the model names clients by index; the harness maps
    /// indexes to UUID strings).
    Client(usize),
}

/// One of the limiter's keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Key {
    /// The config hash, named `N`.
    Config,
    /// A value key (string: permits available).
    Value(Scope),
    /// A permits key (sorted set: one member per acquire).
    Permits(Scope),
}

/// The Redis key names of limiter `name` for client `client_id`, from DESIGN.md: `suffix(N, s)` is `N:s` if
/// `N` contains `{`, else `{N}:s`; the per-client keys append `":" + id`. Computed here independently of the
/// crate's `LimiterKeys`, so the tests also check the crate's naming.
pub fn redisson_key_name(name: &str, key: Key, client_ids: &[&str]) -> String {
    let suffix = |s: &str| if name.contains('{') { format!("{name}:{s}") } else { format!("{{{name}}}:{s}") };
    let client = |index: usize| client_ids.get(index).copied().unwrap_or("unknown-client");
    match key {
        Key::Config => name.to_string(),
        Key::Value(Scope::Overall) => suffix("value"),
        Key::Permits(Scope::Overall) => suffix("permits"),
        Key::Value(Scope::Client(index)) => format!("{}:{}", suffix("value"), client(index)),
        Key::Permits(Scope::Client(index)) => format!("{}:{}", suffix("permits"), client(index)),
    }
}

/// A permit member: Lua `struct.pack('Bc0I', #random, random, permits)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Score: the acquire time, ms (the client's clock).
    pub score: Ms,
    /// The random id: 16 bytes (Redisson 4.x), 8 bytes (Redisson 3.17-3.20).
    pub random: Vec<u8>,
    /// Permits taken.
    pub permits: u32,
}

impl Member {
    /// The member's bytes: 1 length byte, the random bytes, permits as a 4-byte little-endian unsigned
    /// integer (`I` of Lua `struct` on the x86-64/arm64 Redis builds).
    pub fn bytes(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(1 + self.random.len() + 4);
        bytes.push(u8::try_from(self.random.len()).unwrap_or(u8::MAX));
        bytes.extend_from_slice(&self.random);
        bytes.extend_from_slice(&self.permits.to_le_bytes());
        bytes
    }
}

/// The config hash, field by field (Redisson writes the fields with one `HSET`/`HSETNX` each, so a hash
/// written by Redisson 3.x lacks `keepAliveTime`, and a 4.x trySetRate on it adds just that field).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Hash {
    /// `rate`.
    pub rate: Option<i64>,
    /// `interval`, ms.
    pub interval_ms: Option<Ms>,
    /// `type`.
    pub rate_type: Option<RateType>,
    /// `keepAliveTime`, ms.
    pub keep_alive_ms: Option<Ms>,
    /// `erlRuleConfig` (gateway, not Redisson): the config a `rate_source: config` rule last wrote, as
    /// `rate:interval:type:keepAliveTime`. Redisson never writes or reads it; its `HSET`s leave it alone.
    pub rule_config: Option<(i64, Ms, RateType, Ms)>,
}

impl Hash {
    /// The config, when the three fields Redisson asserts (`rate`, `interval`, `type`) are there.
    pub fn config(&self) -> Option<RateConfig> {
        Some(RateConfig {
            rate: self.rate?,
            interval_ms: self.interval_ms?,
            rate_type: self.rate_type?,
            keep_alive_ms: self.keep_alive_ms,
        })
    }

    /// The fields, sorted by name, as `HGETALL` shows them.
    pub fn fields(&self) -> Vec<(String, String)> {
        let mut fields: Vec<(String, String)> = [
            ("interval", self.interval_ms),
            ("keepAliveTime", self.keep_alive_ms),
            ("rate", self.rate),
            ("type", self.rate_type.map(RateType::ordinal)),
        ]
        .into_iter()
        .filter_map(|(name, value)| Some((name.to_string(), value?.to_string())))
        .collect();
        if let Some((rate, interval, rate_type, keep_alive)) = self.rule_config {
            let record = format!("{rate}:{interval}:{}:{keep_alive}", rate_type.ordinal());
            fields.push(("erlRuleConfig".to_string(), record));
        }
        fields.sort();
        fields
    }

    /// The record of `config` as a rule writes it into `erlRuleConfig`.
    fn record(config: RateConfig) -> (i64, Ms, RateType, Ms) {
        (config.rate, config.interval_ms, config.rate_type, config.keep_alive())
    }

    /// `HSET` of the four fields.
    fn set(&mut self, config: RateConfig) {
        *self = Hash {
            rate: Some(config.rate),
            interval_ms: Some(config.interval_ms),
            rate_type: Some(config.rate_type),
            keep_alive_ms: config.keep_alive_ms.or(self.keep_alive_ms),
            rule_config: self.rule_config,
        };
    }

    /// `HSETNX` of each field of `config` (in Redisson's order: rate, interval, keepAliveTime, type);
    /// returns whether `type` was set, which is what Redisson's trySetRate answers.
    fn set_missing(&mut self, config: RateConfig) -> bool {
        self.rate = self.rate.or(Some(config.rate));
        self.interval_ms = self.interval_ms.or(Some(config.interval_ms));
        self.keep_alive_ms = self.keep_alive_ms.or(config.keep_alive_ms);
        let created = self.rate_type.is_none();
        self.rate_type = self.rate_type.or(Some(config.rate_type));
        created
    }
}

/// A key's content and its expiry time on the model's clock (`None` = no TTL).
#[derive(Debug, Clone)]
struct Entry<T> {
    data: T,
    expires_at: Option<Ms>,
}

impl<T> Entry<T> {
    fn persistent(data: T) -> Self {
        Entry { data, expires_at: None }
    }
}

/// Why Redisson's tryAcquire / availablePermits raise an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimiterError {
    /// `RateLimiter is not initialized`: no config hash.
    NotInitialized,
    /// `Requested permits amount cannot exceed defined rate`.
    ExceedsRate,
}

/// What Redisson's tryAcquire answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcquireResult {
    /// Acquired (Redisson answers nil); `remaining` = the value key after `DECRBY`.
    Acquired {
        /// Permits left in the window.
        remaining: i64,
    },
    /// Not enough permits: Redisson's delay, `3 + interval - (now - score of the oldest member)`, ms.
    Rejected {
        /// Delay, ms.
        delay_ms: i64,
    },
    /// Redisson raises an error (Lua `assert`), having written nothing.
    Error(LimiterError),
}

/// The gateway's acquire reply (what ACQUIRE answers; see [`Limiter::gateway_acquire`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GatewayReply {
    /// A bare integer, the config in Redis being the one sent: the permits left (acquired) or minus the
    /// delay (rejected).
    Integer(i64),
    /// `{code, amount, available, rate, interval, type, change}`.
    Array(Vec<i64>),
}

/// The limiter's keys in Redis, with TTLs.
#[derive(Debug, Clone)]
pub struct Limiter {
    clock_ms: Ms,
    hash: Option<Entry<Hash>>,
    values: BTreeMap<Scope, Entry<i64>>,
    permits: BTreeMap<Scope, Entry<Vec<Member>>>,
}

impl Limiter {
    /// No keys; the TTL clock at `clock_ms`.
    pub fn new(clock_ms: Ms) -> Self {
        Limiter { clock_ms, hash: None, values: BTreeMap::new(), permits: BTreeMap::new() }
    }

    /// The TTL clock.
    pub fn clock_ms(&self) -> Ms {
        self.clock_ms
    }

    /// Lets `elapsed_ms` pass: as in Redis, every key whose TTL is <= `elapsed_ms` is gone.
    pub fn advance(&mut self, elapsed_ms: Ms) {
        self.clock_ms += elapsed_ms;
        self.expire_keys_expiring_within(0);
    }

    /// Removes every key with a TTL below `margin_ms` (0: the keys already expired). The harness uses a
    /// margin so that a key never sits in real Redis with a TTL so short that it could run out in real time
    /// before the model says so.
    pub fn expire_keys_expiring_within(&mut self, margin_ms: Ms) {
        let limit = self.clock_ms + margin_ms;
        let alive = |expires_at: Option<Ms>| expires_at.is_none_or(|at| at > limit);
        if self.hash.as_ref().is_some_and(|entry| !alive(entry.expires_at)) {
            self.hash = None;
        }
        self.values.retain(|_, entry| alive(entry.expires_at));
        self.permits.retain(|_, entry| alive(entry.expires_at));
    }

    /// The config hash, if the key exists.
    pub fn hash(&self) -> Option<Hash> {
        self.hash.as_ref().map(|entry| entry.data)
    }

    /// The config, if the limiter is initialized (Redisson: `rate`, `interval` and `type` are there).
    pub fn config(&self) -> Option<RateConfig> {
        self.hash().and_then(|hash| hash.config())
    }

    /// `GET` of a value key.
    pub fn value(&self, scope: Scope) -> Option<i64> {
        self.values.get(&scope).map(|entry| entry.data)
    }

    /// `ZRANGE key 0 -1`: the members of a permits key in Redis order (empty when the key does not exist).
    pub fn members(&self, scope: Scope) -> &[Member] {
        self.permits.get(&scope).map_or(&[], |entry| entry.data.as_slice())
    }

    /// `PTTL` of a key: `-2` no such key, `-1` no TTL, else ms left.
    pub fn pttl(&self, key: Key) -> Ms {
        let expires_at = match key {
            Key::Config => self.hash.as_ref().map(|e| e.expires_at),
            Key::Value(scope) => self.values.get(&scope).map(|e| e.expires_at),
            Key::Permits(scope) => self.permits.get(&scope).map(|e| e.expires_at),
        };
        match expires_at {
            None => -2,
            Some(None) => -1,
            Some(Some(at)) => at - self.clock_ms,
        }
    }

    // ---- Redis commands on the limiter's keys -------------------------------------------------------

    /// `DEL`: whether the key existed.
    fn del(&mut self, key: Key) -> bool {
        match key {
            Key::Config => self.hash.take().is_some(),
            Key::Value(scope) => self.values.remove(&scope).is_some(),
            Key::Permits(scope) => self.permits.remove(&scope).is_some(),
        }
    }

    /// `PEXPIRE key ttl_ms` (a missing key is left missing; a TTL <= 0 deletes the key, as in Redis).
    fn pexpire(&mut self, key: Key, ttl_ms: Ms) {
        if ttl_ms <= 0 {
            self.del(key);
            return;
        }
        let at = Some(self.clock_ms + ttl_ms);
        match key {
            Key::Config => self.hash.iter_mut().for_each(|e| e.expires_at = at),
            Key::Value(scope) => self.values.get_mut(&scope).into_iter().for_each(|e| e.expires_at = at),
            Key::Permits(scope) => self.permits.get_mut(&scope).into_iter().for_each(|e| e.expires_at = at),
        }
    }

    /// `PERSIST`: the key, if any, loses its TTL.
    fn persist(&mut self, key: Key) {
        match key {
            Key::Config => self.hash.iter_mut().for_each(|e| e.expires_at = None),
            Key::Value(scope) => self.values.get_mut(&scope).into_iter().for_each(|e| e.expires_at = None),
            Key::Permits(scope) => self.permits.get_mut(&scope).into_iter().for_each(|e| e.expires_at = None),
        }
    }

    /// The hash, created empty (no TTL) if missing: `HSET`/`HSETNX` keep an existing hash's TTL.
    fn hash_mut(&mut self) -> &mut Hash {
        &mut self.hash.get_or_insert_with(|| Entry::persistent(Hash::default())).data
    }

    /// `SET value n`: drops the TTL.
    fn set_value(&mut self, scope: Scope, value: i64) {
        self.values.insert(scope, Entry::persistent(value));
    }

    /// `DECRBY value n`: keeps the TTL. Returns the new value.
    fn decrby(&mut self, scope: Scope, by: i64) -> i64 {
        let entry = self.values.entry(scope).or_insert_with(|| Entry::persistent(0));
        entry.data -= by;
        entry.data
    }

    /// `SET value n KEEPTTL`: the value key keeps its TTL (a missing key is created without one).
    fn set_value_keep_ttl(&mut self, scope: Scope, value: i64) {
        self.values.entry(scope).or_insert_with(|| Entry::persistent(0)).data = value;
    }

    /// `ZREM permits member`: the member with these bytes goes (the key disappears with its last member).
    fn zrem(&mut self, scope: Scope, bytes: &[u8]) {
        if let Some(entry) = self.permits.get_mut(&scope) {
            entry.data.retain(|m| m.bytes() != bytes);
            if entry.data.is_empty() {
                self.permits.remove(&scope);
            }
        }
    }

    /// `ZADD permits score member`: a member with the same bytes only moves; keeps the TTL.
    pub fn zadd(&mut self, scope: Scope, member: Member) {
        let entry = self.permits.entry(scope).or_insert_with(|| Entry::persistent(Vec::new()));
        let bytes = member.bytes();
        entry.data.retain(|m| m.bytes() != bytes);
        entry.data.push(member);
        entry.data.sort_by(|a, b| a.score.cmp(&b.score).then_with(|| a.bytes().cmp(&b.bytes())));
    }

    /// `ZRANGEBYSCORE permits 0 max` then summing the permits: Redisson's "released".
    fn permits_scored_up_to(&self, scope: Scope, max: Ms) -> i64 {
        self.members(scope).iter().filter(|m| (0..=max).contains(&m.score)).map(|m| i64::from(m.permits)).sum()
    }

    /// `ZREMRANGEBYSCORE permits 0 max` (the key disappears with its last member).
    fn zrem_scored_up_to(&mut self, scope: Scope, max: Ms) {
        if let Some(entry) = self.permits.get_mut(&scope) {
            entry.data.retain(|m| !(0..=max).contains(&m.score));
            if entry.data.is_empty() {
                self.permits.remove(&scope);
            }
        }
    }

    /// Sum of the permits of every member (Redisson 4.x: `zrange 0 -1` and `struct.unpack` each).
    fn permits_in_set(&self, scope: Scope) -> i64 {
        self.members(scope).iter().map(|m| i64::from(m.permits)).sum()
    }

    // ---- Redisson operations ------------------------------------------------------------------------

    /// The value and permits scope of a limiter type for `client` (Redisson: `KEYS[2]`/`KEYS[4]`, or
    /// `KEYS[3]`/`KEYS[5]` when `type == '1'`).
    fn scope_of(rate_type: RateType, client: usize) -> Scope {
        match rate_type {
            RateType::Overall => Scope::Overall,
            RateType::PerClient => Scope::Client(client),
        }
    }

    /// The tail of every Redisson 4.x write script: with keepAliveTime > 0, `PEXPIRE` the hash, the value
    /// and the permits key with it; otherwise copy the hash's TTL, if any, onto the value and permits keys.
    fn keep_alive(&mut self, scope: Scope) {
        let keep_alive = self.config().map_or(0, |c| c.keep_alive());
        if keep_alive > 0 {
            self.pexpire(Key::Config, keep_alive);
            self.pexpire(Key::Value(scope), keep_alive);
            self.pexpire(Key::Permits(scope), keep_alive);
        } else {
            let ttl = self.pttl(Key::Config);
            if ttl > 0 {
                self.pexpire(Key::Value(scope), ttl);
                self.pexpire(Key::Permits(scope), ttl);
            }
        }
    }

    /// Gateway behaviour: value and permits keys take the hash's TTL, or none (`syncTtl` in the scripts).
    fn sync_ttl(&mut self, scope: Scope) {
        let ttl = self.pttl(Key::Config);
        for key in [Key::Value(scope), Key::Permits(scope)] {
            if ttl > 0 {
                self.pexpire(key, ttl);
            } else {
                self.persist(key);
            }
        }
    }

    /// Redisson 4.x `trySetRate(type, rate, interval, keepAlive)`: `HSETNX` of each of the four fields (an
    /// existing field is never overwritten: on a Redisson 3.x hash only `keepAliveTime` is added); returns
    /// whether `type` was set, and then, if keepAlive > 0, `PEXPIRE`s the hash.
    ///
    /// Gateway behaviour (deliberate, documented on the scripts' `trySetRate`): when it creates the limiter,
    /// the value and permits keys of `client`'s view (overall and this client's) are deleted, so a limiter
    /// re-created after its hash expired starts full instead of inheriting a stale window.
    pub fn try_set_rate(&mut self, config: RateConfig, client: usize) -> bool {
        let created = self.redisson_try_set_rate(config);
        if created {
            for scope in [Scope::Overall, Scope::Client(client)] {
                self.del(Key::Value(scope));
                self.del(Key::Permits(scope));
            }
        }
        created
    }

    /// Redisson's own trySetRate (see [`Limiter::try_set_rate`]), without the gateway's clean-up.
    fn redisson_try_set_rate(&mut self, config: RateConfig) -> bool {
        let created = self.hash_mut().set_missing(config);
        if created && config.keep_alive() > 0 {
            self.pexpire(Key::Config, config.keep_alive());
        }
        created
    }

    /// Redisson 3.x `trySetRate(type, rate, interval)`: `HSETNX` of `rate`, `interval` and `type` only (no
    /// `keepAliveTime` field, no TTL, nothing deleted), as limiters created by older Java services look.
    pub fn try_set_rate_v3(&mut self, config: RateConfig) -> bool {
        self.redisson_try_set_rate(RateConfig { keep_alive_ms: None, ..config })
    }

    /// setRate (a full reset): `HSET` of the four fields, `PEXPIRE` of the hash if keepAlive > 0, and the
    /// value and permits keys deleted.
    ///
    /// Gateway behaviour (deliberate, documented on `SET_RATE`): deletes the overall keys AND `client`'s
    /// keys, whatever the type (Redisson 4.x `setRate` deletes only the keys of the new type, which can
    /// leave a stale window behind when the type changes); with keepAlive 0 the hash loses any earlier TTL
    /// (`PERSIST`; Redisson leaves it, so a limiter set without keep-alive may still expire).
    pub fn set_rate(&mut self, config: RateConfig, client: usize) {
        self.hash_mut().set(config);
        self.keep_alive_or_persist(config.keep_alive());
        for scope in [Scope::Overall, Scope::Client(client)] {
            self.del(Key::Value(scope));
            self.del(Key::Permits(scope));
        }
    }

    /// `PEXPIRE` of the hash with `keep_alive`, or, when it is 0, `PERSIST` (gateway behaviour, see
    /// [`Limiter::set_rate`]).
    fn keep_alive_or_persist(&mut self, keep_alive: Ms) {
        if keep_alive > 0 {
            self.pexpire(Key::Config, keep_alive);
        } else {
            self.persist(Key::Config);
        }
    }

    /// Redisson 4.4+ `updateRate` (`setOrUpdateAsync` with keepState and requireExist): returns false
    /// (writing nothing) if the limiter does not exist (no hash; the gateway's script also answers false
    /// for a hash without `rate`, `interval` or `type`, which no Redisson version writes). Otherwise `HSET`
    /// of the four fields and `PEXPIRE` of the hash if keepAlive > 0; if the type changed, every value and
    /// permits key of `client`'s view is deleted; else the members outside the new window (score <= now -
    /// interval) are dropped, and the value key is `SET` to max(0, rate - permits still in the window),
    /// created if it was missing (Redisson's script `SET`s it unconditionally; DESIGN.md: "value =
    /// max(0, rate - sum of remaining permits)"; the gateway's script, as of this writing, skips the `SET`
    /// when the value key is missing, which the property tests report). Then the keep-alive tail.
    ///
    /// Gateway behaviour (deliberate, documented on the scripts' `updateRate`): with keepAlive 0 the hash is
    /// `PERSIST`ed, and the value and permits keys take the hash's TTL or none ([`Limiter::sync_ttl`]),
    /// where Redisson's tail would copy a hash TTL and otherwise leave them as they are. With keepAlive > 0
    /// both give every key the keepAlive.
    pub fn update_rate(&mut self, config: RateConfig, now_ms: Ms, client: usize) -> bool {
        let Some(old) = self.config() else {
            return false;
        };
        self.hash_mut().set(config);
        let scope = Self::scope_of(config.rate_type, client);
        if old.rate_type != config.rate_type {
            for scope in [Scope::Overall, Scope::Client(client)] {
                self.del(Key::Value(scope));
                self.del(Key::Permits(scope));
            }
        } else {
            self.zrem_scored_up_to(scope, now_ms - config.interval_ms);
            let used = self.permits_in_set(scope);
            self.set_value(scope, (config.rate - used).max(0));
        }
        self.keep_alive_or_persist(config.keep_alive());
        self.sync_ttl(scope);
        true
    }

    /// Redisson 4.x `availablePermits()` at `now_ms`: a missing value key is `SET` to the rate; otherwise
    /// the members that left the window (score <= now - interval) are removed and their permits added to
    /// the value (no cap at the rate, unlike tryAcquire). No keep-alive tail.
    ///
    /// Gateway behaviour (deliberate, documented on `AVAILABLE_PERMITS`): after each `SET` the value and
    /// permits keys take the hash's TTL, or none ([`Limiter::sync_ttl`]); Redisson's `SET` just drops the
    /// value key's TTL, which lets it outlive an expiring limiter.
    ///
    /// # Errors
    /// [`LimiterError::NotInitialized`] when there is no config hash.
    pub fn available_permits(&mut self, now_ms: Ms, client: usize) -> Result<i64, LimiterError> {
        let config = self.config().ok_or(LimiterError::NotInitialized)?;
        let scope = Self::scope_of(config.rate_type, client);
        let Some(value) = self.value(scope) else {
            self.set_value(scope, config.rate);
            self.sync_ttl(scope);
            return Ok(config.rate);
        };
        let released = self.permits_scored_up_to(scope, now_ms - config.interval_ms);
        if released > 0 {
            self.zrem_scored_up_to(scope, now_ms - config.interval_ms);
            self.set_value(scope, value + released);
            self.sync_ttl(scope);
            return Ok(value + released);
        }
        Ok(value)
    }

    /// Redisson 4.x `tryAcquire(permits)` at `now_ms`, the new member carrying `random`:
    /// 1. no config: error; permits > rate: error (nothing written).
    /// 2. no value key: value = rate, member added, value -= permits: acquired.
    /// 3. otherwise members with score <= now - interval are released: removed, and the value becomes
    ///    value + released, or rate - (permits still in the window) if that would exceed the rate.
    /// 4. value < permits: rejected with delay `3 + interval - (now - oldest score)`; otherwise member added,
    ///    value -= permits: acquired.
    /// 5. the keep-alive tail.
    ///
    /// Gateway behaviour: when a rejection finds no member at all (the value key outlived its permits key),
    /// Redisson's script fails on `tonumber(nil)`; the gateway's script takes the oldest score as `now`, so
    /// the delay is `3 + interval`. The model follows the gateway there.
    pub fn try_acquire(&mut self, permits: i64, now_ms: Ms, random: &[u8], client: usize) -> AcquireResult {
        self.acquire_scored(permits, now_ms, random, client, false)
    }

    /// The gateway's ACQUIRE of a limiter that exists, as [`Limiter::acquire_scored`] with `in_order`.
    pub fn gateway_try_acquire(&mut self, permits: i64, now_ms: Ms, random: &[u8], client: usize) -> AcquireResult {
        self.acquire_scored(permits, now_ms, random, client, true)
    }

    /// [`Limiter::try_acquire`], with `in_order` the gateway's: an admitted member is scored
    /// `max(now, the newest member's score)` (ACQUIRE without a lease), so that calls reaching Redis out of
    /// the order of their stamps never put more than the rate in a window of scores; and members are released
    /// only [`clock_guard`] ms after the window passed them (a refusal's delay waits that much more), so that
    /// another client's call stamped up to that much earlier, reaching Redis later, still finds every member
    /// its window counts. Redisson scores at `now` and releases at once.
    fn acquire_scored(
        &mut self,
        permits: i64,
        now_ms: Ms,
        random: &[u8],
        client: usize,
        in_order: bool,
    ) -> AcquireResult {
        let Some(config) = self.config() else {
            return AcquireResult::Error(LimiterError::NotInitialized);
        };
        if permits > config.rate {
            return AcquireResult::Error(LimiterError::ExceedsRate);
        }
        let scope = Self::scope_of(config.rate_type, client);
        let newest = self.members(scope).last().map_or(now_ms, |m| m.score);
        let score = if in_order { now_ms.max(newest) } else { now_ms };
        let member = Member { score, random: random.to_vec(), permits: u32::try_from(permits).unwrap_or(0) };
        let result = match self.value(scope) {
            None => {
                self.set_value(scope, config.rate);
                self.zadd(scope, member);
                AcquireResult::Acquired { remaining: self.decrby(scope, permits) }
            }
            Some(mut value) => {
                let guard = if in_order { clock_guard(config.interval_ms) } else { 0 };
                let window_start = now_ms - config.interval_ms - guard;
                let released = self.permits_scored_up_to(scope, window_start);
                if released > 0 {
                    self.zrem_scored_up_to(scope, window_start);
                    value = if value + released > config.rate {
                        config.rate - self.permits_in_set(scope)
                    } else {
                        value + released
                    };
                    self.set_value(scope, value);
                }
                if value < permits {
                    let oldest = self.members(scope).first().map_or(now_ms, |m| m.score);
                    AcquireResult::Rejected { delay_ms: 3 + config.interval_ms + guard - (now_ms - oldest) }
                } else {
                    self.zadd(scope, member);
                    AcquireResult::Acquired { remaining: self.decrby(scope, permits) }
                }
            }
        };
        self.keep_alive(scope);
        result
    }

    /// Redisson `delete()`: `DEL` of the hash and of the value and permits keys, overall and `client`'s.
    /// Returns how many keys existed.
    pub fn delete(&mut self, client: usize) -> i64 {
        let keys = [
            Key::Config,
            Key::Value(Scope::Overall),
            Key::Value(Scope::Client(client)),
            Key::Permits(Scope::Overall),
            Key::Permits(Scope::Client(client)),
        ];
        keys.into_iter().map(|key| i64::from(self.del(key))).sum()
    }

    /// The gateway's acquire (the ACQUIRE script; gateway behaviour, not a Redisson operation): Redisson's
    /// tryAcquire preceded by trySetRate when the limiter does not exist (instead of failing with "not
    /// initialized") and, when `apply_config` is set and the hash holds another config, by updateRate.
    /// keepAliveTime counts as `0` when the hash has no such field.
    ///
    /// Replies, when the call wrote no config and Redis holds the rate, interval and type sent: the permits
    /// left (acquired) or minus Redisson's delay (rejected); otherwise `{code, amount, available, rate, interval, type, change}`: code 1 acquired
    /// (`amount` = permits left = available), 0 rejected (`amount` = the delay), 2 more permits than the
    /// rate (Redisson raises an error; the gateway answers, after creating or updating the limiter as
    /// asked, without consuming anything or refreshing TTLs, with amount and available 0); rate, interval,
    /// type: the config after the call; `change` 0 none, 1 created, 2 updated, 3 kept.
    ///
    /// With `apply_config` (`rate_source: config`) the hash field `erlRuleConfig` records what the rule
    /// wrote (on creation and on update); a differing config is updated only when it has no record or
    /// still equals its record (nobody else changed it since the rule wrote it), else it is kept.
    pub fn gateway_acquire(
        &mut self,
        permits: i64,
        now_ms: Ms,
        random: &[u8],
        config: RateConfig,
        apply_config: bool,
        client: usize,
    ) -> GatewayReply {
        let change = match self.config() {
            None => {
                let created = self.try_set_rate(config, client);
                if created && apply_config {
                    self.hash_mut().rule_config = Some(Hash::record(config));
                }
                i64::from(created)
            }
            Some(held) if apply_config && !Self::same_config(held, config) => {
                let record = self.hash().and_then(|hash| hash.rule_config);
                if record.is_none() || record == Some(Hash::record(held)) {
                    self.update_rate(config, now_ms, client);
                    self.hash_mut().rule_config = Some(Hash::record(config));
                    2
                } else {
                    3
                }
            }
            Some(_) => 0,
        };
        let Some(held) = self.config() else {
            return GatewayReply::Array(vec![-1; 8]);
        };
        // The 8th integer: the permits taken (a plain acquire takes what it asked, a rejection none).
        let full = |code, amount, available| {
            GatewayReply::Array(vec![
                code,
                amount,
                available,
                held.rate,
                held.interval_ms,
                held.rate_type.ordinal(),
                change,
                if code == 1 { permits } else { 0 },
            ])
        };
        let as_sent = change == 0
            && held.rate == config.rate
            && held.interval_ms == config.interval_ms
            && held.rate_type == config.rate_type;
        let scope = Self::scope_of(held.rate_type, client);
        match self.acquire_scored(permits, now_ms, random, client, true) {
            AcquireResult::Acquired { remaining } if as_sent => GatewayReply::Integer(remaining),
            AcquireResult::Acquired { remaining } => full(1, remaining, remaining),
            AcquireResult::Rejected { delay_ms } if as_sent => GatewayReply::Integer(-delay_ms),
            AcquireResult::Rejected { delay_ms } => full(0, delay_ms, self.value(scope).unwrap_or(0)),
            AcquireResult::Error(LimiterError::ExceedsRate) => full(2, 0, 0),
            AcquireResult::Error(LimiterError::NotInitialized) => GatewayReply::Array(vec![-1; 8]),
        }
    }

    /// The gateway's settlement of one permit member (the GIVE_BACK script; gateway behaviour, not a
    /// Redisson operation): how a lease is settled, a rejected request's permits go back (`used` 0), and a
    /// reservation of `granted` permits becomes its real cost `used` ("reserve, then settle", issue 24).
    ///
    /// Nothing happens (false) when the hash lacks `rate` or `type`, or when the member `(random, granted)`
    /// is not in `client`'s permits key of that type (released by an acquire once it left the window,
    /// expired with its key, or never there). Otherwise (true): with `used` > 0 the member `(renamed, used)`
    /// (`renamed` `None` or empty: `random`) is added with the old score minus `early_ms` (the same bytes
    /// only move), then the old member is removed if it differs, so the key never empties and keeps its TTL;
    /// with `used` 0 the old member is just removed. Then, if the value key exists and `granted != used`,
    /// it becomes value + (granted - used), `SET ... KEEPTTL`: unused permits come back, capped at the rate;
    /// an excess is charged without a floor (the value may go below zero, and Redisson's tryAcquire then
    /// rejects until enough permits leave the window). A missing value key stays missing.
    ///
    /// `known`: the rate, type and member score the acquire that wrote the member used, as a gateway on its
    /// own clock sends them (GIVE_BACK's `ARGV[6..=8]`): the hash is not read (a per-client member left by
    /// another client's `delete`, which removes only that client's keys, is settled all the same), and the
    /// member that stays is added at `score - early_ms` only if it is not there yet (`ZADD NX`; the same
    /// bytes as the old member: the score is read, as without `known`).
    #[allow(clippy::too_many_arguments)] // GIVE_BACK's ARGV, one by one
    pub fn give_back(
        &mut self,
        random: &[u8],
        granted: i64,
        used: i64,
        early_ms: Ms,
        renamed: Option<&[u8]>,
        client: usize,
        known: Option<(i64, RateType, Ms)>,
    ) -> bool {
        let (rate, rate_type) = match known {
            Some((rate, rate_type, _)) => (rate, rate_type),
            None => {
                let Some(hash) = self.hash() else { return false };
                let (Some(rate), Some(rate_type)) = (hash.rate, hash.rate_type) else { return false };
                (rate, rate_type)
            }
        };
        let scope = Self::scope_of(rate_type, client);
        let permits = |n: i64| u32::try_from(n).unwrap_or(u32::MAX);
        let old = Member { score: 0, random: random.to_vec(), permits: permits(granted) }.bytes();
        let found = self.members(scope).iter().find(|m| m.bytes() == old).map(|m| m.score);
        if used > 0 {
            let kept = renamed.filter(|bytes| !bytes.is_empty()).unwrap_or(random);
            let settled = Member { score: 0, random: kept.to_vec(), permits: permits(used) };
            let same = settled.bytes() == old;
            match (known, found) {
                (_, None) => return false,
                (Some((_, _, score)), Some(_)) if !same => {
                    if !self.members(scope).iter().any(|m| m.bytes() == settled.bytes()) {
                        self.zadd(scope, Member { score: score - early_ms, ..settled });
                    }
                    self.zrem(scope, &old);
                }
                (_, Some(score)) => {
                    self.zadd(scope, Member { score: score - early_ms, ..settled });
                    if !same {
                        self.zrem(scope, &old);
                    }
                }
            }
        } else if found.is_some() {
            self.zrem(scope, &old);
        } else {
            return false;
        }
        let unused = granted - used;
        if let Some(value) = self.value(scope).filter(|_| unused != 0) {
            let value = if unused > 0 { (value + unused).min(rate) } else { value + unused };
            self.set_value_keep_ttl(scope, value);
        }
        true
    }

    /// Whether the hash holds `wanted` (a missing keepAliveTime field equals `0`).
    fn same_config(held: RateConfig, wanted: RateConfig) -> bool {
        held.rate == wanted.rate
            && held.interval_ms == wanted.interval_ms
            && held.rate_type == wanted.rate_type
            && held.keep_alive() == wanted.keep_alive()
    }
}

#[cfg(test)]
mod tests {
    //! The model against Redisson's documented examples (the seeds), without Redis.
    #![allow(clippy::indexing_slicing)]
    use super::*;

    const T0: Ms = 1_700_000_000_000;

    fn config(rate: i64, interval_ms: Ms, keep_alive_ms: Ms) -> RateConfig {
        RateConfig { rate, interval_ms, rate_type: RateType::Overall, keep_alive_ms: Some(keep_alive_ms) }
    }

    #[test]
    fn a_window_slides_rather_than_resets() {
        // Seed 003: 3 permits per 2 s; tryAcquire(1) then tryAcquire(3) fails (1 + 3 > 3).
        let mut limiter = Limiter::new(T0);
        assert!(limiter.try_set_rate(config(3, 2000, 0), 0));
        assert!(!limiter.try_set_rate(config(5, 1000, 0), 0), "trySetRate never overwrites");
        assert_eq!(limiter.try_acquire(1, T0, &[1; 16], 0), AcquireResult::Acquired { remaining: 2 });
        assert_eq!(limiter.try_acquire(3, T0 + 1, &[2; 16], 0), AcquireResult::Rejected { delay_ms: 3 + 2000 - 1 });
        assert_eq!(limiter.try_acquire(2, T0 + 1999, &[3; 16], 0), AcquireResult::Acquired { remaining: 0 });
        // At exactly T0 + interval the first permit is released (score <= now - interval), not the others.
        assert_eq!(limiter.try_acquire(1, T0 + 2000, &[4; 16], 0), AcquireResult::Acquired { remaining: 0 });
        assert_eq!(limiter.try_acquire(4, T0 + 2000, &[5; 16], 0), AcquireResult::Error(LimiterError::ExceedsRate));
    }

    #[test]
    fn members_are_21_bytes_and_sorted_by_score_then_bytes() {
        let member = Member { score: T0, random: vec![0xAB; 16], permits: 258 };
        let bytes = member.bytes();
        assert_eq!(bytes.len(), 21);
        assert_eq!((bytes[0], &bytes[17..]), (16, &[2u8, 1, 0, 0][..]));
        assert_eq!(Member { random: vec![1; 8], ..member.clone() }.bytes().len(), 13);
        let mut limiter = Limiter::new(T0);
        limiter.zadd(Scope::Overall, Member { score: 5, random: vec![9], permits: 1 });
        limiter.zadd(Scope::Overall, Member { score: 5, random: vec![1], permits: 1 });
        limiter.zadd(Scope::Overall, Member { score: 9, random: vec![9], permits: 1 });
        let order: Vec<_> = limiter.members(Scope::Overall).iter().map(|m| (m.score, m.random[0])).collect();
        assert_eq!(order, [(5, 1), (9, 9)], "the same bytes only move");
    }

    #[test]
    fn keep_alive_expires_every_key_and_set_drops_a_ttl() {
        let mut limiter = Limiter::new(T0);
        limiter.gateway_acquire(1, T0, &[1; 16], config(2, 1000, 1500), false, 0);
        for key in [Key::Config, Key::Value(Scope::Overall), Key::Permits(Scope::Overall)] {
            assert_eq!(limiter.pttl(key), 1500, "{key:?}");
        }
        // availablePermits SETs the value after a release; the gateway gives it the hash's TTL back (Redisson
        // would leave it without one, outliving the limiter).
        limiter.advance(1000);
        assert_eq!(limiter.available_permits(T0 + 1000, 0), Ok(2));
        assert_eq!(limiter.pttl(Key::Value(Scope::Overall)), 500);
        assert_eq!(limiter.pttl(Key::Permits(Scope::Overall)), -2, "the last member left with its key");
        limiter.advance(500);
        assert_eq!((limiter.config(), limiter.value(Scope::Overall)), (None, None));
        // A SET alone drops the TTL, as in Redis.
        limiter.set_value(Scope::Overall, 1);
        assert_eq!(limiter.pttl(Key::Value(Scope::Overall)), -1);
    }

    #[test]
    fn a_settlement_returns_or_charges_the_difference_and_keeps_the_sum() {
        let (reserved, settled) = (b"-rAAAAAAAAAAAAAA", b"-sAAAAAAAAAAAAAA");
        let mut limiter = Limiter::new(T0);
        limiter.try_set_rate(config(10, 1000, 0), 0);
        assert_eq!(limiter.try_acquire(6, T0, reserved, 0), AcquireResult::Acquired { remaining: 4 });
        assert!(limiter.give_back(reserved, 6, 2, 0, Some(settled), 0, None));
        assert_eq!(limiter.value(Scope::Overall), Some(8), "4 unused permits back");
        assert_eq!(limiter.members(Scope::Overall), [Member { score: T0, random: settled.to_vec(), permits: 2 }]);
        assert_eq!(limiter.try_acquire(8, T0 + 1, b"-rBBBBBBBBBBBBBB", 0), AcquireResult::Acquired { remaining: 0 });
        assert!(limiter.give_back(b"-rBBBBBBBBBBBBBB", 8, 13, 0, None, 0, None));
        assert_eq!(limiter.value(Scope::Overall), Some(-5), "5 more than reserved, charged below zero");
        assert_eq!(limiter.try_acquire(1, T0 + 2, b"x", 0), AcquireResult::Rejected { delay_ms: 3 + 1000 - 2 });
        // Both members leave at T0 + 1001: -5 + 2 + 13 = the rate.
        assert_eq!(limiter.try_acquire(1, T0 + 1001, b"y", 0), AcquireResult::Acquired { remaining: 9 });
        assert!(!limiter.give_back(settled, 2, 1, 0, None, 0, None), "released: not found");
        assert_eq!(limiter.value(Scope::Overall), Some(9));
    }

    #[test]
    fn update_rate_keeps_consumed_permits() {
        let mut limiter = Limiter::new(T0);
        assert!(!limiter.update_rate(config(5, 1000, 0), T0, 0), "missing limiter");
        limiter.try_set_rate(config(5, 1000, 0), 0);
        limiter.try_acquire(3, T0, &[1; 16], 0);
        limiter.try_acquire(1, T0 + 600, &[2; 16], 0);
        assert!(limiter.update_rate(config(2, 500, 0), T0 + 700, 0));
        assert_eq!(limiter.value(Scope::Overall), Some(1), "the 3 at T0 left the 500 ms window, 1 is used");
        assert!(limiter.update_rate(config(1, 1000, 0), T0 + 700, 0));
        assert_eq!(limiter.value(Scope::Overall), Some(0));
    }
}
