//! The limits file: a JSON array of limits in limitador's own fields (those of Limitador's limits file).
//!
//! ```text
//! [
//!   {"namespace": "peer-allowed", "name": "per-user", "max_value": 1000000, "seconds": 1,
//!    "variables": ["descriptors[0]['x-user-id']"]},
//!   {"namespace": "peer-saturated", "name": "global", "max_value": 1000, "seconds": 1}
//! ]
//! ```
//!
//! `namespace` is the domain Envoy's ratelimit filter sends; `max_value` hits per fixed window of `seconds`
//! (limitador's windows start at a counter's first hit and last `seconds`); `variables` are CEL expressions
//! over `descriptors` (the request's descriptors in order, each a map of its entries' keys to values), one
//! counter per distinct set of their values; a limit without variables is one counter for the namespace.
//! `conditions` are refused: limitador 0.14 unwraps a condition's evaluation (`Limit::applies`), so a
//! request whose descriptors a condition cannot evaluate would panic the service.

use std::path::Path;

use limitador::limit::{Expression, Limit};
use serde::Deserialize;

/// One limit as the file spells it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitSpec {
    namespace: String,
    #[serde(default)]
    name: Option<String>,
    max_value: u64,
    seconds: u64,
    #[serde(default)]
    conditions: Vec<String>,
    #[serde(default)]
    variables: Vec<String>,
}

/// Reads and checks the limits file. Errors name the file and the limit (by index and name) and field.
pub fn load(path: &Path) -> Result<Vec<Limit>, String> {
    let text = std::fs::read_to_string(path).map_err(|error| format!("limits file {}: {error}", path.display()))?;
    parse(&text).map_err(|error| format!("limits file {}: {error}", path.display()))
}

/// The limits of the file's text (see the module's documentation).
pub fn parse(text: &str) -> Result<Vec<Limit>, String> {
    let specs: Vec<LimitSpec> = serde_json::from_str(text).map_err(|error| error.to_string())?;
    specs
        .into_iter()
        .enumerate()
        .map(|(index, spec)| {
            let which = format!("limit {index}{}", spec.name.as_deref().map(|n| format!(" ({n})")).unwrap_or_default());
            to_limit(spec).map_err(|error| format!("{which}: {error}"))
        })
        .collect()
}

fn to_limit(spec: LimitSpec) -> Result<Limit, String> {
    if spec.namespace.is_empty() {
        return Err("namespace: empty".to_owned());
    }
    if spec.seconds == 0 {
        return Err("seconds: at least 1".to_owned());
    }
    if !spec.conditions.is_empty() {
        return Err(
            "conditions: not supported here (limitador 0.14 panics on a condition it cannot evaluate)".to_owned()
        );
    }
    let variables = spec
        .variables
        .iter()
        .map(|source| Expression::parse(source).map_err(|error| format!("variables: {source:?}: {error}")))
        .collect::<Result<Vec<_>, _>>()?;
    let mut limit = Limit::new(spec.namespace.as_str(), spec.max_value, spec.seconds, [], variables);
    if let Some(name) = spec.name {
        limit.set_name(name);
    }
    Ok(limit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_bench_limits() {
        let limits = parse(
            r#"[{"namespace": "a", "name": "per-user", "max_value": 5, "seconds": 2,
                 "variables": ["descriptors[0]['x-user-id']"]},
                {"namespace": "b", "max_value": 1000, "seconds": 1}]"#,
        );
        let limits = limits.as_deref().unwrap_or_default();
        assert_eq!(limits.len(), 2);
        let names: Vec<_> =
            limits.iter().map(|l| (l.namespace().as_ref(), l.name(), l.max_value(), l.seconds())).collect();
        assert!(names.contains(&("a", Some("per-user"), 5, 2)));
        assert!(names.contains(&("b", None, 1000, 1)));
    }

    #[test]
    fn refusals_name_the_limit_and_field() {
        let refused = |text: &str| parse(text).err().unwrap_or_default();
        assert!(refused(r#"[{"namespace": "a", "max_value": 1}]"#).contains("seconds"));
        assert!(refused(r#"[{"namespace": "a", "max_value": 1, "seconds": 0}]"#).starts_with("limit 0: seconds"));
        assert!(refused(r#"[{"namespace": "", "max_value": 1, "seconds": 1}]"#).contains("namespace"));
        assert!(refused(r#"[{"namespace": "a", "max_value": 1, "seconds": 1, "bogus": 1}]"#).contains("bogus"));
        assert!(refused(
            r#"[{"namespace": "a", "name": "n", "max_value": 1, "seconds": 1, "conditions": ["x == '1'"]}]"#
        )
        .starts_with("limit 0 (n): conditions"));
        assert!(refused(r#"[{"namespace": "a", "max_value": 1, "seconds": 1, "variables": ["descriptors[0]["]}]"#)
            .contains("variables"));
    }
}
