//! The Higress Redis extension: `proxy_redis_init`, `proxy_redis_call` and the guest export
//! `proxy_on_redis_call_response`, backed by real TCP connections to a real Redis.
//!
//! Facts (DESIGN.md "Facts: the Higress host Redis interface"; Higress's Envoy fork
//! `source/common/redis/async_client_impl.cc` and Envoy's
//! `source/extensions/filters/network/common/redis/raw_client_impl.cc`, which it uses):
//! - `service` is a cluster name, optionally followed by `?db=N`; one client per VM per cluster;
//!   `proxy_redis_init` with the same settings again changes nothing (Higress #4086), with other settings
//!   it closes the client's connection;
//! - on every new connection the client first sends `AUTH [username] password` (if a password or username
//!   is set) and `SELECT N` (if `db` is given); their replies are dropped (null callbacks), so a wrong
//!   password shows as `-NOAUTH` (or the like) on the guest's own command;
//! - the query bytes are written verbatim; one RESP reply per call, in order (pipelining);
//! - the per-operation timeout runs while replies are outstanding: it starts when the pipeline goes from
//!   empty to busy (or on connect) and restarts at every reply; when it fires the connection is closed and
//!   every pending call fails with status 1 and no bytes; a refused or closed connection fails them too;
//! - return codes: 0 Ok; 2 BadArgument (no such cluster, or a cluster `proxy_redis_init` was not called for);
//!   10 InternalFailure; error replies (`-NOAUTH`, `-NOSCRIPT`, ...) are status 0 with the raw RESP;
//! - the reply is delivered as `proxy_on_redis_call_response(root_context_id, token, status, size)`, its
//!   bytes readable with buffer type 9 during that callback only.
//!
//! - a cluster of type `envoy.clusters.redis` (a Redis Cluster) is accepted by `proxy_redis_init`, but every
//!   `proxy_redis_call` on it fails at once with InternalFailure (10) and no callback: Higress's client
//!   picks the host with an empty load-balancer context, `AsyncClientImpl::send` in
//!   `source/common/redis/async_client_impl.cc` (`Upstream::LoadBalancerContextBase lb_context;
//!   chooseHost(&lb_context)`, null host -> `send` returns nullptr), the Redis Cluster load balancer returns
//!   no host without a hash key (`RedisClusterLoadBalancer::chooseHost` in
//!   `source/extensions/clusters/redis/redis_cluster_lb.cc`: `if (!hash) return nullptr;`), and
//!   `Context::redisCall` (`source/extensions/common/wasm/context.cc`) turns that into
//!   `WasmResult::InternalFailure` (higress-group/envoy, branch envoy-1.27, e9302f5574). The query is never
//!   parsed for a key;
//! - no redirection: `-MOVED` / `-ASK` replies reach the guest as they are, status 0
//!   (`ConfigImpl::enableRedirection()` is false in `async_client_impl.h`; `RawClientImpl::onRawResponse`,
//!   "do not handle redirection here"), and nothing refreshes a slot map. A plain cluster pointed at a
//!   Redis Cluster node therefore serves only the slots of that node. Higress's maintainers advise a Redis
//!   proxy in front of a Redis Cluster (higress-group/higress #2096, #2132).
//!
//! Not emulated: the 3 ms write buffering of Envoy's client (queries are written at once), the cluster's
//! connect timeout (connections are made synchronously on the loopback).

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::engine::Imports;

use crate::abi::{LogLevel, Status};
use crate::faults::CallKind;
use crate::hostcalls::{link_hostcall, start_call};
use crate::memory::read;
use crate::shared::{lock, LogSource};
use crate::vm::{Event, VmState};

/// How often a connection's reader looks at its deadline while it waits for bytes.
const POLL: Duration = Duration::from_millis(5);

/// Status of a failed call (timeout, refused or closed connection).
pub const NETWORK_ERROR: u32 = 1;

/// A `service` string split: the cluster, and the `db` parameter if any.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Service {
    /// The cluster name.
    pub cluster: String,
    /// `?db=N`.
    pub db: Option<String>,
}

impl Service {
    /// Parses `cluster[?db=N[&...]]`.
    pub fn parse(service: &str) -> Self {
        let (cluster, query) = service.split_once('?').unwrap_or((service, ""));
        let db =
            query.split('&').filter_map(|kv| kv.split_once('=')).find(|(k, _)| *k == "db").map(|(_, v)| v.to_string());
        Service { cluster: cluster.to_string(), db }
    }
}

/// Where a client's calls go.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Upstream {
    /// A cluster with one endpoint: every call goes to it.
    Host(SocketAddr),
    /// A cluster of type `envoy.clusters.redis`: no call gets a host (see the module docs).
    RedisCluster,
}

/// The settings of one client.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Settings {
    upstream: Upstream,
    username: Vec<u8>,
    password: Vec<u8>,
    db: Option<String>,
    timeout: Duration,
}

/// The Redis clients of one VM, by cluster.
#[derive(Default)]
pub struct RedisClients {
    clients: HashMap<String, Client>,
}

struct Client {
    settings: Settings,
    connection: Option<Arc<Connection>>,
}

impl Drop for Client {
    fn drop(&mut self) {
        if let Some(connection) = self.connection.take() {
            connection.close();
        }
    }
}

/// One TCP connection; its reader thread delivers replies in order.
struct Connection {
    writer: Mutex<TcpStream>,
    state: Mutex<Pipeline>,
    timeout: Duration,
    vm: usize,
    events: Sender<Event>,
}

#[derive(Default)]
struct Pipeline {
    /// Outstanding replies in order: a token, or `None` for AUTH/SELECT.
    pending: VecDeque<Option<u32>>,
    deadline: Option<Instant>,
    closed: bool,
}

impl Connection {
    fn open(
        settings: &Settings,
        address: SocketAddr,
        connect_timeout: Duration,
        vm: usize,
        events: Sender<Event>,
    ) -> std::io::Result<Arc<Self>> {
        let stream = TcpStream::connect_timeout(&address, connect_timeout)?;
        let _ = stream.set_nodelay(true);
        let reader = stream.try_clone()?;
        let connection = Arc::new(Connection {
            writer: Mutex::new(stream),
            state: Mutex::new(Pipeline::default()),
            timeout: settings.timeout,
            vm,
            events,
        });
        let for_reader = Arc::clone(&connection);
        std::thread::Builder::new()
            .name(format!("redis-{vm}-{address}"))
            .spawn(move || for_reader.read_replies(reader))?;
        // Envoy `RawClientImpl::initialize`: AUTH and SELECT go first, their replies are dropped.
        let mut hello = Vec::new();
        if !settings.username.is_empty() {
            hello.push(command(&[b"AUTH", &settings.username, &settings.password]));
        } else if !settings.password.is_empty() {
            hello.push(command(&[b"AUTH", &settings.password]));
        }
        if let Some(db) = &settings.db {
            hello.push(command(&[b"SELECT", db.as_bytes()]));
        }
        for bytes in hello {
            connection.send(None, &bytes);
        }
        Ok(connection)
    }

    fn is_closed(&self) -> bool {
        lock(&self.state).closed
    }

    /// Queues a reply slot and writes the bytes; a write error fails the pipeline.
    fn send(&self, token: Option<u32>, bytes: &[u8]) {
        {
            let mut state = lock(&self.state);
            if state.closed {
                drop(state);
                self.fail(token);
                return;
            }
            if state.pending.is_empty() {
                state.deadline = Some(Instant::now() + self.timeout);
            }
            state.pending.push_back(token);
        }
        let written = lock(&self.writer).write_all(bytes);
        if written.is_err() {
            self.close();
        }
    }

    fn fail(&self, token: Option<u32>) {
        if let Some(token) = token {
            let _ = self.events.send(Event::Redis { vm: self.vm, token, status: NETWORK_ERROR, reply: Vec::new() });
        }
    }

    /// Closes the connection and fails every pending call, in order.
    fn close(&self) {
        let pending = {
            let mut state = lock(&self.state);
            state.closed = true;
            state.deadline = None;
            std::mem::take(&mut state.pending)
        };
        let _ = lock(&self.writer).shutdown(Shutdown::Both);
        for token in pending {
            self.fail(token);
        }
    }

    fn read_replies(&self, mut reader: TcpStream) {
        let mut buffer: Vec<u8> = Vec::new();
        let mut chunk = vec![0u8; 64 * 1024];
        loop {
            let wait = {
                let state = lock(&self.state);
                if state.closed {
                    return;
                }
                match state.deadline {
                    Some(deadline) => deadline.saturating_duration_since(Instant::now()).min(POLL),
                    None => POLL,
                }
            };
            if wait.is_zero() {
                // The operation timed out: Envoy closes the connection.
                self.close();
                return;
            }
            if reader.set_read_timeout(Some(wait)).is_err() {
                self.close();
                return;
            }
            match reader.read(&mut chunk) {
                Ok(0) => {
                    self.close();
                    return;
                }
                Ok(n) => {
                    buffer.extend_from_slice(chunk.get(..n).unwrap_or_default());
                    if !self.deliver(&mut buffer) {
                        self.close();
                        return;
                    }
                }
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => {}
                Err(_) => {
                    self.close();
                    return;
                }
            }
        }
    }

    /// Hands every complete reply in `buffer` to its call; false on a protocol error.
    fn deliver(&self, buffer: &mut Vec<u8>) -> bool {
        loop {
            let used = match redis_protocol::resp2::decode::decode_range(buffer) {
                Ok(Some((_, used))) => used,
                Ok(None) => return true,
                Err(_) => return false,
            };
            let reply: Vec<u8> = buffer.drain(..used).collect();
            let token = {
                let mut state = lock(&self.state);
                let Some(slot) = state.pending.pop_front() else { return false };
                state.deadline = (!state.pending.is_empty()).then(|| Instant::now() + self.timeout);
                slot
            };
            if let Some(token) = token {
                let _ = self.events.send(Event::Redis { vm: self.vm, token, status: 0, reply });
            }
        }
    }
}

/// One RESP array of bulk strings.
fn command(args: &[&[u8]]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for arg in args {
        out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
    out
}

impl RedisClients {
    /// `proxy_redis_init`.
    fn init(
        &mut self,
        upstream: Upstream,
        service: &Service,
        username: Vec<u8>,
        password: Vec<u8>,
        timeout: Duration,
    ) -> Result<(), Status> {
        let settings = Settings { upstream, username, password, db: service.db.clone(), timeout };
        match self.clients.get_mut(&service.cluster) {
            Some(client) if client.settings == settings => {}
            Some(client) => {
                if let Some(connection) = client.connection.take() {
                    connection.close();
                }
                client.settings = settings;
            }
            None => {
                self.clients.insert(service.cluster.clone(), Client { settings, connection: None });
            }
        }
        Ok(())
    }
}

/// Adds `proxy_redis_init` and `proxy_redis_call`.
pub fn link(linker: &mut Imports) -> Result<(), crate::engine::Error> {
    link_hostcall!(linker, fn proxy_redis_init(c, service_ptr: u32, service_size: u32, username_ptr: u32,
            username_size: u32, password_ptr: u32, password_size: u32, timeout_ms: u32) {
        let service = Service::parse(&String::from_utf8_lossy(&read(c, service_ptr, service_size)?));
        let username = read(c, username_ptr, username_size)?;
        let password = read(c, password_ptr, password_size)?;
        let state = c.data_mut();
        let upstream = match state.setup.clusters.get(&service.cluster) {
            Some(address) => Upstream::Host(*address),
            None if state.setup.redis_clusters.contains_key(&service.cluster) => Upstream::RedisCluster,
            None => return Err(Status::BadArgument.into()),
        };
        let timeout = Duration::from_millis(u64::from(timeout_ms));
        Ok(state.redis.init(upstream, &service, username, password, timeout)?)
    });
    link_hostcall!(linker, fn proxy_redis_call(c, service_ptr: u32, service_size: u32, query_ptr: u32, query_size: u32,
            token_ptr: u32) {
        let service = Service::parse(&String::from_utf8_lossy(&read(c, service_ptr, service_size)?));
        let query = read(c, query_ptr, query_size)?;
        start_call(c, token_ptr, |state| call(state, &service, &query))
    });
    Ok(())
}

/// Sends a query for the VM: connects if needed, queues the reply slot, writes the bytes.
fn call(state: &mut VmState, service: &Service, query: &[u8]) -> Result<u32, Status> {
    let address = match state.redis.clients.get(&service.cluster).map(|client| &client.settings.upstream) {
        None => return Err(Status::BadArgument),
        Some(Upstream::Host(address)) => *address,
        Some(Upstream::RedisCluster) => {
            // Envoy logs "no available host" at debug; the hostcall answers InternalFailure, no callback.
            state.log(LogLevel::Debug, LogSource::Host, "no available host".to_string());
            return Err(Status::InternalFailure);
        }
    };
    let owner = state.owner_stream();
    let token = state.allocate_token(owner, CallKind::Redis);
    if let Some(stream) = owner.and_then(|id| state.stream_by_id(id)) {
        stream.redis_calls += 1;
    }
    let (vm, events, connect_timeout) = (state.vm, state.events.clone(), state.setup.redis_connect_timeout);
    let shared = Arc::clone(&state.shared);
    let Some(client) = state.redis.clients.get_mut(&service.cluster) else { return Err(Status::BadArgument) };
    let connection = match &client.connection {
        Some(connection) if !connection.is_closed() => Arc::clone(connection),
        _ => match Connection::open(&client.settings, address, connect_timeout, vm, events.clone()) {
            Ok(connection) => {
                client.connection = Some(Arc::clone(&connection));
                connection
            }
            Err(error) => {
                // Envoy queues the call on a connecting client; the failed connection fails it.
                shared.log(
                    Some(vm),
                    LogLevel::Debug,
                    0,
                    LogSource::Host,
                    format!("redis cluster {:?} ({address}): connection failed: {error}", service.cluster),
                );
                client.connection = None;
                let _ = events.send(Event::Redis { vm, token, status: NETWORK_ERROR, reply: Vec::new() });
                return Ok(token);
            }
        },
    };
    connection.send(Some(token), query);
    Ok(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn services_split_off_the_database() {
        assert_eq!(
            Service::parse("outbound|6379||redis.static?db=2"),
            Service { cluster: "outbound|6379||redis.static".into(), db: Some("2".into()) }
        );
        assert_eq!(Service::parse("redis"), Service { cluster: "redis".into(), db: None });
    }

    #[test]
    fn commands_are_resp_arrays() {
        assert_eq!(command(&[b"AUTH", b"pw"]), b"*2\r\n$4\r\nAUTH\r\n$2\r\npw\r\n".to_vec());
    }
}
