//! Ports, bounded waits, child processes stopped by PID, temporary directories.

use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How often [`wait_until`] checks.
const POLL: Duration = Duration::from_millis(20);
/// How long a killed child may take to be reaped.
const REAP_TIMEOUT: Duration = Duration::from_secs(5);

/// A free TCP port on 127.0.0.1: the kernel picks one for a listener that is closed at once. Another
/// process may take it before the caller binds it (a small race: fixtures retry on another port).
///
/// # Errors
/// The bind failing (no loopback interface).
pub fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()?.port())
}

/// `127.0.0.1:port`.
pub fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, port))
}

/// Calls `check` every 20 ms until it holds, for at most `timeout`.
///
/// # Errors
/// [`io::ErrorKind::TimedOut`], naming `what`, if it never held.
pub fn wait_until(timeout: Duration, what: &str, mut check: impl FnMut() -> bool) -> io::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if check() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("timed out after {timeout:?} waiting for {what}"),
            ));
        }
        std::thread::sleep(POLL);
    }
}

/// A directory under the system's temp directory, removed with its contents when dropped.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    /// Creates `<tmp>/erl-test-<tag>-<pid>-<n>`.
    ///
    /// # Errors
    /// The directory cannot be created.
    pub fn new(tag: &str) -> io::Result<Self> {
        static COUNT: AtomicUsize = AtomicUsize::new(0);
        let n = COUNT.fetch_add(1, Ordering::SeqCst);
        let path = std::env::temp_dir().join(format!("erl-test-{tag}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&path)?;
        Ok(TempDir(path))
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A child process (stdin, stdout and stderr to /dev/null unless the command says otherwise) that is
/// killed by its PID (`SIGKILL` to that PID only, never by name) and reaped when stopped or dropped, also
/// when a test panics.
#[derive(Debug)]
pub struct ProcessGuard {
    name: String,
    child: Child,
    status: Option<ExitStatus>,
}

impl ProcessGuard {
    /// Starts `command` with its standard streams on /dev/null.
    ///
    /// # Errors
    /// The program cannot be started (e.g. not installed); the error names it.
    pub fn spawn(name: &str, command: &mut Command) -> io::Result<Self> {
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| io::Error::new(e.kind(), format!("cannot start {name}: {e}")))?;
        Ok(ProcessGuard { name: name.to_string(), child, status: None })
    }

    /// The name it was started with.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its PID.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it has exited (reaping it if so).
    pub fn exited(&mut self) -> bool {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status.is_some()
    }

    /// Kills it by PID and waits (at most 5 s) until it is reaped; its exit status if it was. Idempotent.
    pub fn stop(&mut self) -> Option<ExitStatus> {
        if self.exited() {
            return self.status;
        }
        let _ = self.child.kill();
        let deadline = Instant::now() + REAP_TIMEOUT;
        while !self.exited() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        self.status
    }
}

impl Drop for ProcessGuard {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guard_stops_its_process_by_pid() {
        let mut guard = ProcessGuard::spawn("sleep", Command::new("sleep").arg("30")).unwrap();
        assert!(!guard.exited());
        let pid = guard.pid();
        assert!(Path::new(&format!("/proc/{pid}")).exists());
        assert!(guard.stop().is_some(), "reaped");
        assert!(guard.exited());
        assert!(ProcessGuard::spawn("nope", &mut Command::new("/nonexistent/program")).is_err());
    }

    #[test]
    fn waits_are_bounded_and_temp_dirs_go_away() {
        let started = Instant::now();
        let error = wait_until(Duration::from_millis(100), "never", || false).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert!(error.to_string().contains("never"));
        assert!(started.elapsed() < Duration::from_secs(2));
        let dir = TempDir::new("self-test").unwrap();
        let path = dir.path().to_path_buf();
        std::fs::write(path.join("f"), b"x").unwrap();
        drop(dir);
        assert!(!path.exists());
        assert_ne!(free_port().unwrap(), 0);
    }
}
