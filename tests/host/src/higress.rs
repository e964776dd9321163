//! What Higress's host provides beyond stock Envoy 1.40, linked for [`HostFlavour::Higress`] only: three
//! hostcalls, the foreign function `get_log_level` and the property `plugin_vm_memory` (the Redis extension
//! is [`crate::redis`]; Higress's WASI functions, which stock Envoy 1.40 provides too, are [`crate::wasi`]).
//!
//! Sources (read, not copied):
//! - **Higress's proxy-wasm-cpp-host fork** (higress-group/proxy-wasm-cpp-host, branch `master`, commit
//!   913c1b0, 2025-07-25): `include/proxy-wasm/exports.h` `FOR_ALL_HOST_FUNCTIONS` adds `redis_init`,
//!   `redis_call`, `get_upstream_hosts`, `inject_encoded_data_to_filter_chain` and
//!   `set_upstream_override_host` (commit 27df305 "extend wasm abi", PR #8, for the last three), registered
//!   in `env` as `proxy_*` (`src/wasm.cc` `registerCallbacks`); `src/exports.cc`: their memory arguments
//!   answer InvalidMemoryAccess when out of bounds; `call_foreign_function` reads the name and the
//!   arguments (InvalidMemoryAccess), answers NotFound for an unknown name, else allocates the result in the
//!   guest and stores its address at `results` (unless 0) and its size at `results_size` (unless 0).
//!   Stock Envoy 1.40 lacks the five hostcalls (checked here: `envoy --mode validate` with a module
//!   importing each says "Failed to load Wasm module due to a missing import: env.proxy_...").
//! - **Higress's Go SDK** (higress-group/wasm-go, commit d153aa4): `pkg/wrapper/log_wrapper.go` calls the
//!   foreign function `get_log_level` with no arguments before every log line and reads its result as a
//!   little-endian u32 Envoy log level (trace 0 .. critical 5), logging everything when the call fails
//!   (stock Envoy 1.40 answers NotFound, seen in its trace log); `pkg/test/host.go` registers
//!   `get_log_level` in the SDK's own test host the same way (4 bytes LE); `pkg/wrapper/plugin_wrapper.go`
//!   reads the property `plugin_vm_memory` in `OnHttpRequestHeaders` as an 8-byte little-endian u64 of bytes
//!   and sets `wasm_need_rebuild` past a threshold. The foreign function came with higress-group/wasm-go
//!   PR #41 (higress-group/higress PR #3367, 2026-01: "perceive the Envoy host log level in real time").
//! - **Higress's Envoy fork** (higress-group/envoy): `source/extensions/common/wasm/wasm.cc` at 957ba14
//!   samples `wasm_vm()->getMemorySize()` (the VM's linear memory) for its memory statistics. The branch
//!   that registers `get_log_level` and serves `plugin_vm_memory` (envoy-1.36, the submodule of
//!   alibaba/higress `envoy/envoy` at 43287ff) is not in the snapshot read here (branch envoy-1.27,
//!   e9302f5574, has neither), so their host side follows the SDK's contract above: the level is the one
//!   `proxy_get_log_level` answers, the memory the VM's linear memory size, in any context.
//!
//! Not emulated: what the Envoy side does with `proxy_get_upstream_hosts`, `proxy_set_upstream_override_host`
//! and `proxy_inject_encoded_data_to_filter_chain` (not in the sources read): they are linked, so a module
//! importing them loads as in Higress, check their memory arguments as cpp-host does, and answer
//! Unimplemented (12) with a warning in the log.

use crate::engine::Caller;

use crate::engine::Imports;

use crate::abi::{LogLevel, Status};
use crate::hostcalls::{link_hostcall, Body};
use crate::memory::{allocate, read, write, write_u32};
use crate::shared::LogSource;
use crate::vm::VmState;

#[cfg(doc)]
use crate::flavour::HostFlavour;

type Call<'a> = Caller<'a, VmState>;

/// Adds Higress's three hostcalls that Envoy 1.40 lacks (`env.proxy_*`; the Redis calls are in
/// [`crate::redis`]). Their Envoy side was not read: after cpp-host's checks of their memory arguments,
/// they answer Unimplemented and log a warning.
///
/// # Errors
/// A name linked twice (a bug).
pub fn link_hostcalls(linker: &mut Imports) -> Result<(), crate::engine::Error> {
    link_hostcall!(linker, fn proxy_get_upstream_hosts(c, _ptr_ptr: u32, _size_ptr: u32) {
        not_emulated(c, "proxy_get_upstream_hosts")
    });
    link_hostcall!(linker, fn proxy_set_upstream_override_host(c, address_ptr: u32, address_size: u32) {
        read(c, address_ptr, address_size)?;
        not_emulated(c, "proxy_set_upstream_override_host")
    });
    link_hostcall!(linker, fn proxy_inject_encoded_data_to_filter_chain(c, body_ptr: u32, body_size: u32,
            _end_stream: u32) {
        read(c, body_ptr, body_size)?;
        not_emulated(c, "proxy_inject_encoded_data_to_filter_chain")
    });
    Ok(())
}

fn not_emulated(c: &mut Call<'_>, name: &str) -> Body {
    let note = format!("{name}: Higress's Envoy side is not emulated; answered Unimplemented");
    c.data().log(LogLevel::Warn, LogSource::Host, note);
    Err(Status::Unimplemented.into())
}

/// The foreign functions of Higress's host: `get_log_level` answers the log level (the one
/// `proxy_get_log_level` answers) as 4 little-endian bytes; `None` for any other name.
pub fn foreign_function(state: &VmState, name: &[u8]) -> Option<Vec<u8>> {
    match name {
        b"get_log_level" => Some(state.shared.log_level.code().to_le_bytes().to_vec()),
        _ => None,
    }
}

/// Delivers a foreign function's result as cpp-host's `call_foreign_function` does: allocated in the guest
/// and its address stored at `results` unless `results` is 0, its size stored at `results_size` unless that
/// is 0.
pub fn deliver_foreign_result(c: &mut Call<'_>, result: &[u8], results: u32, results_size: u32) -> Body {
    let size = u32::try_from(result.len()).map_err(|_| Status::InvalidMemoryAccess)?;
    if results != 0 {
        let address = if size == 0 { 0 } else { allocate(c, size)?.ok_or(Status::InvalidMemoryAccess)? };
        if size > 0 {
            write(c, address, result)?;
        }
        write_u32(c, results, address)?;
    }
    if results_size != 0 {
        write_u32(c, results_size, size)?;
    }
    Ok(())
}

/// The `plugin_vm_memory` property: the VM's linear memory in bytes, 8 bytes little-endian.
pub fn vm_memory_property(c: &mut Call<'_>) -> Option<Vec<u8>> {
    let memory = c.data().memory?;
    let bytes = u64::try_from(memory.data_size(&*c)).unwrap_or(u64::MAX);
    Some(bytes.to_le_bytes().to_vec())
}

#[cfg(test)]
mod tests {
    //! The three flavours against small modules: what loads where, and what the Higress additions answer.

    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

    use crate::{HostBuilder, HostError, HostFlavour, Outcome, RequestSpec};

    /// A module exporting `abi` and importing `imports`, whose `proxy_on_request_headers` runs `status` (an
    /// i32 expression, kept in `$s`) and answers a local reply of status 200 + `$s` whose body is `len` bytes
    /// at `ptr` (expressions run after `status`). `_initialize` runs `init`. Data: "get_log_level" at 1024,
    /// "plugin_vm_memory" at 1100, "nope" at 1200.
    fn module(abi: &str, imports: &str, init: &str, status: &str, ptr: &str, len: &str) -> Vec<u8> {
        wat::parse_str(format!(
            r#"(module
  (import "env" "proxy_send_local_response" (func $reply (param i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  {imports}
  (memory (export "memory") 4)
  (global $heap (mut i32) (i32.const 131072))
  (data (i32.const 1024) "get_log_level")
  (data (i32.const 1100) "plugin_vm_memory")
  (data (i32.const 1200) "nope")
  (func (export "proxy_abi_version_{abi}"))
  (func (export "_initialize") {init})
  (func (export "proxy_on_memory_allocate") (param $size i32) (result i32)
    (global.get $heap) (global.set $heap (i32.add (global.get $heap) (local.get $size))))
  (func (export "proxy_on_context_create") (param i32 i32))
  (func (export "proxy_on_vm_start") (param i32 i32) (result i32) (i32.const 1))
  (func (export "proxy_on_configure") (param i32 i32) (result i32) (i32.const 1))
  (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32)
    (local $s i32)
    (local.set $s {status})
    (drop (call $reply (i32.add (i32.const 200) (local.get $s)) (i32.const 0) (i32.const 0) {ptr} {len}
      (i32.const 0) (i32.const 0) (i32.const -1)))
    (i32.const 1)))"#
        ))
        .unwrap()
    }

    fn build(flavour: HostFlavour, wasm: &[u8]) -> Result<crate::Host, HostError> {
        HostBuilder::from_bytes(wasm.to_vec()).host_flavour(flavour).build()
    }

    /// The local reply's status and body.
    fn reply(flavour: HostFlavour, wasm: &[u8]) -> (u16, Vec<u8>) {
        let mut host = build(flavour, wasm).unwrap();
        assert!(host.refusal().is_none(), "{:?}", host.refusal());
        match host.send_request(0, RequestSpec::default()).unwrap() {
            Outcome::LocalReply { status, body, .. } => (status, body),
            other => panic!("{flavour}: expected a local reply, got {other:?}"),
        }
    }

    const GO_IMPORTS: &str = r#"
  (import "wasi_snapshot_preview1" "sched_yield" (func $yield (result i32)))
  (import "wasi_snapshot_preview1" "poll_oneoff" (func $poll (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_fdstat_set_flags" (func $setflags (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "path_filestat_get" (func $filestat (param i32 i32 i32 i32 i32) (result i32)))"#;

    #[test]
    fn go_wasi_imports_load_in_envoy_and_higress_and_are_missing_in_compat() {
        // Each errno as one byte of the body: sched_yield 0, poll_oneoff 0 (and nevents 0 written over
        // 0xff), fd_fdstat_set_flags ENOSYS (52), path_filestat_get ENOTSUP (58).
        let status = r#"(i32.store (i32.const 3000) (i32.const -1))
            (i32.store8 (i32.const 4000) (call $yield))
            (i32.store8 (i32.const 4001) (call $poll (i32.const 0) (i32.const 0) (i32.const 1) (i32.const 3000)))
            (i32.store8 (i32.const 4002) (i32.load (i32.const 3000)))
            (i32.store8 (i32.const 4003) (call $setflags (i32.const 1) (i32.const 4)))
            (i32.store8 (i32.const 4004)
              (call $filestat (i32.const 3) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0)))
            (i32.const 0)"#;
        let wasm = module("0_2_1", GO_IMPORTS, "", status, "(i32.const 4000)", "(i32.const 5)");
        for flavour in [HostFlavour::Envoy, HostFlavour::Higress] {
            assert_eq!(reply(flavour, &wasm), (200, vec![0, 0, 0, 52, 58]), "{flavour}");
        }
        match build(HostFlavour::Compat, &wasm) {
            Err(HostError::MissingImports(missing)) => assert_eq!(
                missing,
                [
                    "wasi_snapshot_preview1.sched_yield",
                    "wasi_snapshot_preview1.poll_oneoff",
                    "wasi_snapshot_preview1.fd_fdstat_set_flags",
                    "wasi_snapshot_preview1.path_filestat_get"
                ]
            ),
            other => panic!("compat: expected MissingImports, got {:?}", other.err()),
        }
    }

    #[test]
    fn the_go_runtime_start_up_list_is_allowed_while_starting_sched_yield_is_not() {
        let polls = r#"(i32.store (i32.const 3000) (i32.const 0))
            (drop (call $poll (i32.const 0) (i32.const 0) (i32.const 1) (i32.const 3000)))"#;
        let wasm = module("0_2_1", GO_IMPORTS, polls, "(i32.const 0)", "(i32.const 0)", "(i32.const 0)");
        assert_eq!(reply(HostFlavour::Envoy, &wasm).0, 200);
        let yields = "(drop (call $yield))";
        let wasm = module("0_2_1", GO_IMPORTS, yields, "(i32.const 0)", "(i32.const 0)", "(i32.const 0)");
        for flavour in [HostFlavour::Envoy, HostFlavour::Higress] {
            let host = build(flavour, &wasm).unwrap();
            let refusal = host.refusal().expect("sched_yield is restricted while the VM starts");
            assert!(refusal.contains("restricted_callback: sched_yield"), "{refusal}");
        }
    }

    #[test]
    fn path_rename_and_sock_accept_differ_between_envoy_and_higress() {
        let rename5 =
            r#"(import "wasi_snapshot_preview1" "path_rename" (func (param i32 i32 i32 i32 i32) (result i32)))"#;
        let wasm = module("0_2_1", rename5, "", "(i32.const 0)", "(i32.const 0)", "(i32.const 0)");
        assert!(build(HostFlavour::Higress, &wasm).is_ok());
        let error = build(HostFlavour::Envoy, &wasm).err().expect("Envoy's path_rename takes 6 i32s");
        assert!(error.to_string().contains("path_rename"), "{error}");
        // sock_accept zeroes 8 bytes in Envoy, 4 in Higress; ENOTSUP (58) either way.
        let accept =
            r#"(import "wasi_snapshot_preview1" "sock_accept" (func $accept (param i32 i32 i32) (result i32)))"#;
        let status = r#"(i64.store (i32.const 4000) (i64.const -1))
            (i32.sub (call $accept (i32.const 3) (i32.const 0) (i32.const 4000)) (i32.const 58))"#;
        let wasm = module("0_2_1", accept, "", status, "(i32.const 4000)", "(i32.const 8)");
        assert_eq!(reply(HostFlavour::Envoy, &wasm), (200, vec![0; 8]));
        assert_eq!(reply(HostFlavour::Higress, &wasm), (200, vec![0, 0, 0, 0, 255, 255, 255, 255]));
    }

    #[test]
    fn abi_0_2_100_is_refused_by_envoy_alone_before_compiling() {
        let wasm = module("0_2_100", "", "", "(i32.const 0)", "(i32.const 0)", "(i32.const 0)");
        match build(HostFlavour::Envoy, &wasm) {
            Err(error @ HostError::AbiNotSupported { .. }) => {
                let text = error.to_string();
                assert!(text.contains("proxy_abi_version_0_2_100") && text.contains("envoy host"), "{text}");
            }
            other => panic!("expected AbiNotSupported, got {:?}", other.err()),
        }
        for flavour in [HostFlavour::Compat, HostFlavour::Higress] {
            assert_eq!(reply(flavour, &wasm).0, 200, "{flavour}");
        }
        // Refused before compiling: even a module whose code does not validate.
        let mut broken = wasm.clone();
        let code = broken.len() - 3;
        broken[code] = 0xff;
        assert!(matches!(build(HostFlavour::Envoy, &broken), Err(HostError::AbiNotSupported { .. })));
    }

    #[test]
    fn the_redis_extension_and_higress_hostcalls_by_flavour() {
        let redis = r#"(import "env" "proxy_redis_init" (func (param i32 i32 i32 i32 i32 i32 i32) (result i32)))"#;
        let wasm = module("0_2_1", redis, "", "(i32.const 0)", "(i32.const 0)", "(i32.const 0)");
        let missing = build(HostFlavour::Envoy, &wasm).err();
        assert!(
            matches!(&missing, Some(HostError::MissingImports(m)) if m == &["env.proxy_redis_init"]),
            "{missing:?}"
        );
        assert!(build(HostFlavour::Compat, &wasm).is_ok() && build(HostFlavour::Higress, &wasm).is_ok());

        let hosts = r#"(import "env" "proxy_get_upstream_hosts" (func $hosts (param i32 i32) (result i32)))"#;
        let wasm = module(
            "0_2_1",
            hosts,
            "",
            "(call $hosts (i32.const 3000) (i32.const 3004))",
            "(i32.const 0)",
            "(i32.const 0)",
        );
        for flavour in [HostFlavour::Envoy, HostFlavour::Compat] {
            assert!(matches!(build(flavour, &wasm), Err(HostError::MissingImports(_))), "{flavour}");
        }
        assert_eq!(reply(HostFlavour::Higress, &wasm).0, 212, "Unimplemented (12)");
    }

    /// No arguments; the result's address at 3000, its size at 3004.
    const CALL_TAIL: &str = "(i32.const 0) (i32.const 0) (i32.const 3000) (i32.const 3004)";

    /// `proxy_call_foreign_function(name, args, results, results_size)`: the status and the result.
    const FOREIGN: &str =
        r#"(import "env" "proxy_call_foreign_function" (func $foreign (param i32 i32 i32 i32 i32 i32) (result i32)))"#;

    #[test]
    fn get_log_level_is_a_foreign_function_of_higress_alone() {
        let call = |name: u32, len: u32| format!("(call $foreign (i32.const {name}) (i32.const {len}) {CALL_TAIL})");
        let wasm =
            module("0_2_1", FOREIGN, "", &call(1024, 13), "(i32.load (i32.const 3000))", "(i32.load (i32.const 3004))");
        // The log level (info, 2) as 4 bytes LE; NotFound (1) elsewhere, as stock Envoy 1.40 answers.
        assert_eq!(reply(HostFlavour::Higress, &wasm), (200, vec![2, 0, 0, 0]));
        for flavour in [HostFlavour::Envoy, HostFlavour::Compat] {
            assert_eq!(reply(flavour, &wasm).0, 201, "{flavour}");
        }
        let mut host = HostBuilder::from_bytes(wasm)
            .host_flavour(HostFlavour::Higress)
            .log_level(crate::LogLevel::Error)
            .build()
            .unwrap();
        assert_eq!(host.send_request(0, RequestSpec::default()).unwrap().status(), Some(200));
        let unknown = module("0_2_1", FOREIGN, "", &call(1200, 4), "(i32.const 0)", "(i32.const 0)");
        assert_eq!(reply(HostFlavour::Higress, &unknown).0, 201);
        // A bad name pointer: InvalidMemoryAccess (6) in Higress (cpp-host), NotFound elsewhere (as before).
        let bad = module("0_2_1", FOREIGN, "", &call(0x7fff_fff0, 13), "(i32.const 0)", "(i32.const 0)");
        assert_eq!(reply(HostFlavour::Higress, &bad).0, 206);
        assert_eq!(reply(HostFlavour::Compat, &bad).0, 201);
    }

    #[test]
    fn level_of_get_log_level_follows_the_host() {
        let call = format!("(call $foreign (i32.const 1024) (i32.const 13) {CALL_TAIL})");
        let call = call.as_str();
        let wasm = module("0_2_1", FOREIGN, "", call, "(i32.load (i32.const 3000))", "(i32.load (i32.const 3004))");
        let mut host = HostBuilder::from_bytes(wasm)
            .host_flavour(HostFlavour::Higress)
            .log_level(crate::LogLevel::Warn)
            .build()
            .unwrap();
        match host.send_request(0, RequestSpec::default()).unwrap() {
            Outcome::LocalReply { status: 200, body, .. } => assert_eq!(body, [3, 0, 0, 0]),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn plugin_vm_memory_is_the_linear_memory_in_higress_alone() {
        let property = r#"(import "env" "proxy_get_property" (func $property (param i32 i32 i32 i32) (result i32)))"#;
        let status = "(call $property (i32.const 1100) (i32.const 16) (i32.const 3000) (i32.const 3004))";
        let wasm = module("0_2_1", property, "", status, "(i32.load (i32.const 3000))", "(i32.load (i32.const 3004))");
        // 4 pages of 64 KiB.
        assert_eq!(reply(HostFlavour::Higress, &wasm), (200, (4u64 * 65536).to_le_bytes().to_vec()));
        for flavour in [HostFlavour::Envoy, HostFlavour::Compat] {
            assert_eq!(reply(flavour, &wasm).0, 201, "{flavour}: NotFound");
        }
    }
}
