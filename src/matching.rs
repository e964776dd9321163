//! What a request or a key value is matched against: exemptions (`exempt`: client networks, header
//! values) and the value matches of `rates_by_value` (a list of exact values, or a regular expression).
//!
//! Pure: a request is seen through [`RequestView`], as in [`crate::key`].

use crate::prelude::*;

use core::fmt;
use core::net::IpAddr;

use ipnet::IpNet;
#[cfg(feature = "regex")]
use regex_automata::{
    nfa::thompson::{self, pikevm::PikeVM},
    util::syntax,
};

use crate::key::{parse_ip, RequestView};

/// Requests a configuration or a rule leaves alone (`exempt`): any listed client network, or any listed
/// value of a header, exempts the request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Exemption {
    /// Client networks (`10.0.0.0/8`, `2001:db8::/32`; a bare address is one host), matched against the
    /// `source.address` property. IPv4-mapped IPv6 addresses count as IPv4.
    pub client_ips: Vec<IpNet>,
    /// Header names (lowercase) and the exact values that exempt a request.
    pub headers: Vec<(String, Vec<Vec<u8>>)>,
}

impl Exemption {
    /// Whether `request` is exempt.
    pub fn matches(&self, request: &impl RequestView) -> bool {
        let by_network = !self.client_ips.is_empty()
            && request.source_address().as_deref().and_then(parse_ip).is_some_and(|ip| {
                let ip = ip.to_canonical();
                self.client_ips.iter().any(|net| net.contains(&ip))
            });
        by_network
            || self
                .headers
                .iter()
                .any(|(name, values)| request.header(name).is_some_and(|value| values.contains(&value)))
    }
}

/// A network from `address/prefix` or a bare address (one host).
///
/// # Errors
/// A sentence naming the text, for [`crate::config::ConfigError`].
pub fn parse_network(text: &str) -> Result<IpNet, String> {
    let text = text.trim();
    if let Ok(net) = text.parse::<IpNet>() {
        return Ok(net.trunc());
    }
    text.parse::<IpAddr>().map(IpNet::from).map_err(|_| {
        format!("{} is not an address or a network (`10.0.0.0/8`, `2001:db8::/32`)", crate::quote::quoted(text))
    })
}

/// Which key values an entry of `rates_by_value` applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ValueMatch {
    /// Any of these exact values (bytes).
    Values(Vec<Vec<u8>>),
    /// Values in which this regular expression finds a match (unanchored: write `^...$` for the whole value).
    Regex(Pattern),
}

impl ValueMatch {
    /// Whether the key value `value` (bytes; a composite key's parts joined by `:`) matches.
    pub fn matches(&self, value: &[u8]) -> bool {
        match self {
            ValueMatch::Values(values) => values.iter().any(|v| v == value),
            ValueMatch::Regex(pattern) => pattern.is_match(value),
        }
    }
}

/// Largest compiled regular expression, bytes of its automaton: bounds the memory a configuration takes.
#[cfg(feature = "regex")]
const MAX_PATTERN_SIZE: usize = 256 * 1024;

/// Why a build without the `regex` feature refuses a regular expression.
pub const NO_REGEX: &str =
    "this build has no regular expressions: use an -regex artifact (edge-rate-limiter-envoy-regex.wasm, edge-rate-limiter-higress-regex.wasm) or `values`";

/// A compiled regular expression over bytes (the `regex` crate's syntax without Unicode classes: `.`
/// matches one byte, `\w` `[0-9A-Za-z_]`), with its source text. Only the builds with the `regex` feature
/// compile one; the others refuse it at load ([`NO_REGEX`]).
#[derive(Clone)]
pub struct Pattern {
    source: String,
    #[cfg(feature = "regex")]
    engine: PikeVM,
}

impl Pattern {
    /// Compiles `source`.
    ///
    /// # Errors
    /// The compiler's message (syntax errors, Unicode classes, a pattern over 256 KiB compiled), or
    /// [`NO_REGEX`] in a build without the `regex` feature.
    #[cfg(feature = "regex")]
    pub fn new(source: &str) -> Result<Self, String> {
        let engine = PikeVM::builder()
            .syntax(syntax::Config::new().unicode(false).utf8(false))
            .thompson(thompson::Config::new().utf8(false).nfa_size_limit(Some(MAX_PATTERN_SIZE)))
            .build(source)
            .map_err(|e| format!("invalid regular expression: {e}"))?;
        Ok(Pattern { source: source.to_string(), engine })
    }

    /// Compiles `source`: refused, this build has no regular expressions.
    ///
    /// # Errors
    /// Always [`NO_REGEX`].
    #[cfg(not(feature = "regex"))]
    pub fn new(_source: &str) -> Result<Self, String> {
        Err(NO_REGEX.into())
    }

    /// Whether the pattern matches somewhere in `haystack`.
    #[cfg(feature = "regex")]
    pub fn is_match(&self, haystack: &[u8]) -> bool {
        let mut cache = self.engine.create_cache();
        self.engine.is_match(&mut cache, haystack)
    }

    /// Whether the pattern matches somewhere in `haystack` (never built without the `regex` feature).
    #[cfg(not(feature = "regex"))]
    pub fn is_match(&self, _haystack: &[u8]) -> bool {
        false
    }

    /// The source text.
    pub fn source(&self) -> &str {
        &self.source
    }
}

impl PartialEq for Pattern {
    fn eq(&self, other: &Self) -> bool {
        self.source == other.source
    }
}

impl Eq for Pattern {}

impl fmt::Debug for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Pattern({:?})", self.source)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;
    use crate::key::tests::FakeRequest;

    #[test]
    fn exemptions_match_client_networks_and_header_values() {
        let exempt = Exemption {
            client_ips: vec![parse_network("10.0.0.0/8").unwrap(), parse_network("2001:db8::1").unwrap()],
            headers: vec![("x-internal".into(), vec![b"yes".to_vec()])],
        };
        let mut request = FakeRequest::with(&[]);
        request.source = Some("10.200.1.1:4000".into());
        assert!(exempt.matches(&request));
        request.source = Some("[::ffff:10.1.1.1]:4000".into());
        assert!(exempt.matches(&request), "IPv4-mapped counts as IPv4");
        request.source = Some("[2001:db8::1]:1".into());
        assert!(exempt.matches(&request));
        request.source = Some("11.0.0.1:1".into());
        assert!(!exempt.matches(&request));
        let mut internal = FakeRequest::with(&[("x-internal", "yes")]);
        internal.source = Some("11.0.0.1:1".into());
        assert!(exempt.matches(&internal));
        let mut other = FakeRequest::with(&[("x-internal", "no")]);
        other.source = Some("11.0.0.1:1".into());
        assert!(!exempt.matches(&other));
        assert!(!Exemption::default().matches(&other));
    }

    #[test]
    fn networks_are_parsed_or_refused_with_the_text() {
        assert_eq!(parse_network("10.1.2.3/8").unwrap().to_string(), "10.0.0.0/8");
        assert_eq!(parse_network("::1").unwrap().to_string(), "::1/128");
        assert!(parse_network("10.0.0.0/33").unwrap_err().contains("\"10.0.0.0/33\" is not"));
        assert!(parse_network("example.com").is_err());
    }

    #[test]
    fn values_match_exactly() {
        let gold = ValueMatch::Values(vec![b"gold".to_vec(), b"platinum".to_vec()]);
        assert!(gold.matches(b"gold") && !gold.matches(b"golden"));
    }

    #[cfg(not(feature = "regex"))]
    #[test]
    fn builds_without_the_regex_feature_refuse_patterns() {
        assert_eq!(Pattern::new("^a").unwrap_err(), NO_REGEX);
    }

    #[cfg(feature = "regex")]
    #[test]
    fn patterns_match_anywhere_over_bytes() {
        let silver = ValueMatch::Regex(Pattern::new("^silver-[0-9]+$").unwrap());
        assert!(silver.matches(b"silver-12"));
        assert!(!silver.matches(b"silver-x") && !silver.matches(b"a-silver-1"));
        let anywhere = Pattern::new("beta").unwrap();
        assert!(anywhere.is_match(b"a-beta-b"));
        assert!(Pattern::new("\\xff.").unwrap().is_match(&[0xff, 0]), "bytes, not UTF-8");
        assert!(Pattern::new("(unclosed").unwrap_err().starts_with("invalid regular expression"));
        assert!(Pattern::new("\\p{Greek}").is_err(), "no Unicode tables");
        assert_eq!(Pattern::new("a+").unwrap(), Pattern::new("a+").unwrap());
    }
}
