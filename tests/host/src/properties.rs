//! `proxy_get_property`: the attributes Envoy exposes, encoded as Envoy encodes them.
//!
//! Envoy (`Context::getProperty`, `serializeValue`): the path is NUL-separated segments; strings are
//! their bytes, integers 8-byte little-endian, maps header-pair encoded. Observed in Envoy 1.40
//! (`probe/envoy-1.40-observed.txt`): `source.address` `127.0.0.1:35270`, `source.port` 8-byte LE,
//! `destination.address`, `request.path`, `request.url_path`, `request.host`, `request.method`,
//! `request.scheme`, `request.protocol` (`HTTP/1.1`), `request.id` (the `x-request-id`),
//! `request.headers.<name>`, `connection_id` (u64 LE), `xds.route_name`, `xds.cluster_name`,
//! `plugin_name`, `plugin_root_id`, `plugin_vm_id`; `response.code` only once a response started;
//! `upstream.address` NotFound before the upstream; in the root context only the `plugin_*` ones.
//!
//! `route_name` and `cluster_name` (top level) answer NotFound in stock Envoy 1.40 but are set by Higress's
//! Envoy, whose SDKs read them; this host serves them like Higress unless
//! [`crate::HostBuilder::higress_properties`] is turned off. Properties given to the builder override all
//! of these.

use crate::abi::{encode_pairs, split_property_path, Status};
use crate::vm::{StreamData, VmState};

/// The value of a property for the context the hostcall acts on.
pub fn lookup(state: &VmState, path: &[u8]) -> Result<Vec<u8>, Status> {
    let parts = split_property_path(path);
    let dotted = parts.iter().map(|p| String::from_utf8_lossy(p).into_owned()).collect::<Vec<_>>().join(".");
    if let Some(value) = state.setup.properties.get(&dotted) {
        return Ok(value.clone());
    }
    let Some((first, rest)) = parts.split_first() else {
        return Err(Status::NotFound);
    };
    let plugin = match *first {
        b"plugin_name" => Some(state.setup.plugin_name.as_bytes().to_vec()),
        b"plugin_root_id" => Some(state.setup.root_id.as_bytes().to_vec()),
        b"plugin_vm_id" => Some(state.setup.vm_id.as_bytes().to_vec()),
        _ => None,
    };
    if let Some(value) = plugin {
        return if rest.is_empty() { Ok(value) } else { Err(Status::NotFound) };
    }
    let stream = state.stream().ok_or(Status::NotFound)?;
    if let Some(value) = stream.info.filter_state.get(path.strip_suffix(b"\0").unwrap_or(path)) {
        return Ok(value.clone());
    }
    let setup = &state.setup;
    let value = match (*first, rest) {
        (b"source", [b"address"]) => stream.info.source_address.as_bytes().to_vec(),
        (b"source", [b"port"]) => int(port_of(&stream.info.source_address)?),
        (b"destination", [b"address"]) => setup.destination_address.as_bytes().to_vec(),
        (b"destination", [b"port"]) => int(port_of(&setup.destination_address)?),
        (b"connection_id", []) => stream.info.connection_id.to_le_bytes().to_vec(),
        (b"xds", [b"route_name"]) => stream.info.route_name.as_bytes().to_vec(),
        (b"route_name", []) if setup.higress_properties => stream.info.route_name.as_bytes().to_vec(),
        (b"xds", [b"cluster_name"]) => b"upstream".to_vec(),
        (b"cluster_name", []) if setup.higress_properties => b"upstream".to_vec(),
        (b"request", rest) => request_attribute(stream, rest)?,
        (b"response", [b"code"]) => int(i64::from(stream.info.response_code.ok_or(Status::NotFound)?)),
        (b"response", [b"headers", name]) if stream.info.response_code.is_some() => {
            first_header(&stream.response_headers, name)?
        }
        (b"upstream", [b"address"]) => stream.info.upstream_address.clone().ok_or(Status::NotFound)?.into_bytes(),
        _ => return Err(Status::NotFound),
    };
    Ok(value)
}

fn request_attribute(stream: &StreamData, rest: &[&[u8]]) -> Result<Vec<u8>, Status> {
    let headers = &stream.request_headers;
    let path = first_header(headers, b":path");
    Ok(match rest {
        [b"path"] => path?,
        [b"url_path"] => {
            let path = path?;
            let end = path.iter().position(|&b| b == b'?').unwrap_or(path.len());
            path.get(..end).unwrap_or_default().to_vec()
        }
        [b"query"] => {
            let path = path?;
            match path.iter().position(|&b| b == b'?') {
                Some(at) => path.get(at + 1..).unwrap_or_default().to_vec(),
                None => Vec::new(),
            }
        }
        [b"host"] => first_header(headers, b":authority")?,
        [b"method"] => first_header(headers, b":method")?,
        [b"scheme"] => first_header(headers, b":scheme")?,
        [b"protocol"] => b"HTTP/1.1".to_vec(),
        [b"id"] => first_header(headers, b"x-request-id")?,
        [b"referer"] => first_header(headers, b"referer")?,
        [b"useragent"] => first_header(headers, b"user-agent")?,
        [b"headers"] => encode_pairs(headers),
        [b"headers", name] => first_header(headers, name)?,
        _ => return Err(Status::NotFound),
    })
}

fn first_header(headers: &[(Vec<u8>, Vec<u8>)], name: &[u8]) -> Result<Vec<u8>, Status> {
    let name = name.to_ascii_lowercase();
    headers.iter().find(|(k, _)| *k == name).map(|(_, v)| v.clone()).ok_or(Status::NotFound)
}

fn port_of(address: &str) -> Result<i64, Status> {
    address.rsplit_once(':').and_then(|(_, port)| port.parse::<i64>().ok()).ok_or(Status::NotFound)
}

fn int(value: i64) -> Vec<u8> {
    value.to_le_bytes().to_vec()
}
