//! A real `redis-server` per test, started by the shared test support crate (`erl-test-support`: a free
//! loopback port, ready once it answers `PING` within a bounded wait, stopped by PID when the fixture is
//! dropped, also when the test panics). Plus the two ways the tests talk to it: [`ScriptClient`] sends the
//! crate's own commands as their RESP bytes and decodes the replies with the crate's decoder (what the
//! host-redis transport does), and [`RedisServer::inspector`] is a `redis` crate connection for reading and
//! ageing keys independently of the crate under test.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use edge_rate_limiter::key::LimiterKeys;
use edge_rate_limiter::resp::{decode_reply, Command, Reply, RespError};
use edge_rate_limiter::script::{Invocation, Script};
use redis::io::tcp::TcpSettings;
use redis::IntoConnectionInfo;

/// How long a reply may take before the test calls it a hang.
const REPLY_TIMEOUT: Duration = Duration::from_secs(5);

/// The support crate's `redis-server` (Redis 7.0 from Debian: Lua 5.1 with `struct`), no persistence, with
/// the parity tests' two clients.
pub struct RedisServer(erl_test_support::RedisServer);

impl RedisServer {
    /// Starts a server on a free loopback port and waits until it answers `PING`.
    ///
    /// # Panics
    /// When no server comes up (`redis-server` missing, or no answer on 5 free ports within 10 s each).
    pub fn start() -> Self {
        RedisServer(erl_test_support::RedisServer::start().expect("start a test redis-server"))
    }

    /// A client for the crate's commands.
    pub fn script_client(&self) -> ScriptClient {
        ScriptClient::connect(self.0.port()).expect("connect to the test redis-server")
    }

    /// A `redis` crate connection (TCP_NODELAY) for reading and writing keys directly.
    pub fn inspector(&self) -> redis::Connection {
        let info = format!("redis://127.0.0.1:{}/", self.0.port())
            .into_connection_info()
            .unwrap()
            .set_tcp_settings(TcpSettings::default().set_nodelay(true));
        redis::Client::open(info).unwrap().get_connection().unwrap()
    }
}

/// A plain TCP connection that writes a [`Command`]'s RESP bytes ([`Command::to_resp`]) and reads exactly
/// one reply with [`decode_reply`]: the same bytes the filter sends through the host's Redis interface.
pub struct ScriptClient {
    stream: TcpStream,
}

impl ScriptClient {
    fn connect(port: u16) -> std::io::Result<Self> {
        let stream = TcpStream::connect(("127.0.0.1", port))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(REPLY_TIMEOUT))?;
        Ok(ScriptClient { stream })
    }

    /// Sends one command and returns its reply.
    ///
    /// # Panics
    /// On I/O errors, on no reply within [`REPLY_TIMEOUT`], on bytes that are not one RESP reply.
    pub fn call(&mut self, command: &Command) -> Reply {
        let raw = self.call_raw(&command.to_resp());
        decode_reply(&raw).unwrap_or_else(|e| panic!("not one RESP reply: {e}"))
    }

    /// Sends one command's RESP bytes and returns its reply's bytes (exactly one reply).
    ///
    /// # Panics
    /// As [`ScriptClient::call`].
    pub fn call_raw(&mut self, command: &[u8]) -> Vec<u8> {
        self.stream.write_all(command).expect("send the command");
        let mut buffer = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let read =
                self.stream.read(&mut chunk).unwrap_or_else(|e| panic!("no reply within {REPLY_TIMEOUT:?}: {e}"));
            assert!(read > 0, "redis-server closed the connection");
            buffer.extend_from_slice(&chunk[..read]);
            match decode_reply(&buffer) {
                Ok(_) => return buffer,
                Err(RespError::Truncated) => continue,
                Err(other) => panic!("not one RESP reply: {other}"),
            }
        }
    }

    /// Runs `script` as the filter does: `EVALSHA`, then `EVAL` with the source after `NOSCRIPT`.
    pub fn run(&mut self, script: &Script, keys: &LimiterKeys, args: &[&[u8]]) -> Reply {
        let reply = self.call(&script.command(Invocation::BySha, keys, args));
        if reply.error_code() == Some("NOSCRIPT") {
            return self.call(&script.command(Invocation::BySource, keys, args));
        }
        reply
    }

    /// Sends an encoded command (e.g. [`edge_rate_limiter::script::AcquireTemplate::encode`]) the same way;
    /// returns the reply's bytes.
    pub fn run_raw(&mut self, by_sha: &[u8], by_source: impl FnOnce() -> Vec<u8>) -> Vec<u8> {
        let reply = self.call_raw(by_sha);
        if reply.starts_with(b"-NOSCRIPT") {
            return self.call_raw(&by_source());
        }
        reply
    }

    /// Sends a command built elsewhere (e.g. [`edge_rate_limiter::script::AcquireTemplate::command`]) the same
    /// way.
    pub fn run_command(&mut self, by_sha: &Command, by_source: impl FnOnce() -> Command) -> Reply {
        let reply = self.call(by_sha);
        if reply.error_code() == Some("NOSCRIPT") {
            return self.call(&by_source());
        }
        reply
    }
}
