//! The WASI preview1 functions Envoy provides, in both `wasi_snapshot_preview1` and `wasi_unstable`,
//! implemented as proxy-wasm-cpp-host does (`src/exports.cc`, `FOR_ALL_WASI_FUNCTIONS`): `fd_write` to
//! stdout/stderr becomes a log line (info/error, one trailing newline removed), other descriptors EBADF;
//! `fd_read` ENOSYS; `fd_seek`/`fd_close` succeed and do nothing; `fd_fdstat_get` only for 1 and 2;
//! no environment (Envoy's default) and no arguments; `clock_time_get` realtime (plus the host's clock
//! offset, [`crate::HostBuilder::clock_offset`]) and monotonic (real) only;
//! `random_get` up to 64 KiB; `proc_exit` only logs (it does not trap: the guest's following `unreachable`
//! does); `path_open` ENOENT; `fd_prestat_get` EBADF (no preopens); `fd_prestat_dir_name` ENOSYS.
//!
//! Anything else a module imports (`sched_yield`, `poll_oneoff`, `fd_fdstat_set_flags`...) is not provided,
//! so the module fails to load, as it fails in Envoy.

use std::sync::OnceLock;
use std::time::Instant;

use wasmtime::{Caller, Linker};

use crate::abi::{errno, LogLevel};
use crate::hostcalls::check_restricted;
use crate::memory::{read, write, write_u32, write_u64};
use crate::shared::{saturating_ns, LogSource};
use crate::vm::VmState;

type Call<'a> = Caller<'a, VmState>;

/// cpp-host `PROXY_WASM_HOST_WASI_RANDOM_GET_MAX_SIZE_BYTES`.
const RANDOM_GET_MAX: u32 = 64 * 1024;

/// WASI functions allowed while the VM starts (cpp-host `WasmBase::startVm`).
const ALLOWED_WHILE_STARTING: &[&str] = &[
    "fd_write",
    "args_sizes_get",
    "args_get",
    "environ_sizes_get",
    "environ_get",
    "fd_prestat_get",
    "fd_prestat_dir_name",
    "clock_time_get",
    "random_get",
];

fn check(c: &Call<'_>, name: &str) -> wasmtime::Result<()> {
    check_restricted(c, name, ALLOWED_WHILE_STARTING)
}

/// `environ_sizes_get` / `args_sizes_get`: no environment and no arguments (0 entries, 0 bytes).
fn no_sizes(c: &mut Call<'_>, name: &str, count_ptr: u32, size_ptr: u32) -> wasmtime::Result<u32> {
    check(c, name)?;
    if write_u32(c, count_ptr, 0).is_err() {
        return Ok(errno::FAULT);
    }
    Ok(errno_of(write_u32(c, size_ptr, 0)))
}

fn errno_of<T>(result: Result<T, crate::abi::Status>) -> u32 {
    match result {
        Ok(_) => errno::SUCCESS,
        Err(_) => errno::FAULT,
    }
}

/// Monotonic nanoseconds (Envoy: its monotonic time source; any fixed origin).
fn monotonic_ns() -> u64 {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    saturating_ns(ORIGIN.get_or_init(Instant::now).elapsed())
}

/// Adds the WASI functions to both WASI module names.
pub fn link(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    for module in ["wasi_snapshot_preview1", "wasi_unstable"] {
        link_module(linker, module)?;
    }
    Ok(())
}

fn link_module(linker: &mut Linker<VmState>, m: &str) -> wasmtime::Result<()> {
    linker.func_wrap(m, "fd_write", |mut c: Call<'_>, fd: u32, iovs: u32, iovs_len: u32, nwritten_ptr: u32| {
        check(&c, "fd_write")?;
        let level = match fd {
            1 => LogLevel::Info,
            2 => LogLevel::Error,
            _ => return Ok(errno::BADF),
        };
        let mut text = Vec::new();
        for i in 0..iovs_len {
            let Some(at) = i.checked_mul(8).and_then(|o| iovs.checked_add(o)) else { return Ok(errno::FAULT) };
            let Ok(iovec) = read(&mut c, at, 8) else { return Ok(errno::FAULT) };
            let word = |k: usize| -> u32 {
                iovec.get(k..k + 4).and_then(|b| b.try_into().ok()).map(u32::from_le_bytes).unwrap_or(0)
            };
            let (buf, len) = (word(0), word(4));
            if len > 0 {
                match read(&mut c, buf, len) {
                    Ok(bytes) => text.extend_from_slice(&bytes),
                    Err(_) => return Ok(errno::FAULT),
                }
            }
        }
        let written = u32::try_from(text.len()).unwrap_or(u32::MAX);
        if !text.is_empty() {
            if text.last() == Some(&b'\n') {
                text.pop();
            }
            c.data().log(level, LogSource::Stdio, String::from_utf8_lossy(&text).into_owned());
        }
        Ok(errno_of(write_u32(&mut c, nwritten_ptr, written)))
    })?;
    linker.func_wrap(m, "fd_read", |c: Call<'_>, _fd: u32, _iovs: u32, _len: u32, _nread: u32| {
        check(&c, "fd_read")?;
        Ok(errno::NOSYS)
    })?;
    linker.func_wrap(m, "fd_seek", |c: Call<'_>, _fd: u32, _offset: i64, _whence: u32, _new: u32| {
        check(&c, "fd_seek")?;
        Ok(errno::SUCCESS)
    })?;
    linker.func_wrap(m, "fd_close", |c: Call<'_>, _fd: u32| {
        check(&c, "fd_close")?;
        Ok(errno::SUCCESS)
    })?;
    linker.func_wrap(m, "fd_fdstat_get", |mut c: Call<'_>, fd: u32, stat_ptr: u32| {
        check(&c, "fd_fdstat_get")?;
        if fd != 1 && fd != 2 {
            return Ok(errno::BADF);
        }
        // 24 bytes, zero but fs_rights_base = __WASI_RIGHTS_FD_WRITE (64); Envoy ignores a bad pointer.
        let mut stat = [0u8; 24];
        stat[8] = 64;
        let _ = write(&mut c, stat_ptr, &stat);
        Ok(errno::SUCCESS)
    })?;
    linker.func_wrap(m, "environ_get", |c: Call<'_>, _environ: u32, _buf: u32| {
        check(&c, "environ_get")?;
        Ok(errno::SUCCESS)
    })?;
    linker.func_wrap(m, "environ_sizes_get", |mut c: Call<'_>, count_ptr: u32, size_ptr: u32| {
        no_sizes(&mut c, "environ_sizes_get", count_ptr, size_ptr)
    })?;
    linker.func_wrap(m, "args_get", |c: Call<'_>, _argv: u32, _buf: u32| {
        check(&c, "args_get")?;
        Ok(errno::SUCCESS)
    })?;
    linker.func_wrap(m, "args_sizes_get", |mut c: Call<'_>, argc_ptr: u32, size_ptr: u32| {
        no_sizes(&mut c, "args_sizes_get", argc_ptr, size_ptr)
    })?;
    linker.func_wrap(m, "clock_time_get", |mut c: Call<'_>, clock: u32, _precision: u64, time_ptr: u32| {
        check(&c, "clock_time_get")?;
        let now = match clock {
            // The guest's wall clock (real time plus the host's clock offset); the monotonic clock stays
            // real, like the host's own timers (ticks, timeouts).
            0 => c.data().shared.guest_time_ns(),
            1 => monotonic_ns(),
            _ => return Ok(errno::NOTSUP),
        };
        Ok(errno_of(write_u64(&mut c, time_ptr, now)))
    })?;
    linker.func_wrap(m, "random_get", |mut c: Call<'_>, buf: u32, len: u32| {
        check(&c, "random_get")?;
        if len > RANDOM_GET_MAX {
            return Ok(errno::INVAL);
        }
        if len == 0 {
            return Ok(errno::SUCCESS);
        }
        let mut bytes = vec![0u8; usize::try_from(len).unwrap_or(0)];
        if getrandom::fill(&mut bytes).is_err() {
            return Ok(errno::NOSYS);
        }
        Ok(errno_of(write(&mut c, buf, &bytes)))
    })?;
    linker.func_wrap(m, "proc_exit", |c: Call<'_>, code: u32| {
        check(&c, "proc_exit")?;
        c.data().log(LogLevel::Trace, LogSource::Host, format!("wasi_unstable proc_exit({code})"));
        Ok(())
    })?;
    linker.func_wrap(
        m,
        "path_open",
        |c: Call<'_>,
         _fd: u32,
         _dirflags: u32,
         _path: u32,
         _len: u32,
         _oflags: u32,
         _base: u64,
         _inh: u64,
         _fdflags: u32,
         _out: u32| {
            check(&c, "path_open")?;
            Ok(errno::NOENT)
        },
    )?;
    linker.func_wrap(m, "fd_prestat_get", |c: Call<'_>, _fd: u32, _buf: u32| {
        check(&c, "fd_prestat_get")?;
        Ok(errno::BADF)
    })?;
    linker.func_wrap(m, "fd_prestat_dir_name", |c: Call<'_>, _fd: u32, _path: u32, _len: u32| {
        check(&c, "fd_prestat_dir_name")?;
        Ok(errno::NOSYS)
    })?;
    Ok(())
}
