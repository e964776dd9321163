//! A rule's `cost`: what one request takes when its cost is known only after the response (LLM tokens,
//! metered units): a reservation taken at the request, settled to the real cost when the response ends
//! (docs/configuration.md, "Costs known after the response").

use serde_json::Value;

use crate::key::KeySource;
use crate::prelude::*;
use crate::usage::{UsageFormat, Weights};

use super::reader::Object;
use super::ConfigError;

const COST_FIELDS: &[&str] = &["reserve", "settle"];
const RESERVE_FIELDS: &[&str] = &["header", "property", "body", "default"];
const SETTLE_FIELDS: &[&str] = &["usage", "response_header", "include_usage", "weights"];
const WEIGHT_FIELDS: &[&str] = &["input", "cached_input", "cache_write", "output"];

/// Largest weight of a token kind (`cost.settle.weights`): a thousand permits per token.
const MAX_WEIGHT: f64 = 1000.0;
const USAGE_FIELDS: &[&str] = &["paths"];

/// A rule's `cost`: the reservation and where the real cost is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cost {
    /// Permits taken at the request.
    pub reserve: Reserve,
    /// Where the real cost comes from when the response ends.
    pub settle: Settle,
    /// `settle.include_usage` (with `"usage": "openai"`): a streamed OpenAI chat request whose body has no
    /// `stream_options` gets `"stream_options": {"include_usage": true}` added, so its stream reports the
    /// usage (OpenAI sends it only when asked; the client then also receives that last chunk).
    pub include_usage: bool,
}

/// The request-body fields that hold the output tokens a request may cost, by API, tried in order:
/// OpenAI chat completions' `max_completion_tokens` (and the older `max_tokens`), the Responses API's
/// `max_output_tokens` (<https://platform.openai.com/docs/api-reference>), Anthropic messages' `max_tokens`
/// (<https://docs.anthropic.com/en/api/messages>), Gemini's `generationConfig.maxOutputTokens`
/// (<https://ai.google.dev/api/generate-content#generationconfig>).
pub const RESERVE_BODY_FIELDS: [(&str, &[&str]); 3] = [
    ("openai", &["max_completion_tokens", "max_tokens", "max_output_tokens"]),
    ("anthropic", &["max_tokens"]),
    ("gemini", &["generationConfig.maxOutputTokens"]),
];

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
    /// Which fields count: [`UsageFormat`] (`"openai"`, `"anthropic"`, `"gemini"`, `{"paths": [...]}`);
    /// with [`Weights`] (`"weights"`, built-in formats only) each token kind at its price.
    Usage(UsageFormat, Option<Weights>),
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
            let source = match (reserve.string("header")?, reserve.get("property"), reserve.get("body")) {
                (Some(name), None, None) if !name.trim().is_empty() => KeySource::header(&name),
                (None, Some(path), None) => KeySource::Property(
                    super::rules::read_property_path(path).map_err(|why| reserve.error("property", why))?,
                ),
                (None, None, Some(body)) => {
                    KeySource::Body(read_body_fields(body).map_err(|why| reserve.error("body", why))?)
                }
                _ => {
                    return Err(ConfigError::new(
                        reserve.path(),
                        "needs exactly one of a non-empty `header`, a `property` or a `body`",
                    ))
                }
            };
            let default = reserve.required("default", Object::u64)?;
            if default == 0 || default > rate {
                return Err(reserve.error("default", format!("must be 1 to the rate ({rate})")));
            }
            reserve.finish(RESERVE_FIELDS)?;
            Reserve::From { source, default }
        }
        Some(_) => {
            return Err(cost.error(
                "reserve",
                "must be a number of permits or {\"header\"|\"property\"|\"body\": ..., \"default\": ...}",
            ))
        }
    };
    let mut settle = cost.required("settle", Object::object)?;
    let settle_path = settle.path();
    let include_usage = settle.boolean("include_usage")?.unwrap_or(false);
    let settle = match (settle.get("usage"), settle.string("response_header")?) {
        (Some(usage), None) => {
            let spec = read_usage(usage, &settle.path_of("usage"))?;
            if include_usage && spec != UsageFormat::OpenAi {
                return Err(settle.error("include_usage", "applies to `\"usage\": \"openai\"` only"));
            }
            let weights = match settle.object("weights")? {
                Some(_) if matches!(spec, UsageFormat::Paths(_)) => {
                    return Err(settle.error("weights", "apply to `openai`, `anthropic` or `gemini` usage only"))
                }
                Some(weights) => Some(read_weights(weights)?),
                None => None,
            };
            settle.finish(SETTLE_FIELDS)?;
            Settle::Usage(spec, weights)
        }
        (None, Some(header)) if !header.is_empty() => {
            if include_usage {
                return Err(settle.error("include_usage", "applies to `\"usage\": \"openai\"` only"));
            }
            if settle.get("weights").is_some() {
                return Err(settle.error("weights", "apply to `usage` only"));
            }
            settle.finish(SETTLE_FIELDS)?;
            Settle::ResponseHeader(header.to_ascii_lowercase())
        }
        _ => return Err(ConfigError::new(settle_path, "needs either `usage` or a non-empty `response_header`")),
    };
    cost.finish(COST_FIELDS)?;
    Ok(Cost { reserve, settle, include_usage })
}

/// `weights`: `{"input": 1, "cached_input": 0.1, "cache_write": 1.25, "output": 4}`, each 0 to
/// [`MAX_WEIGHT`] permits per token to a thousandth (rounded to the nearest), a kind not named at 1; at
/// least one named, and not all 0.
fn read_weights(mut weights: Object<'_>) -> Result<Weights, ConfigError> {
    let named = WEIGHT_FIELDS.iter().any(|name| weights.get(name).is_some());
    let priced = Weights {
        input: read_weight(&mut weights, "input")?,
        cached_input: read_weight(&mut weights, "cached_input")?,
        cache_write: read_weight(&mut weights, "cache_write")?,
        output: read_weight(&mut weights, "output")?,
    };
    let path = weights.path();
    weights.finish(WEIGHT_FIELDS)?;
    if !named {
        return Err(ConfigError::new(path, format!("needs at least one of {}", WEIGHT_FIELDS.join(", "))));
    }
    if priced == (Weights { input: 0, cached_input: 0, cache_write: 0, output: 0 }) {
        return Err(ConfigError::new(path, "cannot all be 0 (every response would cost nothing)"));
    }
    Ok(priced)
}

/// One weight of `weights`, in thousandths of a permit per token: 1000 when not named.
fn read_weight(weights: &mut Object<'_>, name: &'static str) -> Result<u32, ConfigError> {
    let Some(value) = weights.get(name) else { return Ok(1000) };
    match value.as_f64() {
        // Rounded to the nearest thousandth (+ 0.5, then the cast truncates: no libm on wasm32); in range,
        // so at most 1,000,000.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        Some(weight) if (0.0..=MAX_WEIGHT).contains(&weight) => Ok((weight * 1000.0 + 0.5) as u32),
        _ => Err(weights.error(name, "must be a number from 0 to 1000 (permits per token)")),
    }
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

/// `reserve.body`: an API's name (`"openai"`, `"anthropic"`, `"gemini"`: [`RESERVE_BODY_FIELDS`]) or
/// `{"paths": ["a.b", ...]}` (1 to 8 dotted paths, the first present wins).
fn read_body_fields(value: &Value) -> Result<Vec<Vec<String>>, String> {
    let dotted = |text: &str| text.split('.').map(str::to_string).collect::<Vec<_>>();
    match value {
        Value::String(name) => match RESERVE_BODY_FIELDS.iter().find(|(api, _)| api == name) {
            Some((_, fields)) => Ok(fields.iter().map(|field| dotted(field)).collect()),
            None => Err(format!(
                "unknown variant `{}`, expected `openai`, `anthropic`, `gemini` or {{\"paths\": [...]}}",
                crate::quote::escaped(name)
            )),
        },
        Value::Object(map) if map.len() == 1 && map.contains_key("paths") => {
            let items = map.get("paths").and_then(Value::as_array).filter(|items| (1..=8).contains(&items.len()));
            let items = items.ok_or("`paths` must hold 1 to 8 dotted paths")?;
            items
                .iter()
                .map(|item| match item.as_str() {
                    Some(text) if !text.is_empty() && text.split('.').all(|part| !part.is_empty()) => Ok(dotted(text)),
                    _ => Err("each path must be a dotted path such as \"max_tokens\"".to_string()),
                })
                .collect()
        }
        _ => Err("must be `openai`, `anthropic`, `gemini` or {\"paths\": [...]}".into()),
    }
}
