//! The one error type of the tool: every failure an operator can meet, each with the message printed
//! before exiting with code 1.

use thiserror::Error;

/// What went wrong, worded for the operator (the `Display` text is what `erl-admin` prints).
#[derive(Debug, Error, PartialEq, Eq)]
pub enum AdminError {
    /// The `--url` (or `ERL_REDIS_URL`) is not a Redis URL.
    #[error("invalid Redis URL {url}: {reason}")]
    BadUrl {
        /// The URL, password hidden.
        url: String,
        /// The parser's complaint.
        reason: String,
    },
    /// Redis could not be reached (connection refused, timeout, dropped connection).
    #[error("cannot reach Redis at {url}: {reason}")]
    Unreachable {
        /// The URL, password hidden.
        url: String,
        /// The I/O error.
        reason: String,
    },
    /// Redis refused the credentials of the URL.
    #[error("Redis at {url} refused the credentials: {reason}")]
    AuthFailed {
        /// The URL, password hidden.
        url: String,
        /// Redis's answer.
        reason: String,
    },
    /// `--cluster` names a Redis without cluster support.
    #[error("Redis at {url} is not a Redis Cluster ({reason}): drop --cluster (and ERL_REDIS_CLUSTER) to use it as one Redis")]
    NotACluster {
        /// The URL, password hidden.
        url: String,
        /// The seed's answer to `CLUSTER SLOTS`.
        reason: String,
    },
    /// A plain URL (no `--cluster`) names a node of a Redis Cluster.
    #[error("Redis at {url} is a Redis Cluster node ({reason}): add --cluster (or ERL_REDIS_CLUSTER=true) to reach every master")]
    ClusterNode {
        /// The URL, password hidden.
        url: String,
        /// How it showed: `INFO` or a `MOVED` reply.
        reason: String,
    },
    /// No key named like the limiter: it was never created, was deleted, or expired (keepAliveTime).
    #[error("no limiter named {0} (no config hash)")]
    NoLimiter(String),
    /// A command that writes a config (`set-rate`, `try-set-rate`, `update-rate`) on a sliding window counter
    /// or a calendar quota, which keep no config in Redis.
    #[error("{0} is a sliding window counter or a calendar quota (a hash {{{0}}}:counter, no config hash): its rate and window are its rule's, not in Redis; change the rule in the plugin configuration")]
    CounterLimiter(String),
    /// The config hash exists but lacks a field Redisson requires (`rate`, `interval`, `type`).
    #[error("limiter {name} is not initialized (its hash has no {field} field)")]
    NotInitialized {
        /// The limiter name.
        name: String,
        /// The first missing field.
        field: &'static str,
    },
    /// The limiter name holds another type of key than a hash.
    #[error("wrong type of key: {key} is a {found}, but a limiter's config is a hash")]
    WrongType {
        /// The key.
        key: String,
        /// Its Redis type (`string`, `list`, `zset`...).
        found: String,
    },
    /// A config field holds something Redisson never writes.
    #[error("limiter {name} has an invalid {field}: {value:?}")]
    InvalidConfig {
        /// The limiter name.
        name: String,
        /// The field.
        field: &'static str,
        /// Its value, as text.
        value: String,
    },
    /// `--client-id` is not a UUID.
    #[error("invalid client id {0:?}: expected a UUID (a Redisson client instance id)")]
    BadClientId(String),
    /// A plugin configuration file (`validate`, `explain`) that cannot be read.
    #[error("cannot read the plugin configuration {path}: {reason}")]
    ConfigFile {
        /// The path given (`-`: stdin).
        path: String,
        /// The I/O error.
        reason: String,
    },
    /// `explain` with a plugin configuration the filter refuses: the refusal as the filter logs it.
    #[error("{0}")]
    InvalidPlugin(String),
    /// Arguments that parse but make no sense together.
    #[error("{0}")]
    Usage(String),
    /// Any other Redis error reply, with what the tool was doing.
    #[error("Redis error while {context}: {reason}")]
    Redis {
        /// What the tool was doing.
        context: String,
        /// Redis's answer.
        reason: String,
    },
}

/// Shorthand for results of this crate.
pub type Result<T, E = AdminError> = std::result::Result<T, E>;
