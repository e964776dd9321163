//! A rule's `cost`: what one request takes when its cost is known only after the response (LLM tokens,
//! metered units): a reservation taken at the request, settled to the real cost when the response ends
//! (docs/configuration.md, "Costs known after the response").

use serde_json::Value;

use crate::key::KeySource;
use crate::prelude::*;
use crate::usage::UsageFormat;

use super::reader::Object;
use super::ConfigError;

const COST_FIELDS: &[&str] = &["reserve", "settle"];
const RESERVE_FIELDS: &[&str] = &["header", "property", "default"];
const SETTLE_FIELDS: &[&str] = &["usage", "response_header"];
const USAGE_FIELDS: &[&str] = &["paths"];

/// A rule's `cost`: the reservation and where the real cost is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cost {
    /// Permits taken at the request.
    pub reserve: Reserve,
    /// Where the real cost comes from when the response ends.
    pub settle: Settle,
}

/// The permits a request reserves (`cost.reserve`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reserve {
    /// A fixed number of permits (`"reserve": 4000`).
    Fixed(u64),
    /// A request header's or property's whole number (`{"header": "x-max-tokens", "default": 4000}`,
    /// `{"property": "filter_state.max_tokens", "default": 4000}`), clamped to 1..=rate; `default` when it
    /// is missing or not a number (decimal digits).
    From {
        /// Where the number is: [`KeySource::Header`] or [`KeySource::Property`].
        source: KeySource,
        /// Permits when the request gives none.
        default: u64,
    },
}

impl Reserve {
    /// The permits a request without the header (or with a fixed reserve) takes: what the rule's `permits`
    /// become (local blocks, local windows and headers count with it).
    pub fn default_permits(&self) -> u64 {
        match self {
            Reserve::Fixed(permits) | Reserve::From { default: permits, .. } => *permits,
        }
    }
}

/// Where a response's real cost is read (`cost.settle`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settle {
    /// The usage an LLM API reports in the response body, JSON or server-sent events.
    /// Which fields count: [`UsageFormat`] (`"openai"`, `"anthropic"`, `"gemini"`, `{"paths": [...]}`).
    Usage(UsageFormat),
    /// A response header's whole number (`{"response_header": "x-cost"}`), lowercase name.
    ResponseHeader(String),
}

/// Reads `cost` of a rule whose rate is `rate` (a reservation is 1..=rate permits).
pub(super) fn read_cost(mut cost: Object<'_>, rate: u64) -> Result<Cost, ConfigError> {
    let reserve = match cost.get("reserve") {
        None => return Err(cost.error("reserve", "is required")),
        Some(Value::Number(number)) => {
            let permits = number.as_u64().filter(|&p| p >= 1 && p <= rate);
            Reserve::Fixed(permits.ok_or_else(|| cost.error("reserve", format!("must be 1 to the rate ({rate})")))?)
        }
        Some(value @ Value::Object(_)) => {
            let mut reserve = Object::new(value, &cost.path_of("reserve"))?;
            let source = match (reserve.string("header")?, reserve.get("property")) {
                (Some(name), None) if !name.trim().is_empty() => KeySource::header(&name),
                (None, Some(path)) => KeySource::Property(
                    super::rules::read_property_path(path).map_err(|why| reserve.error("property", why))?,
                ),
                _ => return Err(ConfigError::new(reserve.path(), "needs either a non-empty `header` or a `property`")),
            };
            let default = reserve.required("default", Object::u64)?;
            if default == 0 || default > rate {
                return Err(reserve.error("default", format!("must be 1 to the rate ({rate})")));
            }
            reserve.finish(RESERVE_FIELDS)?;
            Reserve::From { source, default }
        }
        Some(_) => {
            return Err(cost
                .error("reserve", "must be a number of permits or {\"header\"|\"property\": ..., \"default\": ...}"))
        }
    };
    let mut settle = cost.required("settle", Object::object)?;
    let settle_path = settle.path();
    let settle = match (settle.get("usage"), settle.string("response_header")?) {
        (Some(usage), None) => {
            let spec = read_usage(usage, &settle.path_of("usage"))?;
            settle.finish(SETTLE_FIELDS)?;
            Settle::Usage(spec)
        }
        (None, Some(header)) if !header.is_empty() => {
            settle.finish(SETTLE_FIELDS)?;
            Settle::ResponseHeader(header.to_ascii_lowercase())
        }
        _ => return Err(ConfigError::new(settle_path, "needs either `usage` or a non-empty `response_header`")),
    };
    cost.finish(COST_FIELDS)?;
    Ok(Cost { reserve, settle })
}

/// `usage`: `"openai"`, `"anthropic"`, `"gemini"`, or `{"paths": ["a.b", ...]}` (1 to 8 dotted paths).
fn read_usage(value: &Value, path: &str) -> Result<UsageFormat, ConfigError> {
    match value {
        Value::String(name) => match name.as_str() {
            "openai" => Ok(UsageFormat::OpenAi),
            "anthropic" => Ok(UsageFormat::Anthropic),
            "gemini" => Ok(UsageFormat::Gemini),
            other => Err(ConfigError::new(
                path,
                format!(
                    "unknown variant `{}`, expected `openai`, `anthropic`, `gemini` or {{\"paths\": [...]}}",
                    crate::quote::escaped(other)
                ),
            )),
        },
        Value::Object(_) => {
            let mut usage = Object::new(value, path)?;
            let (items, at) = usage.required("paths", Object::array)?;
            if items.is_empty() || items.len() > 8 {
                return Err(ConfigError::new(at, "must hold 1 to 8 dotted paths"));
            }
            let mut paths = Vec::with_capacity(items.len());
            for item in items {
                let text = item.as_str().filter(|t| !t.is_empty() && t.split('.').all(|part| !part.is_empty()));
                let text = text.ok_or_else(|| {
                    ConfigError::new(&at, "each must be a dotted path such as \"usage.total_tokens\"")
                })?;
                paths.push(text.split('.').map(str::to_string).collect());
            }
            usage.finish(USAGE_FIELDS)?;
            Ok(UsageFormat::Paths(paths))
        }
        _ => Err(ConfigError::new(path, "must be `openai`, `anthropic`, `gemini` or {\"paths\": [...]}")),
    }
}
