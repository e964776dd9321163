//! The emulator against misbehaving modules: what it cannot provide fails loudly at load; traps and bad
//! pointers never panic the host and behave as in Envoy.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use crate::common;

use common::WAT_HEAD;
use proxy_wasm_host::{HostBuilder, HostError, Outcome, RequestSpec};

fn module(body: &str) -> Vec<u8> {
    wat::parse_str(format!("(module {body} {WAT_HEAD})")).unwrap()
}

#[test]
fn an_unknown_import_fails_loudly_with_its_module_and_name() {
    let wasm = module(
        r#"(import "env" "nonexistent" (func (param i32)))
                         (import "wasi_snapshot_preview1" "sched_yield" (func (result i32)))"#,
    );
    match HostBuilder::from_bytes(wasm).build() {
        Err(HostError::MissingImports(missing)) => {
            assert_eq!(missing, vec!["env.nonexistent", "wasi_snapshot_preview1.sched_yield"]);
        }
        Err(other) => panic!("expected MissingImports, got {other}"),
        Ok(_) => panic!("a module with an unknown import loaded"),
    }
}

#[test]
fn a_wrong_import_signature_fails_at_load() {
    let wasm = module(r#"(import "env" "proxy_log" (func (param i32)))"#);
    let error = HostBuilder::from_bytes(wasm).build().err().expect("must not load");
    assert!(error.to_string().contains("proxy_log"), "{error}");
}

#[test]
fn a_module_without_a_proxy_wasm_abi_is_refused() {
    let wasm = wat::parse_str(
        r#"(module (memory (export "memory") 1)
        (func (export "malloc") (param i32) (result i32) (i32.const 0)))"#,
    )
    .unwrap();
    assert!(matches!(HostBuilder::from_bytes(wasm).build(), Err(HostError::UnknownAbi)));
}

/// A module whose request callback traps: Envoy fails the VM and answers 503 to this and every later
/// request of that VM (observed in Envoy 1.40), while other VMs keep working.
#[test]
fn a_trap_fails_the_vm_like_envoy_and_never_panics_the_host() {
    let wasm = module(
        r#"(func (export "proxy_on_configure") (param i32 i32) (result i32) (i32.const 1))
           (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32) unreachable)"#,
    );
    let mut host = HostBuilder::from_bytes(wasm.clone()).vms(2).build().unwrap();
    let first = host.send_request(0, RequestSpec::default()).unwrap();
    match &first {
        Outcome::VmFailed { message, status, .. } => {
            assert_eq!(*status, Some(503));
            assert!(message.starts_with("Function: proxy_on_request_headers failed"), "{message}");
            assert!(message.contains("unreachable"), "{message}");
        }
        other => panic!("expected VmFailed, got {other:?}"),
    }
    assert!(matches!(
        host.send_request(0, RequestSpec::default()).unwrap(),
        Outcome::VmFailed { status: Some(503), .. }
    ));
    assert!(host.vm_failure(0).is_some());
    assert!(host.vm_failure(1).is_none(), "only the trapping VM fails");

    let mut open = HostBuilder::from_bytes(wasm).fail_open(true).build().unwrap();
    let through = open.send_request(0, RequestSpec::default()).unwrap();
    assert_eq!(through.status(), Some(200), "fail_open lets the request through: {through:?}");
}

/// Pointers outside memory answer InvalidMemoryAccess (6), as proxy-wasm-cpp-host does.
#[test]
fn bad_pointers_answer_invalid_memory_access() {
    let wasm = module(
        r#"(import "env" "proxy_log" (func $log (param i32 i32 i32) (result i32)))
           (import "env" "proxy_get_header_map_value" (func $get (param i32 i32 i32 i32 i32) (result i32)))
           (import "env" "proxy_send_local_response" (func $reply (param i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
           (func (export "proxy_on_configure") (param i32 i32) (result i32) (i32.const 1))
           (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32)
             (local $a i32) (local $b i32)
             (local.set $a (call $log (i32.const 2) (i32.const 0xfffffff0) (i32.const 100)))
             (local.set $b (call $get (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0x7ffffff0) (i32.const 16)))
             (drop (call $reply (i32.add (i32.const 200) (i32.add (i32.mul (local.get $a) (i32.const 10)) (local.get $b)))
               (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const -1)))
             (i32.const 1))"#,
    );
    let mut host = HostBuilder::from_bytes(wasm).build().unwrap();
    // proxy_log: 6; reading ":" with a bad result pointer: 1 (":" is not a header, NotFound comes first).
    let outcome = host.send_request(0, RequestSpec::default()).unwrap();
    assert_eq!(outcome.status(), Some(200 + 60 + 1), "{outcome:?}");
}

/// A counter in shared data, read and written with CAS by two VMs in turn: both see one value.
#[test]
fn shared_data_is_shared_across_vms_with_cas() {
    let wasm = module(
        r#"(import "env" "proxy_get_shared_data" (func $get (param i32 i32 i32 i32 i32) (result i32)))
           (import "env" "proxy_set_shared_data" (func $set (param i32 i32 i32 i32 i32) (result i32)))
           (import "env" "proxy_send_local_response" (func $reply (param i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
           (data (i32.const 1024) "counter")
           (func (export "proxy_on_configure") (param i32 i32) (result i32) (i32.const 1))
           (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32)
             (local $status i32) (local $value i32) (local $cas i32) (local $code i32)
             (i32.store (i32.const 32) (i32.const 0))
             (local.set $status (call $get (i32.const 1024) (i32.const 7) (i32.const 16) (i32.const 20) (i32.const 28)))
             (if (i32.eq (local.get $status) (i32.const 0))
               (then (local.set $value (i32.load (i32.load (i32.const 16))))
                     (local.set $cas (i32.load (i32.const 28)))))
             (i32.store (i32.const 40) (i32.add (local.get $value) (i32.const 1)))
             (local.set $code (i32.add (i32.const 200) (i32.add (local.get $value) (i32.const 1))))
             (if (i32.ne (call $set (i32.const 1024) (i32.const 7) (i32.const 40) (i32.const 4) (local.get $cas)) (i32.const 0))
               (then (local.set $code (i32.const 500))))
             ;; the CAS just used is stale now (only a first write, with cas 0, has nothing to compare)
             (if (i32.and (i32.ne (local.get $cas) (i32.const 0))
                          (i32.ne (call $set (i32.const 1024) (i32.const 7) (i32.const 40) (i32.const 4) (local.get $cas)) (i32.const 8)))
               (then (local.set $code (i32.const 501))))
             (drop (call $reply (local.get $code) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const -1)))
             (i32.const 1))"#,
    );
    let mut host = HostBuilder::from_bytes(wasm).vms(2).build().unwrap();
    let statuses: Vec<Option<u16>> =
        [0, 1, 0, 1].iter().map(|&vm| host.send_request(vm, RequestSpec::default()).unwrap().status()).collect();
    assert_eq!(statuses, vec![Some(201), Some(202), Some(203), Some(204)]);
    let (value, cas) = host.shared_data("counter").unwrap();
    assert_eq!(value, 4u32.to_le_bytes());
    assert_ne!(cas, 0);
}

/// A paused request that nothing resumes ends as Paused at the deadline (then the host ends the stream as
/// a client that gives up would).
#[test]
fn a_request_nothing_resumes_is_reported_paused() {
    let wasm = module(
        r#"(import "env" "proxy_log" (func $log (param i32 i32 i32) (result i32)))
           (data (i32.const 1024) "done")
           (func (export "proxy_on_configure") (param i32 i32) (result i32) (i32.const 1))
           (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32) (i32.const 1))
           (func (export "proxy_on_log") (param i32) (drop (call $log (i32.const 2) (i32.const 1024) (i32.const 4))))"#,
    );
    let mut host = HostBuilder::from_bytes(wasm).pause_deadline(std::time::Duration::from_millis(200)).build().unwrap();
    let started = std::time::Instant::now();
    let outcome = host.send_request(0, RequestSpec::default()).unwrap();
    assert!(matches!(outcome, Outcome::Paused { .. }), "{outcome:?}");
    assert!(started.elapsed() >= std::time::Duration::from_millis(190));
    assert!(host.logs().iter().any(|l| l.message == "done"), "proxy_on_log ran when the client gave up");
}
