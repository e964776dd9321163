//! Key extraction and limiter naming: which value of a request a rule limits by, how that value becomes a
//! Redisson limiter name, and the Redis keys of that limiter.
//!
//! Nothing here calls the host: a request is seen through [`RequestView`], so the same code runs in the
//! filter, in native unit tests and in the wasm32 tests under Node's WASI.

use crate::prelude::*;

use alloc::borrow::Cow;
use alloc::boxed::Box;
use core::net::{IpAddr, SocketAddr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use sha2::{Digest, Sha256};

use crate::encoding;

/// Where a rule takes its key value from (`limit_by` in the configuration).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// A request header, by name (matched case-insensitively: [`KeySource::header`] lowercases it).
    Header(String),
    /// A query parameter of `:path`, by name (form-decoded).
    Query(String),
    /// A cookie of the `cookie` header, by name.
    Cookie(String),
    /// The downstream address (the `source.address` property), without the port.
    ClientIp,
    /// The N-th address from the right of `x-forwarded-for`: N is the number of trusted proxies in front
    /// of the gateway that each append one address (N >= 1). Not an IP address: no key value.
    XForwardedFor(u32),
    /// The path of `:path`, without the query string.
    Path,
    /// One limiter for every request.
    Global,
    /// The network of an address source ([`KeySource::ClientIp`] or [`KeySource::XForwardedFor`]): the
    /// address with its host bits cleared, written `address/prefix` (`10.1.2.0/24`, `2001:db8:1::/64`), so
    /// a whole network shares one limiter. IPv4-mapped IPv6 addresses count as IPv4.
    Network {
        /// The address source.
        of: Box<KeySource>,
        /// Prefix lengths kept, by address family.
        prefix: IpPrefix,
    },
    /// Several sources together (e.g. user and path): one limiter per combination of their values, named
    /// by the parts in order ([`write_limiter_name`]). Missing when any part is missing.
    Composite(Vec<KeySource>),
    /// A request property by its path segments (`proxy_get_property`), e.g. what an authentication filter
    /// put in the request's filter state or dynamic metadata; its value as the host serializes it (a
    /// string's bytes).
    Property(Vec<String>),
    /// A field of the JSON request body, by dotted paths tried in order (the first present wins): its
    /// string's bytes, or a whole number's decimal text. E.g. `model` (per-model limits) or a reservation's
    /// `max_tokens`. A rule reading it holds the request until its body has arrived. A body that gives no
    /// value (not JSON, larger than [`MAX_REQUEST_BODY`], none of the paths, another kind of value) never
    /// makes a key missing: the part is [`UNREAD_BODY_PART`] ([`extract`]), so the request is still charged
    /// to the limiter of the key's other parts (a client cannot skip a rule by sending a body it cannot
    /// read).
    Body(Vec<Vec<String>>),
}

/// How a key part read from the request body ([`KeySource::Body`]) is written in a limiter name when the
/// body gives no value for it: `!missing`. No value is written so (`!` is not among the verbatim bytes,
/// and encoded values start with `~` or `#`: [`limiter_name`]), so such requests of one tenant share one
/// limiter of their own, beside the tenant's other ones.
pub const UNREAD_BODY_PART: &str = "!missing";

/// The most request-body bytes read for [`KeySource::Body`]: 64 KiB. A larger body is not read (its
/// fields are missing) and the request is decided when this much has arrived.
pub const MAX_REQUEST_BODY: usize = 64 * 1024;

/// How much of an address a [`KeySource::Network`] key keeps: prefix lengths in bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpPrefix {
    /// IPv4 prefix length, 0..=32 (32: the whole address).
    pub ipv4: u8,
    /// IPv6 prefix length, 0..=128 (128: the whole address).
    pub ipv6: u8,
}

/// Most parts of a composite key (`limit_by` as an array).
pub const MAX_KEY_PARTS: usize = 8;

impl KeySource {
    /// A header source; the name is trimmed and lowercased, as hosts present header names.
    pub fn header(name: &str) -> Self {
        KeySource::Header(name.trim().to_ascii_lowercase())
    }

    /// Checks what the shape cannot: names must not be empty, hops must be at least 1.
    ///
    /// # Errors
    /// A sentence saying what is wrong, for [`crate::config::ConfigError`].
    pub fn validate(&self) -> Result<(), String> {
        match self {
            KeySource::Header(name) if name.trim().is_empty() => Err("the header name must not be empty".into()),
            KeySource::Query(name) if name.is_empty() => Err("the query parameter name must not be empty".into()),
            KeySource::Cookie(name) if name.trim().is_empty() => Err("the cookie name must not be empty".into()),
            KeySource::XForwardedFor(0) => Err("trusted hops must be at least 1 (use \"client_ip\" for none)".into()),
            KeySource::Network { of, prefix } => {
                if !matches!(**of, KeySource::ClientIp | KeySource::XForwardedFor(_)) {
                    return Err("a prefix applies to `client_ip` or `x_forwarded_for` only".into());
                }
                if prefix.ipv4 > 32 || prefix.ipv6 > 128 {
                    return Err("`ipv4_prefix` must be at most 32 and `ipv6_prefix` at most 128".into());
                }
                of.validate()
            }
            KeySource::Composite(parts) => {
                if parts.len() < 2 || parts.len() > MAX_KEY_PARTS {
                    return Err(format!("a composite key has 2 to {MAX_KEY_PARTS} parts"));
                }
                for (index, part) in parts.iter().enumerate() {
                    if matches!(part, KeySource::Global | KeySource::Composite(_)) {
                        return Err(format!(
                            "part {index}: `global` or a nested list cannot be part of a composite key"
                        ));
                    }
                    part.validate().map_err(|why| format!("part {index}: {why}"))?;
                }
                Ok(())
            }
            KeySource::Property(path) if path.is_empty() || path.iter().any(String::is_empty) => {
                Err("a property path needs non-empty segments".into())
            }
            KeySource::Body(paths) if paths.is_empty() || paths.iter().flatten().any(String::is_empty) => {
                Err("a body field needs a dotted path of non-empty names, such as \"model\"".into())
            }
            _ => Ok(()),
        }
    }

    /// The header this source reads, lowercased, if it reads a header (`:path` for path and query).
    fn header_name(&self) -> Option<&str> {
        match self {
            KeySource::Header(name) => Some(name),
            KeySource::Query(_) | KeySource::Path => Some(":path"),
            KeySource::Cookie(_) => Some("cookie"),
            KeySource::XForwardedFor(_) => Some("x-forwarded-for"),
            KeySource::Network { of, .. } => of.header_name(),
            KeySource::ClientIp
            | KeySource::Global
            | KeySource::Composite(_)
            | KeySource::Property(_)
            | KeySource::Body(_) => None,
        }
    }

    /// Whether this source reads the request body (itself, or a part of a composite key).
    pub fn reads_body(&self) -> bool {
        match self {
            KeySource::Body(_) => true,
            KeySource::Composite(parts) => parts.iter().any(KeySource::reads_body),
            _ => false,
        }
    }
}

/// What the filter can read of a request. The filter implements it with hostcalls; tests with a struct.
pub trait RequestView {
    /// The value of a request header (lowercase name, pseudo-headers such as `:path` included), as bytes.
    fn header(&self, name: &str) -> Option<Vec<u8>>;
    /// The `source.address` property: the downstream address as `ip:port` (or `[v6]:port`).
    fn source_address(&self) -> Option<String>;
    /// A property by its path segments, as the host serializes it; `None` when absent (and where no host
    /// answers properties, as in `erl-admin explain`).
    fn property(&self, _path: &[&str]) -> Option<Vec<u8>> {
        None
    }
    /// A field of the JSON request body by its path (object member names): a string's bytes or a number's
    /// text; `None` when absent, another kind of value, or no body was read.
    fn body_field(&self, _path: &[String]) -> Option<Vec<u8>> {
        None
    }
}

/// The key value of a request for one rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyValue {
    /// The request carries a value (possibly empty, possibly binary).
    Value(Vec<u8>),
    /// A composite key's values, one per part, in order: every part read from a header, query, cookie,
    /// address or property present; `None` for a part read from the body that the body did not give
    /// (written [`UNREAD_BODY_PART`]). A lone [`KeySource::Body`] without its value is `Parts(vec![None])`.
    Parts(Vec<Option<Vec<u8>>>),
    /// The rule is global: no value part in the limiter name.
    Global,
    /// The request carries no value for this rule (a part read from a header, query, cookie, address or
    /// property is absent: `on_missing` applies). A body field is never missing ([`KeyValue::Parts`]).
    Missing,
}

/// Reads a rule's key value from a request. A part read from the body that the body does not give is
/// `None` in [`KeyValue::Parts`], never [`KeyValue::Missing`] (see [`UNREAD_BODY_PART`]).
pub fn extract(source: &KeySource, request: &impl RequestView) -> KeyValue {
    let header = source.header_name().and_then(|name| request.header(name));
    let value = match source {
        KeySource::Global => return KeyValue::Global,
        KeySource::Header(_) => header,
        KeySource::Path => header.map(|path| split_path(&path).0.to_vec()),
        KeySource::Query(name) => header.and_then(|path| query_parameter(&path, name)),
        KeySource::Cookie(name) => header.and_then(|cookies| cookie(&cookies, name)),
        KeySource::ClientIp => {
            request.source_address().as_deref().and_then(parse_ip).map(|ip| ip.to_string().into_bytes())
        }
        KeySource::XForwardedFor(hops) => header.and_then(|xff| forwarded_client(&xff, *hops)),
        KeySource::Network { of, prefix } => {
            let address = match **of {
                KeySource::XForwardedFor(hops) => header.as_deref().and_then(|xff| forwarded_ip(xff, hops)),
                _ => request.source_address().as_deref().and_then(parse_ip),
            };
            address.and_then(|ip| network(ip, *prefix)).map(String::into_bytes)
        }
        KeySource::Property(path) => {
            let path: Vec<&str> = path.iter().map(String::as_str).collect();
            request.property(&path)
        }
        KeySource::Body(paths) => match paths.iter().find_map(|path| request.body_field(path)) {
            Some(value) => Some(value),
            None => return KeyValue::Parts(vec![None]),
        },
        KeySource::Composite(parts) => {
            let mut values = Vec::with_capacity(parts.len());
            for part in parts {
                match extract(part, request) {
                    KeyValue::Value(value) => values.push(Some(value)),
                    // A body field the body did not give (the only source that answers `Parts` here).
                    KeyValue::Parts(unread) if unread == [None] => values.push(None),
                    _ => return KeyValue::Missing,
                }
            }
            return KeyValue::Parts(values);
        }
    };
    value.map_or(KeyValue::Missing, KeyValue::Value)
}

/// The bytes a value is matched against (`rates_by_value`): the value itself, or a composite key's parts
/// joined by `:` (an unread body part as [`UNREAD_BODY_PART`]); `None` for a global rule or a missing value.
pub fn match_text(value: &KeyValue) -> Option<Cow<'_, [u8]>> {
    match value {
        KeyValue::Value(bytes) => Some(Cow::Borrowed(bytes)),
        KeyValue::Parts(parts) => {
            let texts = parts.iter().map(|part| part.as_deref().unwrap_or(UNREAD_BODY_PART.as_bytes()));
            Some(Cow::Owned(texts.collect::<Vec<_>>().join(&b':')))
        }
        KeyValue::Global | KeyValue::Missing => None,
    }
}

/// `ip` with its host bits cleared, as `network/prefix` (canonical text: `10.1.2.0/24`, `2001:db8::/64`);
/// `None` for a prefix longer than the family's address (refused at load).
fn network(ip: IpAddr, prefix: IpPrefix) -> Option<String> {
    let net = match ip.to_canonical() {
        IpAddr::V4(v4) => IpNet::V4(Ipv4Net::new(v4, prefix.ipv4).ok()?),
        IpAddr::V6(v6) => IpNet::V6(Ipv6Net::new(v6, prefix.ipv6).ok()?),
    };
    Some(net.trunc().to_string())
}

/// Splits `:path` into the path and the query string (without `?`; empty when there is none).
fn split_path(path: &[u8]) -> (&[u8], &[u8]) {
    match path.iter().position(|&b| b == b'?') {
        Some(at) => (path.get(..at).unwrap_or_default(), path.get(at + 1..).unwrap_or_default()),
        None => (path, &[]),
    }
}

/// The first value of a query parameter, decoded as `application/x-www-form-urlencoded` (`+` is a space).
fn query_parameter(path: &[u8], name: &str) -> Option<Vec<u8>> {
    let (_, query) = split_path(path);
    let query = query.split(|&b| b == b'#').next().unwrap_or_default();
    query.split(|&b| b == b'&').find_map(|pair| {
        let (key, value) = match pair.iter().position(|&b| b == b'=') {
            Some(at) => (pair.get(..at)?, pair.get(at + 1..)?),
            None => (pair, &[][..]),
        };
        (form_decode(key) == name.as_bytes()).then(|| form_decode(value))
    })
}

/// `application/x-www-form-urlencoded` decoding to bytes: `+` is a space, `%XX` one byte. No UTF-8 is
/// assumed, so different bytes stay different values (a lossy decoding would give `%FF` and `%FE` one key).
fn form_decode(bytes: &[u8]) -> Vec<u8> {
    let spaced: Vec<u8> = bytes.iter().map(|&b| if b == b'+' { b' ' } else { b }).collect();
    percent_encoding::percent_decode(&spaced).collect()
}

/// The value of a cookie in a `cookie` header.
///
/// The header is `name=value` pairs joined by `"; "` (RFC 6265 section 4.2.1). That grammar is all this
/// needs; the `cookie` crate would add `time` and its size to the module for the same split.
fn cookie(header: &[u8], name: &str) -> Option<Vec<u8>> {
    header.split(|&b| b == b';').find_map(|pair| {
        let pair = pair.trim_ascii();
        let at = pair.iter().position(|&b| b == b'=')?;
        let (key, value) = (pair.get(..at)?, pair.get(at + 1..)?);
        (key.trim_ascii() == name.as_bytes()).then(|| strip_quotes(value.trim_ascii()).to_vec())
    })
}

fn strip_quotes(value: &[u8]) -> &[u8] {
    match value {
        [b'"', inner @ .., b'"'] => inner,
        _ => value,
    }
}

/// An IP address from `ip`, `ip:port`, `[v6]` or `[v6]:port`.
pub(crate) fn parse_ip(address: &str) -> Option<IpAddr> {
    let address = address.trim();
    address
        .parse::<SocketAddr>()
        .map(|socket| socket.ip())
        .or_else(|_| address.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>())
        .ok()
}

/// The client address `hops` entries from the right of `x-forwarded-for`, normalized, if it is an IP.
fn forwarded_client(header: &[u8], hops: u32) -> Option<Vec<u8>> {
    forwarded_ip(header, hops).map(|ip| ip.to_string().into_bytes())
}

/// The address `hops` entries from the right of `x-forwarded-for`, if it is an IP.
fn forwarded_ip(header: &[u8], hops: u32) -> Option<IpAddr> {
    // Split the bytes first: only the trusted entry must be text (a client's own entries may hold anything,
    // and must not make the header unreadable).
    let entries: Vec<&[u8]> = header.split(|&b| b == b',').map(<[u8]>::trim_ascii).filter(|e| !e.is_empty()).collect();
    let index = entries.len().checked_sub(usize::try_from(hops).ok()?)?;
    parse_ip(core::str::from_utf8(entries.get(index)?).ok()?)
}

/// Longest key value written verbatim into a limiter name, bytes.
pub const MAX_VERBATIM_LEN: usize = 128;
/// Longest key value written base64-encoded; longer ones are hashed (SHA-256), bytes.
pub const MAX_ENCODED_LEN: usize = 256;

fn is_verbatim_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'@' | b'/' | b':' | b'+' | b'=' | b'-')
}

/// The limiter name of a rule's key value.
///
/// Global rules use `base` itself. Otherwise `base + ":" + encoded value`, where the value is written
/// verbatim if it is 1 to [`MAX_VERBATIM_LEN`] bytes of `[A-Za-z0-9._@/:+=-]`, else as `~` + base64url
/// (no padding) when at most [`MAX_ENCODED_LEN`] bytes, else as `#` + base64url of its SHA-256. The three
/// forms start with different characters, so two different values never share a name (up to SHA-256
/// collisions for values over 256 bytes), and the name never contains `{`, so every key of the limiter
/// hashes to one Redis Cluster slot.
pub fn limiter_name(base: &str, value: &KeyValue) -> Option<String> {
    let mut name = String::new();
    write_limiter_name(base, value, &mut name).then_some(name)
}

/// The Redis Cluster hash slot of a limiter's keys (0..16384): CRC-16/XMODEM of the hash tag modulo
/// 16384, as the Redis Cluster specification defines it ("Hash tags": the bytes between the first `{` and
/// the next `}`, when not empty, else the whole key). Every key of a limiter shares it: the keys are
/// `{name}:suffix` (tag: the name) and the name itself, or, for a name with a `{`, `name:suffix` whose tag
/// is the name's own.
pub fn hash_slot(name: &str) -> u16 {
    // Bit by bit (no 512-byte table in the module): a request hashes a few short names.
    const XMODEM: crc::Crc<u16, crc::NoTable> = crc::Crc::<u16, crc::NoTable>::new(&crc::CRC_16_XMODEM);
    let bytes = name.as_bytes();
    let tag = bytes
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = bytes.get(open + 1..)?;
            let close = rest.iter().position(|&b| b == b'}')?;
            rest.get(..close).filter(|tag| !tag.is_empty())
        })
        .unwrap_or(bytes);
    XMODEM.checksum(tag) % 16_384
}

/// [`limiter_name`] written into `name` (cleared first; its allocation is reused): `false` when the value
/// is missing (then `name` is empty).
pub fn write_limiter_name(base: &str, value: &KeyValue, name: &mut String) -> bool {
    name.clear();
    let bytes = match value {
        KeyValue::Global => {
            name.push_str(base);
            return true;
        }
        KeyValue::Missing => return false,
        KeyValue::Parts(parts) => {
            name.push_str(base);
            for part in parts {
                name.push(':');
                // `:` separates the parts, so a part holding one is encoded: the parts of two different
                // combinations never make one name.
                match part {
                    Some(part) => write_value(part, |b| b != b':' && is_verbatim_byte(b), name),
                    None => name.push_str(UNREAD_BODY_PART),
                }
            }
            return true;
        }
        KeyValue::Value(bytes) => bytes,
    };
    name.reserve(base.len() + 2 + bytes.len().min(MAX_ENCODED_LEN) * 4 / 3 + 4);
    name.push_str(base);
    name.push(':');
    write_value(bytes, is_verbatim_byte, name);
    true
}

/// One value into a limiter name: verbatim when 1 to [`MAX_VERBATIM_LEN`] bytes all `verbatim`, else `~` +
/// base64url when at most [`MAX_ENCODED_LEN`] bytes, else `#` + base64url of its SHA-256.
fn write_value(bytes: &[u8], verbatim: impl Fn(u8) -> bool, name: &mut String) {
    if !bytes.is_empty() && bytes.len() <= MAX_VERBATIM_LEN && bytes.iter().copied().all(verbatim) {
        // Only bytes from the verbatim set: valid ASCII.
        name.push_str(core::str::from_utf8(bytes).unwrap_or_default());
    } else if bytes.len() <= MAX_ENCODED_LEN {
        name.push('~');
        encoding::base64_into(bytes, encoding::URL_SAFE, false, name);
    } else {
        name.push('#');
        encoding::base64_into(&Sha256::digest(bytes), encoding::URL_SAFE, false, name);
    }
}

/// The Redis keys of one Redisson limiter, as Redisson 4.x `RedissonRateLimiter` names them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimiterKeys {
    /// The config hash: the limiter name itself.
    pub config: String,
    /// `OVERALL` available permits (string).
    pub value: String,
    /// `PER_CLIENT` available permits of this client (string).
    pub client_value: String,
    /// `OVERALL` acquired permits (sorted set, score = acquire time ms).
    pub permits: String,
    /// `PER_CLIENT` acquired permits of this client (sorted set).
    pub client_permits: String,
}

impl LimiterKeys {
    /// The keys of limiter `name` for client `client_id` (Redisson: the client instance's UUID string).
    pub fn new(name: &str, client_id: &str) -> Self {
        let value = redisson_suffix(name, "value");
        let permits = redisson_suffix(name, "permits");
        LimiterKeys {
            config: name.to_string(),
            client_value: format!("{value}:{client_id}"),
            client_permits: format!("{permits}:{client_id}"),
            value,
            permits,
        }
    }
}

/// Redisson's `suffixName(name, suffix)`: `name:suffix` if the name already carries a hash tag (`{`),
/// else `{name}:suffix`, so the derived keys share the config hash's cluster slot.
pub fn redisson_suffix(name: &str, suffix: &str) -> String {
    if name.contains('{') {
        format!("{name}:{suffix}")
    } else {
        format!("{{{name}}}:{suffix}")
    }
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;

    #[test]
    fn hash_slots_are_redis_clusters() {
        // CLUSTER KEYSLOT of a real Redis: foo 12182, bar 5061; a hash tag picks the slot.
        assert_eq!(hash_slot("foo"), 12_182);
        assert_eq!(hash_slot("bar"), 5_061);
        assert_eq!(hash_slot("{foo}:r:alice"), 12_182);
        assert_eq!(hash_slot("{}:x"), hash_slot("{}:x"), "an empty tag hashes the whole name");
        assert_ne!(hash_slot("{}:x"), hash_slot(""));
    }

    /// A request for tests: headers (lowercase names) and a source address.
    #[derive(Default)]
    pub(crate) struct FakeRequest {
        pub headers: Vec<(String, Vec<u8>)>,
        pub source: Option<String>,
    }

    impl FakeRequest {
        pub fn with(headers: &[(&str, &str)]) -> Self {
            FakeRequest {
                headers: headers.iter().map(|(k, v)| (k.to_string(), v.as_bytes().to_vec())).collect(),
                source: Some("10.0.0.7:51234".into()),
            }
        }
    }

    impl RequestView for FakeRequest {
        fn header(&self, name: &str) -> Option<Vec<u8>> {
            self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
        }
        fn source_address(&self) -> Option<String> {
            self.source.clone()
        }
    }

    fn value_of(source: KeySource, headers: &[(&str, &str)]) -> KeyValue {
        extract(&source, &FakeRequest::with(headers))
    }

    fn some(text: &str) -> KeyValue {
        KeyValue::Value(text.as_bytes().to_vec())
    }

    #[test]
    fn headers_are_read_case_insensitively() {
        assert_eq!(value_of(KeySource::header(" X-User-Id"), &[("x-user-id", "alice")]), some("alice"));
        assert_eq!(value_of(KeySource::header("x-user-id"), &[]), KeyValue::Missing);
    }

    #[test]
    fn query_parameters_are_form_decoded() {
        let path = [(":path", "/v1/items?page=2&api_key=a%2Fb+c&api_key=second#frag")];
        assert_eq!(value_of(KeySource::Query("api_key".into()), &path), some("a/b c"));
        assert_eq!(value_of(KeySource::Query("missing".into()), &path), KeyValue::Missing);
        assert_eq!(value_of(KeySource::Path, &path), some("/v1/items"));
        assert_eq!(value_of(KeySource::Query("k".into()), &[(":path", "/x?k=")]), some(""));
        // Bytes that are not UTF-8 stay distinct values (not both U+FFFD).
        let ff = value_of(KeySource::Query("k".into()), &[(":path", "/x?k=%FF")]);
        assert_eq!(ff, KeyValue::Value(vec![0xff]));
        assert_ne!(ff, value_of(KeySource::Query("k".into()), &[(":path", "/x?k=%FE")]));
    }

    #[test]
    fn cookies_are_found_among_others() {
        let cookies = [("cookie", "theme=dark; session=\"s-123\";lang=en")];
        assert_eq!(value_of(KeySource::Cookie("session".into()), &cookies), some("s-123"));
        assert_eq!(value_of(KeySource::Cookie("lang".into()), &cookies), some("en"));
        assert_eq!(value_of(KeySource::Cookie("sess".into()), &cookies), KeyValue::Missing);
    }

    #[test]
    fn client_ip_drops_the_port_and_normalizes_v6() {
        let mut request = FakeRequest::with(&[]);
        assert_eq!(extract(&KeySource::ClientIp, &request), some("10.0.0.7"));
        request.source = Some("[2001:db8:0::1]:443".into());
        assert_eq!(extract(&KeySource::ClientIp, &request), some("2001:db8::1"));
        request.source = None;
        assert_eq!(extract(&KeySource::ClientIp, &request), KeyValue::Missing);
    }

    #[test]
    fn forwarded_for_counts_trusted_hops_from_the_right() {
        let xff = [("x-forwarded-for", "203.0.113.9, 198.51.100.4 ,10.1.1.1")];
        assert_eq!(value_of(KeySource::XForwardedFor(1), &xff), some("10.1.1.1"));
        assert_eq!(value_of(KeySource::XForwardedFor(2), &xff), some("198.51.100.4"));
        assert_eq!(value_of(KeySource::XForwardedFor(3), &xff), some("203.0.113.9"));
        assert_eq!(value_of(KeySource::XForwardedFor(4), &xff), KeyValue::Missing, "fewer entries than hops");
        let spoofed = [("x-forwarded-for", "not-an-ip, 10.1.1.1")];
        assert_eq!(value_of(KeySource::XForwardedFor(2), &spoofed), KeyValue::Missing);
        // Bytes that are not UTF-8 in a client's own entries do not hide the trusted one.
        assert_eq!(forwarded_client(b"\xff\x80, 203.0.113.9,10.1.1.1", 2), Some(b"203.0.113.9".to_vec()));
        assert_eq!(forwarded_client(b"1.2.3.4, \xe9", 1), None, "the trusted entry itself must be an address");
    }

    #[test]
    fn safe_values_are_verbatim_and_others_encoded() {
        let name = |v: &[u8]| limiter_name("erl:r", &KeyValue::Value(v.to_vec())).unwrap();
        assert_eq!(name(b"alice"), "erl:r:alice");
        assert_eq!(name(b"2001:db8::1"), "erl:r:2001:db8::1");
        assert_eq!(name(b"a{b} c"), "erl:r:~YXtifSBj");
        assert_eq!(name(b""), "erl:r:~");
        assert_eq!(name(&[0, 0xff]), "erl:r:~AP8");
        assert_eq!(name(&[b'a'; 128]), format!("erl:r:{}", "a".repeat(128)));
        assert!(name(&[b'a'; 129]).starts_with("erl:r:~"));
        let long = name(&[b'a'; 257]);
        assert!(long.starts_with("erl:r:#") && long.len() == "erl:r:#".len() + 43, "{long}");
        assert_eq!(limiter_name("erl:g", &KeyValue::Global).as_deref(), Some("erl:g"));
        assert_eq!(limiter_name("erl:g", &KeyValue::Missing), None);
    }

    #[test]
    fn different_values_never_share_a_name() {
        let values: Vec<Vec<u8>> = vec![
            b"~YQ".to_vec(),
            b"a".to_vec(),
            b"#x".to_vec(),
            vec![],
            b"a b".to_vec(),
            b"a{b}".to_vec(),
            vec![b'a'; 129],
            vec![b'a'; 257],
            vec![b'b'; 257],
            "é".as_bytes().to_vec(),
        ];
        let names: std::collections::HashSet<String> =
            values.iter().map(|v| limiter_name("n", &KeyValue::Value(v.clone())).unwrap()).collect();
        assert_eq!(names.len(), values.len());
        assert!(names.iter().all(|n| !n.contains('{')));
    }

    /// A request whose JSON body gives `model` only when `body` is true.
    struct BodyRequest {
        headers: FakeRequest,
        model: Option<&'static str>,
    }

    impl RequestView for BodyRequest {
        fn header(&self, name: &str) -> Option<Vec<u8>> {
            self.headers.header(name)
        }
        fn source_address(&self) -> Option<String> {
            self.headers.source_address()
        }
        fn body_field(&self, path: &[String]) -> Option<Vec<u8>> {
            (path == ["model"]).then_some(self.model?.as_bytes().to_vec())
        }
    }

    #[test]
    fn a_body_part_the_body_does_not_give_charges_the_other_parts() {
        let source =
            KeySource::Composite(vec![KeySource::header("authorization"), KeySource::Body(vec![vec!["model".into()]])]);
        let tenant = |model| BodyRequest { headers: FakeRequest::with(&[("authorization", "sk-a")]), model };
        let read = extract(&source, &tenant(Some("gpt")));
        assert_eq!(limiter_name("erl:t", &read).as_deref(), Some("erl:t:sk-a:gpt"));
        // Too large, not JSON, or no `model`: the tenant's own limiter for unread bodies, not a skip.
        let unread = extract(&source, &tenant(None));
        assert_eq!(unread, KeyValue::Parts(vec![Some(b"sk-a".to_vec()), None]));
        assert_eq!(limiter_name("erl:t", &unread).as_deref(), Some("erl:t:sk-a:!missing"));
        assert_eq!(match_text(&unread).as_deref(), Some(&b"sk-a:!missing"[..]));
        // No value writes the marker: a model named `!missing` is encoded.
        let named = extract(&source, &tenant(Some("!missing")));
        assert_ne!(limiter_name("erl:t", &named), limiter_name("erl:t", &unread));
        // Another tenant's unread bodies have a limiter of their own.
        let other = BodyRequest { headers: FakeRequest::with(&[("authorization", "sk-b")]), model: None };
        assert_eq!(limiter_name("erl:t", &extract(&source, &other)).as_deref(), Some("erl:t:sk-b:!missing"));
        // A header part missing still makes the key missing (`on_missing` applies).
        let anonymous = BodyRequest { headers: FakeRequest::with(&[]), model: Some("gpt") };
        assert_eq!(extract(&source, &anonymous), KeyValue::Missing);
        // A key read from the body alone: one limiter for the requests without the field.
        let lone = KeySource::Body(vec![vec!["model".into()]]);
        assert_eq!(limiter_name("erl:m", &extract(&lone, &tenant(None))).as_deref(), Some("erl:m:!missing"));
        assert_eq!(limiter_name("erl:m", &extract(&lone, &tenant(Some("gpt")))).as_deref(), Some("erl:m:gpt"));
    }

    #[test]
    fn keys_follow_redisson_naming() {
        let keys = LimiterKeys::new("erl:r:alice", "0b6e-uuid");
        assert_eq!(keys.config, "erl:r:alice");
        assert_eq!(keys.value, "{erl:r:alice}:value");
        assert_eq!(keys.permits, "{erl:r:alice}:permits");
        assert_eq!(keys.client_value, "{erl:r:alice}:value:0b6e-uuid");
        assert_eq!(keys.client_permits, "{erl:r:alice}:permits:0b6e-uuid");
        assert_eq!(redisson_suffix("{tagged}name", "value"), "{tagged}name:value");
    }
}
