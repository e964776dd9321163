//! The WASI preview1 functions Envoy provides, in both `wasi_snapshot_preview1` and `wasi_unstable`,
//! implemented as proxy-wasm-cpp-host does (`src/exports.cc`, `FOR_ALL_WASI_FUNCTIONS`): `fd_write` to
//! stdout/stderr becomes a log line (info/error, one trailing newline removed), other descriptors EBADF;
//! `fd_read` ENOSYS; `fd_seek`/`fd_close` succeed and do nothing; `fd_fdstat_get` only for 1 and 2;
//! no environment (Envoy's default) and no arguments; `clock_time_get` realtime (plus the host's clock
//! offset, [`crate::HostBuilder::clock_offset`]) and monotonic (real) only;
//! `random_get` up to 64 KiB; `proc_exit` only logs (it does not trap: the guest's following `unreachable`
//! does); `path_open` ENOENT; `fd_prestat_get` EBADF (no preopens); `fd_prestat_dir_name` ENOSYS.
//!
//! Those 15 are the list of proxy-wasm-cpp-host before it supported Go (before #427, 2024-12), which this
//! emulator was built with; [`HostFlavour::Compat`], the default, keeps exactly them: anything else a module
//! imports (`sched_yield`, `poll_oneoff`, `fd_fdstat_set_flags`...) is not provided, so the module fails to
//! load.
//!
//! [`HostFlavour::Envoy`] and [`HostFlavour::Higress`] add the 30 that cpp-host added for Go 1.24 wasip1
//! modules ([`link_go`]): proxy-wasm/proxy-wasm-cpp-host c4d7bb0 (#427, 2024-12-19: `fd_fdstat_set_flags`,
//! `sched_yield`, `poll_oneoff`) and 94091cd (#533, 2026-04-06, "add all wasi hostcalls used by Go SDK",
//! co-authored by Higress's author of the same functions in its fork, higress-group/proxy-wasm-cpp-host
//! f2438ad, 3f37970, cde187a, 71f6a9e). Checked in Envoy 1.40 here (`envoy --mode validate` with a module
//! importing each one with a wrong type: "import type mismatch ... but host exports: <signature>"): all 45
//! exist, with the signatures linked below. The two hosts' `src/exports.cc` answer alike but for
//! `path_rename` (6 i32s in Envoy, 5 in Higress) and `sock_accept` (8 zero bytes written, 4 in Higress), and
//! both allow the same longer list while the VM starts ([`GO_ALSO_ALLOWED_WHILE_STARTING`]).

use std::sync::OnceLock;
use std::time::Instant;

use crate::engine::Caller;

use crate::engine::Imports;

use crate::abi::{errno, LogLevel};
use crate::flavour::HostFlavour;
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

/// Traps (`restricted_callback`) if `name` may not run now: while the VM starts, only the functions the
/// flavour's host allows.
fn check(c: &Call<'_>, name: &str) -> Result<(), crate::engine::Error> {
    if c.data().setup.flavour.go_wasi() && GO_ALSO_ALLOWED_WHILE_STARTING.contains(&name) {
        return Ok(());
    }
    check_restricted(c, name, ALLOWED_WHILE_STARTING)
}

/// `environ_sizes_get` / `args_sizes_get`: no environment and no arguments (0 entries, 0 bytes).
fn no_sizes(c: &mut Call<'_>, name: &str, count_ptr: u32, size_ptr: u32) -> Result<u32, crate::engine::Error> {
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

/// Adds the flavour's WASI functions to both WASI module names.
pub fn link(linker: &mut Imports, flavour: HostFlavour) -> Result<(), crate::engine::Error> {
    for module in ["wasi_snapshot_preview1", "wasi_unstable"] {
        link_module(linker, module)?;
        if flavour.go_wasi() {
            link_go(linker, module, flavour)?;
        }
    }
    Ok(())
}

/// `fd_write` (and Higress's `fd_pwrite`): the bytes of the iovecs written to stdout (1) or stderr (2)
/// become one log line at info or error; any other descriptor is EBADF.
fn write_stdio(c: &mut Call<'_>, fd: u32, iovs: u32, iovs_len: u32, nwritten_ptr: u32) -> u32 {
    let level = match fd {
        1 => LogLevel::Info,
        2 => LogLevel::Error,
        _ => return errno::BADF,
    };
    let mut text = Vec::new();
    for i in 0..iovs_len {
        let Some(at) = i.checked_mul(8).and_then(|o| iovs.checked_add(o)) else { return errno::FAULT };
        let Ok(iovec) = read(c, at, 8) else { return errno::FAULT };
        let word = |k: usize| -> u32 {
            iovec.get(k..k + 4).and_then(|b| b.try_into().ok()).map(u32::from_le_bytes).unwrap_or(0)
        };
        let (buf, len) = (word(0), word(4));
        if len > 0 {
            match read(c, buf, len) {
                Ok(bytes) => text.extend_from_slice(&bytes),
                Err(_) => return errno::FAULT,
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
    errno_of(write_u32(c, nwritten_ptr, written))
}

fn link_module(linker: &mut Imports, m: &str) -> Result<(), crate::engine::Error> {
    linker.func_wrap(m, "fd_write", |mut c: Call<'_>, fd: u32, iovs: u32, iovs_len: u32, nwritten_ptr: u32| {
        check(&c, "fd_write")?;
        Ok(write_stdio(&mut c, fd, iovs, iovs_len, nwritten_ptr))
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

/// WASI functions allowed while `_initialize`/`main` run in cpp-host since #533 (`WasmBase::startVm`;
/// Higress's fork has the same list) besides the nine of [`ALLOWED_WHILE_STARTING`]: those the Go
/// runtime's start-up may call. `sched_yield`, `proc_exit`, `fd_read`, `fd_seek`, `fd_close` and
/// `path_open` are not among them.
pub const GO_ALSO_ALLOWED_WHILE_STARTING: &[&str] = &[
    "clock_res_get",
    "fd_fdstat_get",
    "fd_fdstat_set_flags",
    "fd_fdstat_set_rights",
    "path_filestat_get",
    "fd_filestat_get",
    "fd_filestat_set_size",
    "fd_filestat_set_times",
    "fd_advise",
    "fd_allocate",
    "fd_datasync",
    "fd_pread",
    "fd_pwrite",
    "fd_readdir",
    "fd_renumber",
    "fd_sync",
    "fd_tell",
    "path_create_directory",
    "path_filestat_set_times",
    "path_link",
    "path_readlink",
    "path_remove_directory",
    "path_rename",
    "path_symlink",
    "path_unlink_file",
    "poll_oneoff",
    "sock_accept",
    "sock_recv",
    "sock_send",
    "sock_shutdown",
];

/// `fd_readdir`'s answer in cpp-host: 20, which is WASI's EEXIST although its comment says ENOTDIR.
const FD_READDIR_ERRNO: u32 = 20;

/// The standard streams, the only descriptors the fork's descriptor functions accept.
fn stdio(fd: u32) -> bool {
    fd == 1 || fd == 2
}

/// `ok` for stdout/stderr, EBADF for any other descriptor (`fd_allocate`, `fd_datasync`,
/// `fd_fdstat_set_rights`, `fd_filestat_set_size`, `fd_filestat_set_times`, `fd_sync` in cpp-host).
fn stdio_only(fd: u32) -> u32 {
    if stdio(fd) {
        errno::SUCCESS
    } else {
        errno::BADF
    }
}

/// Writes `bytes` at `ptr` and answers `then`, or EFAULT if the pointer is bad (cpp-host writes the
/// out-parameters of the unsupported socket and link calls before answering ENOTSUP).
fn out_then(c: &mut Call<'_>, ptr: u32, bytes: &[u8], then: u32) -> u32 {
    match write(c, ptr, bytes) {
        Ok(()) => then,
        Err(_) => errno::FAULT,
    }
}

/// Registers a WASI function in module `m`: `link_wasi!(linker, m, fn name(c, a: u32, ...) { errno })`
/// becomes a wasmtime function of those arguments that first traps if `name` may not run now ([`check`]),
/// then answers the body's errno, with `c` the caller (`&mut Caller`; `_` if unused). Expands to an
/// expression ending in `?`.
macro_rules! link_wasi {
    ($linker:expr, $m:expr, fn $name:ident($c:tt $(, $arg:ident: $ty:ty)* $(,)?) $body:block) => {
        $linker.func_wrap($m, stringify!($name), move |mut caller: Call<'_> $(, $arg: $ty)*| -> Result<u32, crate::engine::Error> {
            check(&caller, stringify!($name))?;
            let $c = &mut caller;
            Ok($body)
        })?
    };
}

/// Adds the 30 WASI functions cpp-host added for Go 1.24 (#427, #533) to WASI module `m`, with the
/// flavour's two differences (`path_rename`'s arity, `sock_accept`'s out-parameter).
fn link_go(linker: &mut Imports, m: &str, flavour: HostFlavour) -> Result<(), crate::engine::Error> {
    // Go's runtime yields in spin loops; without threads, success is the only answer.
    link_wasi!(linker, m, fn sched_yield(_) { errno::SUCCESS });
    // No event is ever ready: nevents = 0, success. Go's scheduler sleeps through it, so a timer in a Go
    // plugin never blocks the host.
    link_wasi!(linker, m, fn poll_oneoff(c, _in: u32, _out: u32, _n: u32, nevents_ptr: u32) {
        errno_of(write_u32(c, nevents_ptr, 0))
    });
    link_wasi!(linker, m, fn fd_fdstat_set_flags(_, _fd: u32, _flags: u32) { errno::NOSYS });
    link_wasi!(linker, m, fn path_filestat_get(_, _fd: u32, _flags: u32, _path: u32, _len: u32, _buf: u32) {
        errno::NOTSUP
    });
    link_wasi!(linker, m, fn fd_filestat_get(_, _fd: u32, _buf: u32) { errno::BADF });
    // Realtime and monotonic: 1 ns.
    link_wasi!(linker, m, fn clock_res_get(c, clock: u32, result_ptr: u32) {
        if clock > 1 { errno::NOTSUP } else { errno_of(write_u64(c, result_ptr, 1)) }
    });
    link_wasi!(linker, m, fn fd_advise(_, _fd: u32, _offset: u64, _len: u64, _advice: u32) { errno::SUCCESS });
    link_wasi!(linker, m, fn fd_allocate(_, fd: u32, _offset: u64, _len: u64) { stdio_only(fd) });
    link_wasi!(linker, m, fn fd_datasync(_, fd: u32) { stdio_only(fd) });
    link_wasi!(linker, m, fn fd_sync(_, fd: u32) { stdio_only(fd) });
    link_wasi!(linker, m, fn fd_fdstat_set_rights(_, fd: u32, _base: u64, _inheriting: u64) { stdio_only(fd) });
    link_wasi!(linker, m, fn fd_filestat_set_size(_, fd: u32, _size: u64) { stdio_only(fd) });
    link_wasi!(linker, m, fn fd_filestat_set_times(_, fd: u32, _atim: u64, _mtim: u64, _flags: u32) {
        stdio_only(fd)
    });
    link_wasi!(linker, m, fn fd_pread(_, _fd: u32, _iovs: u32, _len: u32, _offset: u64, _nread: u32) { errno::NOSYS });
    // stdout/stderr: as `fd_write` (a log line), the offset ignored.
    link_wasi!(linker, m, fn fd_pwrite(c, fd: u32, iovs: u32, iovs_len: u32, _offset: u64, nwritten_ptr: u32) {
        write_stdio(c, fd, iovs, iovs_len, nwritten_ptr)
    });
    link_wasi!(linker, m, fn fd_readdir(c, _fd: u32, _buf: u32, _len: u32, _cookie: u64, nread_ptr: u32) {
        out_then(c, nread_ptr, &0u32.to_le_bytes(), FD_READDIR_ERRNO)
    });
    link_wasi!(linker, m, fn fd_renumber(_, fd: u32, to: u32) {
        if stdio(fd) && stdio(to) { errno::NOTSUP } else { errno::BADF }
    });
    link_wasi!(linker, m, fn fd_tell(c, fd: u32, offset_ptr: u32) {
        if stdio(fd) { errno_of(write_u64(c, offset_ptr, 0)) } else { errno::BADF }
    });
    link_go_paths(linker, m, flavour)?;
    link_go_sockets(linker, m, flavour)
}

/// The path functions: no file system, ENOTSUP. `path_link` and `path_symlink` take cpp-host's signatures
/// (6 and 4 i32s, one fewer than WASI preview1's), `path_rename` 6 i32s in Envoy 1.40 (as WASI) but 5 in
/// Higress's fork: a module importing them with other signatures does not link, here as there.
fn link_go_paths(linker: &mut Imports, m: &str, flavour: HostFlavour) -> Result<(), crate::engine::Error> {
    link_wasi!(linker, m, fn path_create_directory(_, _fd: u32, _path: u32, _len: u32) { errno::NOTSUP });
    link_wasi!(linker, m, fn path_filestat_set_times(_, _fd: u32, _flags: u32, _path: u32, _len: u32, _atim: u64,
            _mtim: u64, _fst: u32) { errno::NOTSUP });
    link_wasi!(linker, m, fn path_link(_, _fd: u32, _flags: u32, _old: u32, _old_len: u32, _new_fd: u32, _new: u32) {
        errno::NOTSUP
    });
    link_wasi!(linker, m, fn path_readlink(c, _fd: u32, _path: u32, _len: u32, _buf: u32, _buf_len: u32,
            size_ptr: u32) { out_then(c, size_ptr, &0u32.to_le_bytes(), errno::NOTSUP) });
    link_wasi!(linker, m, fn path_remove_directory(_, _fd: u32, _path: u32, _len: u32) { errno::NOTSUP });
    if flavour.higress_host() {
        link_wasi!(linker, m, fn path_rename(_, _fd: u32, _old: u32, _old_len: u32, _new_fd: u32, _new: u32) {
            errno::NOTSUP
        });
    } else {
        link_wasi!(linker, m, fn path_rename(_, _fd: u32, _old: u32, _old_len: u32, _new_fd: u32, _new: u32,
                _new_len: u32) { errno::NOTSUP });
    }
    link_wasi!(linker, m, fn path_symlink(_, _old: u32, _old_len: u32, _fd: u32, _new: u32) { errno::NOTSUP });
    link_wasi!(linker, m, fn path_unlink_file(_, _fd: u32, _path: u32, _len: u32) { errno::NOTSUP });
    Ok(())
}

/// The socket functions: no sockets, ENOTSUP after zeroing the out-parameters. `sock_accept` zeroes 8 bytes
/// in Envoy 1.40's cpp-host (`0UL`) and 4 in Higress's fork (`uint32_t(0)`).
fn link_go_sockets(linker: &mut Imports, m: &str, flavour: HostFlavour) -> Result<(), crate::engine::Error> {
    let zeroes: &'static [u8] = if flavour.higress_host() { &[0; 4] } else { &[0; 8] };
    link_wasi!(linker, m, fn sock_accept(c, _fd: u32, _flags: u32, fd_ptr: u32) {
        out_then(c, fd_ptr, zeroes, errno::NOTSUP)
    });
    link_wasi!(linker, m, fn sock_recv(c, _fd: u32, _data: u32, _len: u32, _flags: u32, size_ptr: u32,
            flags_ptr: u32) {
        match write_u32(c, size_ptr, 0) {
            Ok(()) => out_then(c, flags_ptr, &0u16.to_le_bytes(), errno::NOTSUP),
            Err(_) => errno::FAULT,
        }
    });
    link_wasi!(linker, m, fn sock_send(c, _fd: u32, _data: u32, _len: u32, _flags: u32, size_ptr: u32) {
        out_then(c, size_ptr, &0u32.to_le_bytes(), errno::NOTSUP)
    });
    link_wasi!(linker, m, fn sock_shutdown(_, _fd: u32, _how: u32) { errno::NOTSUP });
    Ok(())
}
