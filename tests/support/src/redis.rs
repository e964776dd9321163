//! A throw-away `redis-server` per test, and raw RESP commands to it.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::Duration;

use redis_protocol::resp2::encode::encode;
use redis_protocol::resp2::types::{OwnedFrame, Resp2Frame};

use crate::process::{free_port, loopback, wait_until, ProcessGuard, TempDir};

/// How long a server may take to answer its first `PING`.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a command's reply may take.
const REPLY_TIMEOUT: Duration = Duration::from_secs(5);
/// Free ports tried before giving up (another process may take a port between the probe and the bind).
const PORT_ATTEMPTS: usize = 5;

/// A `redis-server` (Debian's 7.0: Lua 5.1 with `struct`) on 127.0.0.1, without persistence
/// (`--save '' --appendonly no`), in its own temporary directory; stopped by PID when dropped.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    password: Option<String>,
    dir: TempDir,
    process: Option<ProcessGuard>,
}

impl RedisServer {
    /// Starts a server on a free loopback port and waits (at most 10 s) until it answers `PING`.
    ///
    /// # Errors
    /// `redis-server` cannot be started (not installed), or no server answered on any of 5 free ports.
    pub fn start() -> io::Result<Self> {
        Self::start_with_password(None)
    }

    /// [`RedisServer::start`] with `--requirepass` when a password is given (commands sent through
    /// [`RedisServer::command`] authenticate first).
    ///
    /// # Errors
    /// As [`RedisServer::start`].
    pub fn start_with_password(password: Option<&str>) -> io::Result<Self> {
        let dir = TempDir::new("redis")?;
        let mut server = RedisServer { port: 0, password: password.map(str::to_string), dir, process: None };
        let mut last = io::Error::other("no attempt made");
        for _ in 0..PORT_ATTEMPTS {
            server.port = free_port()?;
            match server.spawn() {
                Ok(()) => return Ok(server),
                Err(error) if error.kind() == io::ErrorKind::NotFound => return Err(error),
                Err(error) => last = error,
            }
        }
        Err(io::Error::new(last.kind(), format!("redis-server did not come up on {PORT_ATTEMPTS} free ports: {last}")))
    }

    /// Starts the process on `self.port` and waits for `PING`; a process that exits first (the port was
    /// taken) or never answers is an error.
    fn spawn(&mut self) -> io::Result<()> {
        let mut command = Command::new("redis-server");
        command
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--daemonize", "no"])
            .arg("--dir")
            .arg(self.dir.path());
        if let Some(password) = &self.password {
            command.args(["--requirepass", password]);
        }
        let mut process = ProcessGuard::spawn("redis-server", &mut command)?;
        let mut exited = false;
        let ready = wait_until(START_TIMEOUT, &format!("redis-server on port {} to answer PING", self.port), || {
            exited = process.exited();
            exited || self.command(&[b"PING"]).is_ok_and(|reply| reply.starts_with(b"+PONG"))
        });
        match (ready, exited) {
            (Ok(()), false) => {
                self.process = Some(process);
                Ok(())
            }
            (Ok(()), true) => Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("redis-server exited at start (port {} taken?)", self.port),
            )),
            (Err(error), _) => Err(error),
        }
    }

    /// Its port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:port`.
    pub fn address(&self) -> SocketAddr {
        loopback(self.port)
    }

    /// The `requirepass` password, if any.
    pub fn password(&self) -> Option<&str> {
        self.password.as_deref()
    }

    /// The server's PID while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(ProcessGuard::pid)
    }

    /// One command on a fresh connection (`AUTH` first if there is a password); the raw RESP reply
    /// (an error reply such as `-ERR ...` is a reply, not an error).
    ///
    /// # Errors
    /// Connecting, writing, or no complete reply within 5 s.
    pub fn command(&self, args: &[&[u8]]) -> io::Result<Vec<u8>> {
        self.session(None, args)
    }

    /// [`RedisServer::command`] in database `db` (`SELECT db` first).
    ///
    /// # Errors
    /// As [`RedisServer::command`].
    pub fn command_in_db(&self, db: u32, args: &[&[u8]]) -> io::Result<Vec<u8>> {
        self.session(Some(db), args)
    }

    fn session(&self, db: Option<u32>, args: &[&[u8]]) -> io::Result<Vec<u8>> {
        let mut stream = TcpStream::connect_timeout(&self.address(), Duration::from_secs(1))?;
        stream.set_read_timeout(Some(REPLY_TIMEOUT))?;
        let db = db.map(|db| db.to_string());
        let auth = self.password.as_ref().map(|pw| resp(&[b"AUTH", pw.as_bytes()]));
        let select = db.as_ref().map(|db| resp(&[b"SELECT", db.as_bytes()]));
        for preamble in [auth, select].into_iter().flatten() {
            stream.write_all(&preamble)?;
            read_reply(&mut stream)?;
        }
        stream.write_all(&resp(args))?;
        read_reply(&mut stream)
    }

    /// A connection that stays open (`AUTH` first if there is a password), for callers that send many
    /// commands, or send commands already encoded as RESP ([`Connection::raw`]).
    ///
    /// # Errors
    /// Connecting or authenticating.
    pub fn connect(&self) -> io::Result<Connection> {
        let mut stream = TcpStream::connect_timeout(&self.address(), Duration::from_secs(1))?;
        stream.set_read_timeout(Some(REPLY_TIMEOUT))?;
        stream.set_nodelay(true)?;
        if let Some(password) = &self.password {
            stream.write_all(&resp(&[b"AUTH", password.as_bytes()]))?;
            read_reply(&mut stream)?;
        }
        Ok(Connection { stream })
    }

    /// Stops the server (by PID), keeping its port and directory for [`RedisServer::restart`].
    pub fn stop(&mut self) {
        if let Some(mut process) = self.process.take() {
            process.stop();
        }
    }

    /// Starts the server again on the same port (stopping it first if it runs), with an empty dataset.
    ///
    /// # Errors
    /// The server does not come up on its port within 10 s.
    pub fn restart(&mut self) -> io::Result<()> {
        self.stop();
        self.spawn()
    }
}

/// An open connection to a [`RedisServer`] ([`RedisServer::connect`]).
#[derive(Debug)]
pub struct Connection {
    stream: TcpStream,
}

impl Connection {
    /// Writes `command`, already encoded as RESP (one command), and reads its raw RESP reply (an error
    /// reply such as `-ERR ...` is a reply, not an error).
    ///
    /// # Errors
    /// Writing, or no complete reply within 5 s.
    pub fn raw(&mut self, command: &[u8]) -> io::Result<Vec<u8>> {
        self.stream.write_all(command)?;
        read_reply(&mut self.stream)
    }

    /// One command given as its arguments ([`resp`]); the raw RESP reply.
    ///
    /// # Errors
    /// As [`Connection::raw`].
    pub fn command(&mut self, args: &[&[u8]]) -> io::Result<Vec<u8>> {
        self.raw(&resp(args))
    }
}

/// One command as a RESP array of bulk strings (what `redis-cli` sends).
pub fn resp(args: &[&[u8]]) -> Vec<u8> {
    let frame = OwnedFrame::Array(args.iter().map(|arg| OwnedFrame::BulkString(arg.to_vec())).collect());
    let mut out = vec![0u8; frame.encode_len(false)];
    match encode(&mut out, &frame, false) {
        Ok(used) => out.truncate(used),
        Err(_) => out.clear(),
    }
    out
}

/// Reads exactly one RESP reply (bounded by the stream's read timeout).
fn read_reply(stream: &mut TcpStream) -> io::Result<Vec<u8>> {
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match redis_protocol::resp2::decode::decode_range(&buffer) {
            Ok(Some((_, used))) => {
                buffer.truncate(used);
                return Ok(buffer);
            }
            Ok(None) => {}
            Err(error) => return Err(io::Error::new(io::ErrorKind::InvalidData, format!("not RESP: {error:?}"))),
        }
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "redis-server closed the connection"));
        }
        buffer.extend_from_slice(chunk.get(..n).unwrap_or_default());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_are_resp_arrays_of_bulk_strings() {
        assert_eq!(resp(&[b"AUTH", b"pw"]), b"*2\r\n$4\r\nAUTH\r\n$2\r\npw\r\n".to_vec());
    }

    #[test]
    fn a_server_answers_stops_and_restarts_on_its_port() {
        let mut redis = RedisServer::start().unwrap();
        let port = redis.port();
        assert_eq!(redis.command(&[b"SET", b"k", b"v"]).unwrap(), b"+OK\r\n");
        assert_eq!(redis.command_in_db(3, &[b"SET", b"k", b"in-3"]).unwrap(), b"+OK\r\n");
        assert_eq!(redis.command(&[b"GET", b"k"]).unwrap(), b"$1\r\nv\r\n");
        assert_eq!(redis.command_in_db(3, &[b"GET", b"k"]).unwrap(), b"$4\r\nin-3\r\n");
        let pid = redis.pid().unwrap();
        redis.stop();
        assert!(redis.pid().is_none());
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "stopped by PID and reaped");
        assert!(redis.command(&[b"PING"]).is_err());
        redis.restart().unwrap();
        assert_eq!(redis.port(), port);
        assert_eq!(redis.command(&[b"GET", b"k"]).unwrap(), b"$-1\r\n", "no persistence");
    }

    #[test]
    fn a_password_is_required_and_sent() {
        let redis = RedisServer::start_with_password(Some("s3cret")).unwrap();
        assert_eq!(redis.password(), Some("s3cret"));
        assert_eq!(redis.command(&[b"PING"]).unwrap(), b"+PONG\r\n");
        let mut raw = TcpStream::connect(redis.address()).unwrap();
        raw.set_read_timeout(Some(REPLY_TIMEOUT)).unwrap();
        raw.write_all(&resp(&[b"GET", b"k"])).unwrap();
        assert!(read_reply(&mut raw).unwrap().starts_with(b"-NOAUTH"));
    }
}
