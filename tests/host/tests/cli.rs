//! The `wasm-host` command line, with the real filter behind real webdis and Redis.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use crate::common;

use std::process::Command;
use std::time::Duration;

use common::{effective_context_module, run_with_input, stock_filter, RedisServer, TempDir, Webdis};
use serde_json::{json, Value};

fn wasm_host() -> Command {
    Command::new(env!("CARGO_BIN_EXE_wasm-host"))
}

fn write_config(dir: &TempDir, rate: u64) -> std::path::PathBuf {
    let path = dir.path().join("config.json");
    let config = json!({
        "redis": {"cluster": "webdis", "timeout": "500ms"},
        "rules": [{"name": "per-user", "limit_by": {"header": "x-user-id"}, "rate": rate, "interval": "1m"}],
    });
    std::fs::write(&path, config.to_string()).unwrap();
    path
}

#[test]
fn serve_answers_a_json_line_per_request_and_control_line() {
    let redis = RedisServer::start().unwrap();
    let webdis = Webdis::start(&redis).unwrap();
    let dir = TempDir::new("cli-serve").unwrap();
    let config = write_config(&dir, 3);
    let alice = r#"{"headers": [["x-user-id","alice"]], "source_address": "10.0.0.1:1234", "route_name": "r"}"#;
    let input = format!("{alice}\n{alice}\n{alice}\n{alice}\n{{\"metrics\": true}}\n{{\"logs\": true}}\nnot json\n");
    let (code, stdout, stderr) = run_with_input(
        wasm_host().args(["serve", "--module"]).arg(stock_filter()).arg("--config").arg(&config).args([
            "--vms",
            "2",
            "--cluster",
            &format!("webdis=127.0.0.1:{}", webdis.port()),
        ]),
        input.as_bytes(),
        Duration::from_secs(60),
    );
    assert_eq!(code, Some(0), "{stderr}");
    let lines: Vec<Value> = stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 7, "{stdout}");
    for (i, line) in lines[..3].iter().enumerate() {
        assert_eq!(line["kind"], "continued", "{line}");
        assert_eq!(line["status"], 200);
        assert_eq!(line["vm"], i % 2, "VMs take turns");
        assert!(line["fuel"].as_u64().unwrap() > 0);
        assert!(line["http_calls"].as_u64().unwrap() >= 1);
        assert!(line["elapsed_ms"].as_f64().is_some());
    }
    assert_eq!(lines[3]["kind"], "local_reply");
    assert_eq!(lines[3]["status"], 429);
    assert!(lines[3]["headers"].as_array().unwrap().iter().any(|h| h[0] == "retry-after"));
    assert_eq!(lines[4]["metrics"]["edge_rate_limiter.allowed"]["value"], 3);
    assert_eq!(lines[4]["metrics"]["edge_rate_limiter.rejected"]["value"], 1);
    assert!(lines[5]["logs"]
        .as_array()
        .unwrap()
        .iter()
        .any(|l| l["message"].as_str().unwrap().contains("configured 1 rule")));
    assert!(lines[6]["error"].as_str().unwrap().contains("not JSON"));
}

/// Every line may carry an `id` (any JSON value), echoed in its answer, errors included; the fault flags
/// and the `faults` / `advance_clock_ms` control lines. The module answers 200 + the status of
/// `proxy_set_effective_context` on its own stream.
#[test]
fn serve_echoes_ids_and_controls_faults_and_the_clock() {
    let dir = TempDir::new("cli-ids").unwrap();
    let module = dir.path().join("effective.wasm");
    std::fs::write(&module, effective_context_module()).unwrap();
    let input = [
        r#"{"id": 1, "faults": true}"#,
        r#"{"id": "a"}"#,
        r#"{"headers": [["x-user-id", "bob"]], "id": "b"}"#,
        r#"{"id": [3], "faults": {"refuse_effective_context": 4294967295}}"#,
        r#"{"id": {"k": 4}, "batch": [{}, {"vm": 0}]}"#,
        r#"{"id": 5, "faults": {"drop_everything": true}}"#,
        r#"{"id": 6, "bogus": 1}"#,
        r#"{"id": 7, "advance_clock_ms": 1500}"#,
        r#"{"id": null, "faults": {}}"#,
        r#"{"wait_ms": 1}"#,
        "not json",
    ]
    .join("\n");
    let (code, stdout, stderr) = run_with_input(
        wasm_host().args(["serve", "--module"]).arg(&module).args([
            "--refuse-effective-context",
            "1",
            "--misroute-tokens",
            "--clock-offset-ms",
            "500",
        ]),
        input.as_bytes(),
        Duration::from_secs(60),
    );
    assert_eq!(code, Some(0), "{stderr}");
    let lines: Vec<Value> = stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 11, "{stdout}");
    let faults = |refusals: u32, misroute: bool| {
        json!({"refuse_effective_context": refusals, "drop_redis_replies": false,
               "drop_http_call_responses": false, "misroute_tokens": misroute})
    };
    assert_eq!(lines[0], json!({"id": 1, "faults": faults(1, true)}), "the flags");
    assert_eq!((&lines[1]["id"], &lines[1]["status"]), (&json!("a"), &json!(202)), "{}", lines[1]);
    assert_eq!((&lines[2]["id"], &lines[2]["status"]), (&json!("b"), &json!(200)), "{}", lines[2]);
    assert_eq!(lines[3], json!({"id": [3], "faults": faults(u32::MAX, false)}), "replaced, not merged");
    assert_eq!(lines[4]["id"], json!({"k": 4}));
    assert_eq!(
        lines[4]["batch"].as_array().unwrap().iter().map(|r| r["status"].clone()).collect::<Vec<_>>(),
        [202, 202]
    );
    assert_eq!(lines[5]["id"], 5);
    assert!(lines[5]["error"].as_str().unwrap().contains("bad faults"), "{}", lines[5]);
    assert_eq!(lines[6]["id"], 6);
    assert!(lines[6]["error"].as_str().unwrap().contains("bad request"), "{}", lines[6]);
    assert_eq!(lines[7], json!({"id": 7, "clock_offset_ms": 2000}));
    assert_eq!(lines[8], json!({"id": null, "faults": faults(0, false)}));
    assert_eq!(lines[9], json!({"waited_ms": 1}), "no id, none echoed");
    assert!(lines[10]["error"].as_str().unwrap().contains("not JSON") && lines[10].get("id").is_none());
}

#[test]
fn replay_prints_a_summary() {
    let redis = RedisServer::start().unwrap();
    let webdis = Webdis::start(&redis).unwrap();
    let dir = TempDir::new("cli-replay").unwrap();
    let config = write_config(&dir, 3);
    let requests = dir.path().join("requests.jsonl");
    let mut text = String::new();
    for user in ["alice", "alice", "alice", "alice", "alice", "bob"] {
        text.push_str(&format!("{{\"headers\": [[\"x-user-id\",\"{user}\"]]}}\n"));
    }
    std::fs::write(&requests, text).unwrap();
    let args = |json: bool| {
        let mut command = wasm_host();
        command
            .args(["replay", "--module"])
            .arg(stock_filter())
            .arg("--config")
            .arg(&config)
            .arg("--requests")
            .arg(&requests)
            .args(["--vms", "2", "--cluster", &format!("webdis=127.0.0.1:{}", webdis.port())]);
        if json {
            command.arg("--json");
        }
        command
    };
    let (code, stdout, stderr) = run_with_input(&mut args(false), b"", Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("continued 200"), "{stdout}");
    assert!(stdout.contains("local_reply 429"), "{stdout}");
    assert!(stdout.contains("fuel (allowed: continued)"), "{stdout}");
    assert!(stdout.contains("fuel (rejected: local reply)"), "{stdout}");

    redis.command(&[b"FLUSHALL"]).unwrap();
    let (code, stdout, stderr) = run_with_input(&mut args(true), b"", Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
    let summary: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(summary["requests"], 6);
    assert_eq!(summary["outcomes"]["continued 200"], 4, "{summary}");
    assert_eq!(summary["outcomes"]["local_reply 429"], 2, "{summary}");
    assert_eq!(summary["fuel_allowed"]["count"], 4);
    assert!(summary["fuel_rejected"]["p50"].as_f64().unwrap() > 0.0);
}

#[test]
fn a_refused_configuration_prints_the_module_log_and_exits_2() {
    let dir = TempDir::new("cli-refused").unwrap();
    let config = write_config(&dir, 0);
    let (code, _, stderr) = run_with_input(
        wasm_host().args(["serve", "--module"]).arg(stock_filter()).arg("--config").arg(&config),
        b"",
        Duration::from_secs(60),
    );
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("rules[0].rate"), "{stderr}");
}

#[test]
fn an_unknown_import_is_an_error_naming_it() {
    let dir = TempDir::new("cli-import").unwrap();
    let module = dir.path().join("bad.wasm");
    let wasm = wat::parse_str(format!(r#"(module (import "env" "nonexistent" (func)) {})"#, common::WAT_HEAD)).unwrap();
    std::fs::write(&module, wasm).unwrap();
    let (code, _, stderr) =
        run_with_input(wasm_host().args(["serve", "--module"]).arg(&module), b"", Duration::from_secs(30));
    assert_eq!(code, Some(1));
    assert!(stderr.contains("env.nonexistent"), "{stderr}");
}
