//! Reading the configuration's JSON (parsed by `serde_json` into a `Value`) field by field, so that every
//! error names its field (`rules[0].rate: must be a whole number`) and unknown fields are refused.
//!
//! This replaces serde derives wrapped in `serde_path_to_error`: the same errors, without about 75 KB of
//! generic visitor code in the module (docs/deploying.md, "Module size").

use crate::prelude::*;

use serde_json::{Map, Value};

use super::{ConfigError, Secret};

/// A length of time in milliseconds, written in the configuration either as a number of milliseconds
/// (`1500`) or as a duration string in humantime's syntax (`"1.5s"`, `"1m"`, `"1h 30m"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DurationMs(pub u64);

/// A JSON object being read field by field. [`Object::finish`] refuses the fields nobody read.
///
/// An object may be layered (Higress `_rules_`): a field is taken from the first layer that has it, and
/// errors name the field where it was written (`_rules_[0].rules[0].rate`, or `redis.timeout` for a
/// global field an override inherits).
pub(super) struct Object<'a> {
    /// The layers, first wins: each map and its path (`""` for the top level, `redis`, `rules[0]`).
    layers: Vec<(&'a Map<String, Value>, String)>,
    /// Path of the layer the last field came from (for errors about it).
    current: usize,
    read: Vec<&'a str>,
    /// Fields that are not configuration fields (`_rules_`, `_match_route_`...).
    ignored: &'static [&'static str],
}

impl<'a> Object<'a> {
    /// `value` as an object at `path`.
    pub(super) fn new(value: &'a Value, path: &str) -> Result<Self, ConfigError> {
        match value {
            Value::Object(map) => Ok(Self::layered(vec![(map, path.to_string())], &[])),
            _ => Err(ConfigError::new(path, "must be a JSON object")),
        }
    }

    /// Layers of one object, first wins; `ignored` fields are neither read nor refused.
    pub(super) fn layered(layers: Vec<(&'a Map<String, Value>, String)>, ignored: &'static [&'static str]) -> Self {
        Object { layers, current: 0, read: Vec::new(), ignored }
    }

    /// Its own path (of the layer it was last read from): `redis`, `_rules_[0].redis`.
    pub(super) fn path(&self) -> String {
        self.layers.get(self.current).map(|(_, path)| path.clone()).unwrap_or_default()
    }

    /// The path of one of its fields (in the layer it was last read from).
    pub(super) fn path_of(&self, name: &str) -> String {
        match self.layers.get(self.current).map(|(_, path)| path.as_str()) {
            None | Some("") => name.to_string(),
            Some(path) => format!("{path}.{name}"),
        }
    }

    /// An error about one of its fields.
    pub(super) fn error(&self, name: &str, reason: impl Into<String>) -> ConfigError {
        ConfigError::new(self.path_of(name), reason)
    }

    /// The raw value of a field (marked as read); `None` when absent. JSON `null` counts as absent.
    pub(super) fn get(&mut self, name: &'static str) -> Option<&'a Value> {
        let (layer, (key, value)) =
            self.layers.iter().enumerate().find_map(|(i, (map, _))| map.get_key_value(name).map(|kv| (i, kv)))?;
        self.current = layer;
        self.read.push(key.as_str());
        (!value.is_null()).then_some(value)
    }

    /// A required field, read with one of the readers below: `object.required("rate", Object::u64)`.
    pub(super) fn required<T>(
        &mut self,
        name: &'static str,
        read: impl FnOnce(&mut Self, &'static str) -> Result<Option<T>, ConfigError>,
    ) -> Result<T, ConfigError> {
        read(self, name)?.ok_or_else(|| self.error(name, "is required"))
    }

    /// A non-negative whole number.
    pub(super) fn u64(&mut self, name: &'static str) -> Result<Option<u64>, ConfigError> {
        match self.get(name) {
            None => Ok(None),
            Some(value) => value.as_u64().map(Some).ok_or_else(|| self.error(name, "must be a whole number >= 0")),
        }
    }

    /// A whole number within the range of `T`.
    pub(super) fn number<T: TryFrom<u64>>(&mut self, name: &'static str) -> Result<Option<T>, ConfigError> {
        match self.u64(name)? {
            None => Ok(None),
            Some(n) => T::try_from(n).map(Some).map_err(|_| self.error(name, format!("{n} is too large"))),
        }
    }

    /// A string.
    /// A boolean field.
    pub(super) fn boolean(&mut self, name: &'static str) -> Result<Option<bool>, ConfigError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(value)) => Ok(Some(*value)),
            Some(_) => Err(self.error(name, "must be true or false")),
        }
    }

    pub(super) fn string(&mut self, name: &'static str) -> Result<Option<String>, ConfigError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(text)) => Ok(Some(text.clone())),
            Some(_) => Err(self.error(name, "must be a string")),
        }
    }

    /// A secret string: any other value is refused without echoing it.
    pub(super) fn secret(&mut self, name: &'static str) -> Result<Option<Secret>, ConfigError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(text)) => Ok(Some(Secret::new(text.clone()))),
            Some(_) => Err(self.error(name, "must be a string (the value is not shown: it is a secret)")),
        }
    }

    /// A duration: whole milliseconds, or a humantime string of whole milliseconds.
    pub(super) fn duration(&mut self, name: &'static str) -> Result<Option<DurationMs>, ConfigError> {
        let Some(value) = self.get(name) else { return Ok(None) };
        if let Some(ms) = value.as_u64() {
            return Ok(Some(DurationMs(ms)));
        }
        let Value::String(text) = value else {
            return Err(self.error(name, "expected milliseconds (a non-negative integer) or a duration such as \"1s\""));
        };
        let ms = super::duration::parse_ms(text).map_err(|why| self.error(name, why))?;
        Ok(Some(DurationMs(ms)))
    }

    /// One of the named values (`"allow"`, `"deny"`...).
    pub(super) fn choice<T: Copy>(
        &mut self,
        name: &'static str,
        choices: &[(&str, T)],
    ) -> Result<Option<T>, ConfigError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(text)) => {
                choices.iter().find(|(written, _)| written == text).map(|(_, choice)| Some(*choice)).ok_or_else(|| {
                    let text = crate::quote::escaped(text);
                    self.error(name, format!("unknown variant `{text}`, expected {}", one_of(choices)))
                })
            }
            Some(_) => Err(self.error(name, format!("must be a string: {}", one_of(choices)))),
        }
    }

    /// A nested object.
    pub(super) fn object(&mut self, name: &'static str) -> Result<Option<Object<'a>>, ConfigError> {
        let path = self.path_of(name);
        self.get(name).map(|value| Object::new(value, &path)).transpose()
    }

    /// An array, and its path for its items' errors (`rules` -> `rules[3]`).
    pub(super) fn array(&mut self, name: &'static str) -> Result<Option<(&'a [Value], String)>, ConfigError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Array(items)) => Ok(Some((items.as_slice(), self.path_of(name)))),
            Some(_) => Err(self.error(name, "must be an array")),
        }
    }

    /// Refuses the fields nobody read (a misspelt field must not be ignored silently).
    pub(super) fn finish(mut self, known: &[&str]) -> Result<(), ConfigError> {
        for layer in 0..self.layers.len() {
            let Some((map, _)) = self.layers.get(layer) else { continue };
            let unknown =
                map.keys().find(|key| !self.read.contains(&key.as_str()) && !self.ignored.contains(&key.as_str()));
            if let Some(key) = unknown {
                self.current = layer;
                // The key comes from the configuration: escaped, it cannot forge a log line.
                let key = crate::quote::escaped(key);
                return Err(self.error(&key, format!("unknown field `{key}`, expected one of {}", list(known))));
            }
        }
        Ok(())
    }
}

fn one_of<T>(choices: &[(&str, T)]) -> String {
    list(&choices.iter().map(|(written, _)| *written).collect::<Vec<_>>())
}

fn list(names: &[&str]) -> String {
    names.iter().map(|name| format!("`{name}`")).collect::<Vec<_>>().join(", ")
}
