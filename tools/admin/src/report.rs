//! What each operation of `ops` returns: plain data, serialized as is for `--json` (field names and order
//! are the JSON's) and written as text by `output`. Times are ms since the epoch, durations and TTLs ms.

use serde::Serialize;

use crate::model::{Config, Window};

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
    /// TTL of the config hash, ms (`PTTL`: `-1` no expiry).
    pub config_ttl_ms: i64,
    /// The overall window, or the selected client's (`--client-id`) of a per-client limiter.
    pub state: Option<State>,
    /// Per-client limiters: every client id with state in Redis, and each one's state.
    pub clients: Vec<State>,
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

/// What `delete` did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeleteReport {
    /// The limiter name.
    pub name: String,
    /// Keys removed (config, value and permits, and every client's).
    pub keys_removed: u64,
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
