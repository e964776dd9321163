//! Higress `matchRules`: the global configuration plus per-route and per-domain overlays, passed inside
//! the plugin configuration as `_rules_: [{"_match_route_": [...], "_match_domain_": [...], <fields>}]`
//! next to the global fields (DESIGN.md, "the Higress host Redis interface"), and the choice of one
//! configuration per request: a route match beats a domain match beats the global configuration.

use crate::prelude::*;

use super::reader::Object;
use super::{ConfigError, PluginConfig};

/// A configuration that applies to some routes or domains only (Higress `matchRules`); `C` is what the
/// filter makes of a configuration ([`Plugin::map`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Override<C = PluginConfig> {
    /// Route names (the `route_name` property; Higress: the Ingress `namespace/name`) it applies to.
    pub routes: Vec<String>,
    /// Domains (`:authority` without the port, case-insensitive; `*.example.com` matches subdomains).
    pub domains: Vec<String>,
    /// The configuration: the global fields overlaid with the rule's own.
    pub config: C,
}

/// The whole plugin configuration: a global configuration and Higress's per-route / per-domain overrides.
///
/// A rule's fields replace the global fields of the same name (a shallow overlay). With `_rules_` and no
/// global fields, requests that match no rule are not limited. `C` is what the filter makes of each
/// configuration ([`Plugin::map`]: its routes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plugin<C = PluginConfig> {
    /// The configuration of requests no override matches (`None`: they are not limited).
    pub global: Option<C>,
    /// The overrides, in configuration order.
    pub overrides: Vec<Override<C>>,
}

impl Plugin {
    /// Parses and validates the plugin configuration (JSON bytes), overrides included.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the first offending field; fields of an override are named from the top,
    /// e.g. `_rules_[1].rules[0].rate`.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ConfigError> {
        let value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| ConfigError::new("", e.to_string()))?;
        let serde_json::Value::Object(global) = &value else {
            return Err(ConfigError::new("", "the configuration must be a JSON object"));
        };
        let rules = match global.get("_rules_") {
            None => return Ok(Plugin { global: Some(PluginConfig::from_value(&value)?), overrides: Vec::new() }),
            Some(serde_json::Value::Array(rules)) => rules,
            Some(_) => return Err(ConfigError::new("_rules_", "must be an array of match rules")),
        };
        let global_config = if global.len() == 1 {
            None
        } else {
            Some(PluginConfig::read(Object::layered(vec![(global, String::new())], &["_rules_"]))?)
        };
        let mut overrides = Vec::with_capacity(rules.len());
        for (index, rule) in rules.iter().enumerate() {
            let at = format!("_rules_[{index}]");
            let serde_json::Value::Object(fields) = rule else {
                return Err(ConfigError::new(at, "must be an object"));
            };
            let routes = match_list(fields, "_match_route_", &at)?;
            let domains = match_list(fields, "_match_domain_", &at)?;
            if routes.is_empty() && domains.is_empty() {
                return Err(ConfigError::new(at, "needs `_match_route_` or `_match_domain_`"));
            }
            // The rule's fields replace the global fields of the same name (a shallow overlay).
            let layers = vec![(fields, at.clone()), (global, String::new())];
            let config = PluginConfig::read(Object::layered(layers, MATCH_FIELDS)).map_err(|e| {
                if e.field.is_empty() {
                    ConfigError { field: at.clone(), reason: e.reason }
                } else {
                    e
                }
            })?;
            overrides.push(Override { routes, domains, config });
        }
        Ok(Plugin { global: global_config, overrides })
    }
}

impl<C> Plugin<C> {
    /// Each configuration made into a `T` by `f` (given its index in [`Plugin::configs`]), with the same
    /// matching.
    pub fn map<T>(self, mut f: impl FnMut(usize, C) -> T) -> Plugin<T> {
        let global = self.global.map(|config| f(0, config));
        let overrides = self
            .overrides
            .into_iter()
            .enumerate()
            .map(|(index, o)| Override { routes: o.routes, domains: o.domains, config: f(index + 1, o.config) })
            .collect();
        Plugin { global, overrides }
    }

    /// Whether any configuration depends on the route or domain of a request.
    pub fn has_overrides(&self) -> bool {
        !self.overrides.is_empty()
    }

    /// The configuration for a request on route `route` (the `route_name` property) to `authority`, and
    /// its index in [`Plugin::configs`]; `None` when no configuration applies.
    pub fn select(&self, route: Option<&str>, authority: Option<&str>) -> Option<(usize, &C)> {
        let host = authority.map(|a| strip_port(a).to_ascii_lowercase());
        let by_route = route.and_then(|route| self.overrides.iter().position(|o| o.routes.iter().any(|r| r == route)));
        let by_domain = || {
            let host = host.as_deref()?;
            self.overrides.iter().position(|o| o.domains.iter().any(|d| domain_matches(d, host)))
        };
        match by_route.or_else(by_domain) {
            Some(index) => self.overrides.get(index).map(|o| (index + 1, &o.config)),
            None => self.global.as_ref().map(|config| (0, config)),
        }
    }

    /// The configuration with this index (see [`Plugin::configs`]).
    pub fn config(&self, index: usize) -> Option<&C> {
        match index {
            0 => self.global.as_ref(),
            i => self.overrides.get(i - 1).map(|o| &o.config),
        }
    }

    /// Every configuration by index: 0 the global one (if any), then the overrides in order.
    pub fn configs(&self) -> impl Iterator<Item = (usize, &C)> {
        self.global.iter().map(|c| (0, c)).chain(self.overrides.iter().enumerate().map(|(i, o)| (i + 1, &o.config)))
    }
}

/// Fields of a match rule (and of the top level) that are not configuration fields.
const MATCH_FIELDS: &[&str] = &["_match_route_", "_match_domain_", "_rules_"];

fn match_list(
    fields: &serde_json::Map<String, serde_json::Value>,
    name: &str,
    at: &str,
) -> Result<Vec<String>, ConfigError> {
    let refused = || ConfigError::new(format!("{at}.{name}"), "must be an array of non-empty strings");
    match fields.get(name) {
        None => Ok(Vec::new()),
        Some(serde_json::Value::Array(items)) => items
            .iter()
            .map(|item| match item {
                serde_json::Value::String(text) if !text.is_empty() => Ok(text.clone()),
                _ => Err(refused()),
            })
            .collect(),
        Some(_) => Err(refused()),
    }
}

/// `host:port` or `[v6]:port` without the port.
fn strip_port(authority: &str) -> &str {
    if authority.starts_with('[') {
        return authority.split_inclusive(']').next().unwrap_or(authority);
    }
    match authority.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => authority,
    }
}

/// Whether `host` (lowercase, no port) matches a `_match_domain_` entry: exact, or `*.suffix` for subdomains.
fn domain_matches(pattern: &str, host: &str) -> bool {
    let pattern = pattern.to_ascii_lowercase();
    match pattern.strip_prefix('*') {
        Some(suffix) => host.ends_with(suffix) && host.len() > suffix.len(),
        None => pattern == host,
    }
}
