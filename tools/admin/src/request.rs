//! The request `explain` asks about, built from its options and seen by the filter's own key code through
//! [`RequestView`], as the filter sees a request through its host: headers by lowercase name (`:path` and
//! `:authority` included), the `source.address` property as `ip:port`, and the route name that picks a
//! Higress `_rules_` entry.

use std::net::{IpAddr, SocketAddr};

use edge_rate_limiter::key::RequestView;
use serde::Serialize;

/// One `--header name:value`: the name lowercased (as hosts present them), the value without the
/// surrounding blanks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Header {
    /// Lowercase name, pseudo-headers (`:path`) included.
    pub name: String,
    /// The value.
    pub value: String,
}

/// `--header`: `name:value` (a pseudo-header as `:path:/x`); blanks around the value are dropped.
///
/// # Errors
/// No `:`, an empty name, or a name with blanks or control characters.
pub fn parse_header(text: &str) -> Result<Header, String> {
    // A pseudo-header's name starts with its own `:`: the separator is the next one.
    let skip = usize::from(text.starts_with(':'));
    let at = text.get(skip..).and_then(|rest| rest.find(':')).map(|at| at + skip);
    let Some((name, value)) = at.and_then(|at| Some((text.get(..at)?, text.get(at + 1..)?))) else {
        return Err("expected name:value (e.g. x-user-id:alice)".to_string());
    };
    let name = name.trim();
    if name.is_empty() || name == ":" {
        return Err("the header name is empty".to_string());
    }
    if name.bytes().any(|b| b.is_ascii_whitespace() || b.is_ascii_control()) {
        return Err(format!("{name:?} is not a header name"));
    }
    Ok(Header { name: name.to_ascii_lowercase(), value: value.trim().to_string() })
}

/// `--client-ip`: an address with or without a port (`10.0.0.7`, `10.0.0.7:5555`, `2001:db8::7`,
/// `[2001:db8::7]:5555`), as `source.address` shows it: `ip:port` (port 0 when none is given).
///
/// # Errors
/// Not an IP address.
pub fn parse_client_ip(text: &str) -> Result<SocketAddr, String> {
    let text = text.trim();
    if let Ok(socket) = text.parse::<SocketAddr>() {
        return Ok(socket);
    }
    let bare = text.strip_prefix('[').and_then(|t| t.strip_suffix(']')).unwrap_or(text);
    bare.parse::<IpAddr>().map(|ip| SocketAddr::new(ip, 0)).map_err(|_| {
        "expected an IP address, with or without a port (10.0.0.7, 10.0.0.7:5555, [2001:db8::7]:5555)".into()
    })
}

/// A request as the options describe it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Request {
    /// The route name (`route_name` / `xds.route_name`), for `_rules_` selection.
    pub route: Option<String>,
    /// The headers, `:path` first and `:authority` next when given; of a name given twice the first
    /// counts (as the filter reads one value per name).
    pub headers: Vec<Header>,
    /// `source.address`: the client address and port.
    pub client_address: Option<String>,
}

impl Request {
    /// The request of `headers` with `path` as `:path` (default `/`: every request has one) and
    /// `authority` as `:authority` before them, from `client` on route `route`.
    pub fn new(
        headers: &[Header],
        path: Option<&str>,
        authority: Option<&str>,
        client: Option<SocketAddr>,
        route: Option<&str>,
    ) -> Self {
        let given = |name: &str| headers.iter().any(|header| header.name == name);
        let mut all = Vec::with_capacity(headers.len() + 2);
        match path {
            Some(path) => all.push(Header { name: ":path".into(), value: path.into() }),
            None if !given(":path") => all.push(Header { name: ":path".into(), value: "/".into() }),
            None => {}
        }
        if let Some(authority) = authority {
            all.push(Header { name: ":authority".into(), value: authority.into() });
        }
        all.extend(headers.iter().cloned());
        Request {
            route: route.map(str::to_string),
            headers: all,
            client_address: client.map(|address| address.to_string()),
        }
    }

    /// The `:authority`, for `_rules_` selection by domain.
    pub fn authority(&self) -> Option<&str> {
        self.value(":authority")
    }

    /// The first value of header `name` (lowercase).
    fn value(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|header| header.name == name).map(|header| header.value.as_str())
    }
}

impl RequestView for Request {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        self.value(name).map(|value| value.as_bytes().to_vec())
    }

    fn source_address(&self) -> Option<String> {
        self.client_address.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_split_at_the_first_colon_after_the_name() {
        let header = |name: &str, value: &str| Header { name: name.into(), value: value.into() };
        assert_eq!(parse_header("X-User-Id: alice"), Ok(header("x-user-id", "alice")));
        assert_eq!(parse_header("x-time:12:30"), Ok(header("x-time", "12:30")));
        assert_eq!(parse_header(":path:/a?b=c"), Ok(header(":path", "/a?b=c")));
        assert_eq!(parse_header("x-empty:"), Ok(header("x-empty", "")));
        assert!(parse_header("no-colon").is_err());
        assert!(parse_header(":value").is_err());
        assert!(parse_header(" :value").is_err());
        assert!(parse_header("x user:1").is_err());
    }

    #[test]
    fn client_addresses_take_an_optional_port() {
        assert_eq!(parse_client_ip("10.0.0.7").unwrap().to_string(), "10.0.0.7:0");
        assert_eq!(parse_client_ip("10.0.0.7:5555").unwrap().to_string(), "10.0.0.7:5555");
        assert_eq!(parse_client_ip("2001:db8::7").unwrap().to_string(), "[2001:db8::7]:0");
        assert_eq!(parse_client_ip("[2001:db8::7]").unwrap().to_string(), "[2001:db8::7]:0");
        assert_eq!(parse_client_ip("[2001:db8::7]:80").unwrap().to_string(), "[2001:db8::7]:80");
        assert!(parse_client_ip("gateway").is_err());
    }

    #[test]
    fn the_request_shows_path_authority_and_the_first_of_repeated_headers() {
        let headers = [parse_header("x-user-id:alice").unwrap(), parse_header("X-User-Id:bob").unwrap()];
        let client = parse_client_ip("10.0.0.7").ok();
        let request = Request::new(&headers, None, Some("api.example:8443"), client, Some("login"));
        assert_eq!(request.header(":path"), Some(b"/".to_vec()), "every request has a :path");
        assert_eq!(request.header("x-user-id"), Some(b"alice".to_vec()));
        assert_eq!(request.authority(), Some("api.example:8443"));
        assert_eq!(request.source_address().as_deref(), Some("10.0.0.7:0"));
        assert_eq!(request.header("cookie"), None);

        let path = [parse_header(":path:/given").unwrap()];
        assert_eq!(Request::new(&path, None, None, None, None).header(":path"), Some(b"/given".to_vec()));
        let both = Request::new(&path, Some("/option"), None, None, None);
        assert_eq!(both.header(":path"), Some(b"/option".to_vec()), "--path wins");
        assert_eq!(both.source_address(), None);
    }
}
