//! webdis, the HTTP-to-Redis bridge the stock build reaches with `dispatch_http_call` (DESIGN.md, "Facts:
//! webdis"), in front of a [`RedisServer`].

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use crate::process::{free_port, loopback, wait_until, ProcessGuard, TempDir};
use crate::redis::RedisServer;

/// How long webdis may take to answer `GET /PING`.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// A `webdis` process on a free loopback port (JSON config and log in its own temporary directory), its
/// Redis the given server (with its password); stopped by PID when dropped.
#[derive(Debug)]
pub struct Webdis {
    port: u16,
    _process: ProcessGuard,
    _dir: TempDir,
}

impl Webdis {
    /// Starts webdis for `redis` and waits (at most 10 s) until `GET /PING` answers `PONG`.
    ///
    /// # Errors
    /// `webdis` cannot be started (not installed), its config cannot be written, or it never answers.
    pub fn start(redis: &RedisServer) -> io::Result<Self> {
        let dir = TempDir::new("webdis")?;
        let port = free_port()?;
        let config = serde_json::json!({
            "redis_host": "127.0.0.1",
            "redis_port": redis.port(),
            "redis_auth": redis.password(),
            "http_host": "127.0.0.1",
            "http_port": port,
            "threads": 2,
            "pool_size": 4,
            "daemonize": false,
            "websockets": false,
            "database": 0,
            "verbosity": 1,
            "logfile": dir.path().join("webdis.log"),
        });
        let path = dir.path().join("webdis.json");
        std::fs::write(&path, config.to_string())?;
        let process = ProcessGuard::spawn("webdis", Command::new("webdis").arg(&path))?;
        let webdis = Webdis { port, _process: process, _dir: dir };
        wait_until(START_TIMEOUT, "webdis to answer GET /PING", || {
            http_get(port, "/PING").is_some_and(|body| body.contains("PONG"))
        })?;
        Ok(webdis)
    }

    /// Its HTTP port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }
}

/// A minimal HTTP/1.1 `GET` on 127.0.0.1 (`connection: close`, 2 s read timeout): the response body, if
/// a server answered.
pub fn http_get(port: u16, path: &str) -> Option<String> {
    let mut stream = TcpStream::connect_timeout(&loopback(port), Duration::from_millis(500)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(stream, "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    text.split_once("\r\n\r\n").map(|(_, body)| body.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn webdis_reaches_its_redis_with_the_password() {
        let redis = RedisServer::start_with_password(Some("pw")).unwrap();
        let webdis = Webdis::start(&redis).unwrap();
        assert!(http_get(webdis.port(), "/SET/k/v").unwrap().contains("OK"));
        assert_eq!(redis.command(&[b"GET", b"k"]).unwrap(), b"$1\r\nv\r\n");
    }
}
