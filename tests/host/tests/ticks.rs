//! Ticks belong to root contexts, as in Envoy 1.40: `proxy_set_tick_period_milliseconds` sets the tick of
//! the effective context's root context (cpp-host `ContextBase::setTimerPeriod`), each root context has its
//! own timer and gets its own `proxy_on_tick(root_id)`, and a deleted root context's tick stops (Envoy's
//! `Wasm::tickHandler` finds no context). A WAT module shows it around `Host::reconfigure`, where an old and
//! a new root context live side by side.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use crate::common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::WAT_HEAD;
use proxy_wasm_host::{Host, HostBuilder, LogSource, RequestSpec};

const TICK: Duration = Duration::from_millis(20);

/// A module whose plugin configuration's size is its mode (the latest `proxy_on_configure` sets it for the
/// whole VM):
/// - 1: `proxy_on_configure` sets a 20 ms tick (on the root context being configured);
/// - 2: `proxy_on_delete` of a root context sets a 20 ms tick (the deleted root is the effective context);
/// - 3: the same after `proxy_set_effective_context(latest configured root)`, logged as `E<status>`;
/// - any: `proxy_on_request_headers` sets a 20 ms tick (from the HTTP context).
///
/// It logs `T<root>` for every `proxy_on_tick(root)` and `X<root>` when a root context is deleted (two
/// digits each).
fn tick_module() -> Vec<u8> {
    wat::parse_str(format!(
        r#"(module
  (import "env" "proxy_log" (func $log (param i32 i32 i32) (result i32)))
  (import "env" "proxy_set_tick_period_milliseconds" (func $tick (param i32) (result i32)))
  (import "env" "proxy_set_effective_context" (func $set_effective (param i32) (result i32)))
  {WAT_HEAD}
  (global $mode (mut i32) (i32.const 0))
  (global $root (mut i32) (i32.const 0))
  ;; Logs the tag and `n` as two digits.
  (func $say (param $tag i32) (param $n i32)
    (i32.store8 (i32.const 2000) (local.get $tag))
    (i32.store8 (i32.const 2001) (i32.add (i32.const 48) (i32.div_u (local.get $n) (i32.const 10))))
    (i32.store8 (i32.const 2002) (i32.add (i32.const 48) (i32.rem_u (local.get $n) (i32.const 10))))
    (drop (call $log (i32.const 2) (i32.const 2000) (i32.const 3))))
  (func (export "proxy_on_configure") (param $root i32) (param $size i32) (result i32)
    (global.set $mode (local.get $size))
    (global.set $root (local.get $root))
    ;; root contexts are marked at 3000 + id
    (i32.store8 (i32.add (i32.const 3000) (local.get $root)) (i32.const 1))
    (if (i32.eq (local.get $size) (i32.const 1)) (then (drop (call $tick (i32.const {tick})))))
    (i32.const 1))
  (func (export "proxy_on_request_headers") (param $ctx i32) (param i32 i32) (result i32)
    (drop (call $tick (i32.const {tick})))
    (i32.const 0))
  (func (export "proxy_on_delete") (param $ctx i32)
    (if (i32.eqz (i32.load8_u (i32.add (i32.const 3000) (local.get $ctx)))) (then (return)))
    (call $say (i32.const 88) (local.get $ctx))
    (if (i32.eq (global.get $mode) (i32.const 3))
      (then (call $say (i32.const 69) (call $set_effective (global.get $root)))))
    (if (i32.ge_u (global.get $mode) (i32.const 2)) (then (drop (call $tick (i32.const {tick}))))))
  (func (export "proxy_on_tick") (param $root i32)
    (call $say (i32.const 84) (local.get $root))))"#,
        tick = TICK.as_millis(),
    ))
    .unwrap()
}

/// A host of one VM running the module with `config` (its mode), started.
fn host(config: &str) -> Host {
    let host = HostBuilder::from_bytes(tick_module()).plugin_config(config).build().unwrap();
    assert!(host.refusal().is_none(), "{:?}", host.refusal());
    host
}

/// The module's log lines since the last look.
fn lines(host: &Host) -> Vec<String> {
    host.take_logs().into_iter().filter(|l| l.source == LogSource::ProxyLog).map(|l| l.message).collect()
}

/// The roots that got ticks in these lines, with how many each.
fn ticked(lines: &[String]) -> BTreeMap<String, usize> {
    let mut roots = BTreeMap::new();
    for line in lines.iter().filter(|l| l.starts_with('T')) {
        *roots.entry(line.clone()).or_insert(0) += 1;
    }
    roots
}

fn ticks_of(root: u32) -> BTreeMap<u32, Duration> {
    BTreeMap::from([(root, TICK)])
}

#[test]
fn a_tick_set_from_an_http_context_reaches_its_root_context() {
    let mut host = host("");
    // A second root context (id 2), so that the stream's root is not the VM's first context.
    host.reconfigure("").unwrap();
    assert_eq!(host.root_context(0), Some(2));
    assert!(host.ticks(0).is_empty(), "no tick before the request");
    lines(&host);
    let outcome = host.send_request(0, RequestSpec::default()).unwrap();
    assert_eq!(outcome.kind(), "continued");
    assert_eq!(host.ticks(0), ticks_of(2), "the stream (context 3) set its root context's tick");
    host.run_for(TICK * 6);
    let ticked = ticked(&lines(&host));
    assert_eq!(ticked.keys().collect::<Vec<_>>(), ["T02"], "{ticked:?}");
    assert!(ticked["T02"] >= 2, "{ticked:?}");
}

#[test]
fn each_root_context_keeps_its_own_tick_and_a_new_one_starts_without() {
    let mut host = host("1");
    assert_eq!(host.ticks(0), ticks_of(1), "set in proxy_on_configure of root context 1");
    host.run_for(TICK * 4);
    assert!(ticked(&lines(&host)).contains_key("T01"));
    // Mode 0: nothing sets a tick; the old root context's own tick goes with it.
    host.reconfigure("").unwrap();
    assert_eq!(lines(&host), ["X01"]);
    assert!(host.ticks(0).is_empty(), "{:?}", host.ticks(0));
    host.run_for(TICK * 5);
    assert_eq!(ticked(&lines(&host)), BTreeMap::new(), "no tick after the reconfiguration");
}

#[test]
fn a_tick_set_in_proxy_on_delete_of_the_old_root_context_is_lost_with_it() {
    let mut host = host("1");
    host.run_for(TICK * 3);
    lines(&host);
    // Mode 2: proxy_on_delete(1) sets a tick while root context 1 is the effective context: root 1's tick,
    // gone when root 1 is. (The emulator used to keep one tick per VM and handed it to the new root.)
    host.reconfigure("22").unwrap();
    assert_eq!(lines(&host), ["X01"]);
    assert!(host.ticks(0).is_empty(), "the new root context 2 has no tick: {:?}", host.ticks(0));
    host.run_for(TICK * 6);
    assert_eq!(ticked(&lines(&host)), BTreeMap::new());
}

#[test]
fn a_tick_set_after_making_the_new_root_context_effective_reaches_it() {
    let mut host = host("1");
    host.run_for(TICK * 3);
    lines(&host);
    // Mode 3: proxy_on_delete(1) makes root context 2 effective (Ok, 0), then sets the tick: root 2's.
    host.reconfigure("333").unwrap();
    assert_eq!(lines(&host), ["X01", "E00"]);
    assert_eq!(host.ticks(0), ticks_of(2));
    host.run_for(TICK * 6);
    let ticked = ticked(&lines(&host));
    assert_eq!(ticked.keys().collect::<Vec<_>>(), ["T02"], "{ticked:?}");
    assert!(ticked["T02"] >= 2, "{ticked:?}");
}
