//! The `wasm-host` command line, with the real filter behind real webdis and Redis.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use std::process::Command;
use std::time::Duration;

use common::{run_with_input, stock_filter, Redis, TempDir, Webdis};
use serde_json::{json, Value};

fn wasm_host() -> Command {
    Command::new(env!("CARGO_BIN_EXE_wasm-host"))
}

fn write_config(dir: &TempDir, rate: u64) -> std::path::PathBuf {
    let path = dir.0.join("config.json");
    let config = json!({
        "redis": {"cluster": "webdis", "timeout": "500ms"},
        "rules": [{"name": "per-user", "limit_by": {"header": "x-user-id"}, "rate": rate, "interval": "1m"}],
    });
    std::fs::write(&path, config.to_string()).unwrap();
    path
}

#[test]
fn serve_answers_a_json_line_per_request_and_control_line() {
    let redis = Redis::start();
    let webdis = Webdis::start(&redis);
    let dir = TempDir::new("cli-serve");
    let config = write_config(&dir, 3);
    let alice = r#"{"headers": [["x-user-id","alice"]], "source_address": "10.0.0.1:1234", "route_name": "r"}"#;
    let input = format!("{alice}\n{alice}\n{alice}\n{alice}\n{{\"metrics\": true}}\n{{\"logs\": true}}\nnot json\n");
    let (code, stdout, stderr) = run_with_input(
        wasm_host().args(["serve", "--module"]).arg(stock_filter()).arg("--config").arg(&config).args([
            "--vms",
            "2",
            "--cluster",
            &format!("webdis=127.0.0.1:{}", webdis.port),
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

#[test]
fn replay_prints_a_summary() {
    let redis = Redis::start();
    let webdis = Webdis::start(&redis);
    let dir = TempDir::new("cli-replay");
    let config = write_config(&dir, 3);
    let requests = dir.0.join("requests.jsonl");
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
            .args(["--vms", "2", "--cluster", &format!("webdis=127.0.0.1:{}", webdis.port)]);
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

    redis.command(&[b"FLUSHALL"]);
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
    let dir = TempDir::new("cli-refused");
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
    let dir = TempDir::new("cli-import");
    let module = dir.0.join("bad.wasm");
    let wasm = wat::parse_str(format!(r#"(module (import "env" "nonexistent" (func)) {})"#, common::WAT_HEAD)).unwrap();
    std::fs::write(&module, wasm).unwrap();
    let (code, _, stderr) =
        run_with_input(wasm_host().args(["serve", "--module"]).arg(&module), b"", Duration::from_secs(30));
    assert_eq!(code, Some(1));
    assert!(stderr.contains("env.nonexistent"), "{stderr}");
}
