//! Parity with real Envoy: the hostcall probe (`probe/`) was run in Envoy 1.40 by `probe/run_in_envoy.py`
//! (output: `probe/envoy-1.40-observed.txt`). The same requests run here through the emulator, and the
//! probe's log lines (callback order, context ids, hostcall statuses, header maps, properties, HTTP call
//! responses, local replies) and the responses must be the same, up to ports, ids and dates.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use crate::common;

use std::time::Duration;

use common::{addr, free_port, probe_module, Hang, PyLikeUpstream};
use proxy_wasm_host::{HostBuilder, LogSource, Outcome, RequestSpec};
use regex::Regex;

const OBSERVED: &str = include_str!("../probe/envoy-1.40-observed.txt");

/// Masks what differs from run to run: ports, request ids, dates, timings, connection ids.
fn normalize(line: &str) -> String {
    let rules = [
        (r"127\.0\.0\.1:\d+", "127.0.0.1:PORT"),
        (r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "UUID"),
        (r"date=[^|\]]*", "date=DATE "),
        (r"x-envoy-upstream-service-time=\d+", "x-envoy-upstream-service-time=N"),
        (r"(property (source|destination)\.port status=0 value=).*", "${1}PORT"),
        (r"(property connection_id status=0 value=).*", "${1}ID"),
    ];
    let mut out = line.trim().to_string();
    for (pattern, replacement) in rules {
        out = Regex::new(pattern).unwrap().replace_all(&out, replacement).into_owned();
    }
    out
}

/// Envoy's observations: the responses in request order, and the worker's probe lines.
struct Observed {
    responses: Vec<(String, String, String)>,
    startup: Vec<String>,
    ticks: Vec<String>,
    requests: Vec<Vec<String>>,
}

fn observed() -> Observed {
    let mut responses = Vec::new();
    let mut current = None;
    let mut log = false;
    let mut worker_lines: Vec<(String, String)> = Vec::new();
    for line in OBSERVED.lines() {
        if let Some(request) = line.strip_prefix("===== ") {
            log = request.starts_with("envoy log");
            current = (!log && !request.starts_with("upstream")).then(|| request.to_string());
            continue;
        }
        if let (Some(request), Some(rest)) = (&current, line.strip_prefix("response ")) {
            let (status, rest) = rest.split_once(' ').unwrap();
            let body = rest.rsplit_once("body=").unwrap().1;
            responses.push((request.clone(), status.to_string(), body.to_string()));
        } else if let (Some(request), true) = (&current, line.starts_with("client closed")) {
            responses.push((request.clone(), "none".into(), String::new()));
        }
        if log {
            if let Some((thread, message)) = line.split_once("] probe: ") {
                worker_lines.push((thread.to_string(), format!("probe: {message}")));
            }
        }
    }
    // The first VM on the main thread starts first; the worker's VM serves the requests.
    let first_thread = worker_lines.first().unwrap().0.clone();
    let worker = worker_lines.iter().find(|(_, m)| m.contains("create_http")).unwrap().0.clone();
    let startup_end = worker_lines.iter().position(|(_, m)| m.contains("effective_context")).unwrap();
    let startup =
        worker_lines[..=startup_end].iter().filter(|(t, _)| *t == first_thread).map(|(_, m)| normalize(m)).collect();
    let ticks =
        worker_lines.iter().filter(|(t, m)| *t == worker && m.contains("tick")).map(|(_, m)| normalize(m)).collect();
    let mut requests: Vec<Vec<String>> = Vec::new();
    for (thread, message) in &worker_lines {
        if *thread != worker || message.contains("tick") || !worker_lines.iter().any(|(_, m)| m.contains("create_http"))
        {
            continue;
        }
        if message.contains("create_http") {
            requests.push(Vec::new());
        }
        if let Some(group) = requests.last_mut() {
            group.push(normalize(message));
        }
    }
    Observed { responses, startup, ticks, requests }
}

fn probe_lines(host: &proxy_wasm_host::Host) -> Vec<String> {
    host.take_logs()
        .into_iter()
        .filter(|l| l.source == LogSource::ProxyLog && l.message.starts_with("probe: "))
        .map(|l| normalize(&l.message))
        .collect()
}

fn diff(what: &str, ours: &[String], envoy: &[String]) -> Option<String> {
    if ours == envoy {
        return None;
    }
    let mut text = format!("{what}: the emulator differs from Envoy 1.40\n");
    for i in 0..ours.len().max(envoy.len()) {
        let (a, b) = (ours.get(i).map_or("<none>", String::as_str), envoy.get(i).map_or("<none>", String::as_str));
        let mark = if a == b { "  " } else { "!!" };
        text.push_str(&format!("{mark} ours : {a}\n{mark} envoy: {b}\n"));
    }
    Some(text)
}

#[test]
fn the_probe_sees_the_same_host_as_in_envoy() {
    let observed = observed();
    let upstream = PyLikeUpstream::start();
    let hang = Hang::start();
    let listener_port = free_port().unwrap();
    let mut host = HostBuilder::new(probe_module())
        .plugin_config("plugin-config")
        .vm_config("vm-config")
        .plugin_names("probe-plugin", "probe_root", "probe_vm")
        .cluster("upstream", addr(upstream.port))
        .cluster("hang", addr(hang.port))
        .cluster("refused", addr(free_port().unwrap()))
        .upstream(
            200,
            &[
                ("server", "BaseHTTP/0.6 Python/3.11.7"),
                ("date", "Sun, 22 Nov 2026 00:00:00 GMT"),
                ("content-type", "text/plain"),
                ("x-upstream", "yes"),
                ("content-length", "12"),
            ],
            "upstream ok\n",
        )
        .pause_deadline(Duration::from_millis(500))
        .higress_properties(false)
        .build()
        .unwrap();
    let mut failures = Vec::new();
    failures.extend(diff("VM start", &probe_lines(&host), &observed.startup));
    host.run_for(Duration::from_millis(250));
    failures.extend(diff("ticks", &probe_lines(&host), &observed.ticks));

    let mut groups = observed.requests.iter();
    for (request, status, body) in &observed.responses {
        let (method, path) = request.split_once(' ').unwrap();
        let authority = format!("127.0.0.1:{listener_port}");
        let mut headers = vec![(":authority".to_string(), authority), (":path".into(), path.into())];
        let mut spec = RequestSpec { route_name: Some("probe_route".into()), ..Default::default() };
        match method {
            "ABORT" => {
                headers[0].1 = "x".into();
                headers.push(("x-user-id".into(), "alice".into()));
            }
            _ => {
                headers.push(("accept-encoding".into(), "identity".into()));
                if method == "POST" {
                    spec.body = Some("hello body".into());
                    headers.push(("content-length".into(), "10".into()));
                }
                headers.push(("x-user-id".into(), "alice".into()));
            }
        }
        headers.insert(2, (":method".into(), if method == "ABORT" { "GET".into() } else { method.into() }));
        spec.headers = headers;
        let outcome = host.send_request(0, spec).unwrap();
        let ours = probe_lines(&host);
        let envoy: &[String] = if ours.is_empty() { &[] } else { groups.next().map_or(&[], |g| g.as_slice()) };
        failures.extend(diff(&format!("{method} {path}"), &ours, envoy));
        let our_status = match &outcome {
            Outcome::Paused { .. } => "none".to_string(),
            other => other.status().map_or("none".into(), |s| s.to_string()),
        };
        if &our_status != status {
            failures.push(format!("{method} {path}: status {our_status}, Envoy {status} ({outcome:?})"));
        }
        let our_body = format!("b'{}'", String::from_utf8_lossy(outcome.body()).replace('\n', "\\n"));
        if status != "none" && &our_body != body {
            failures.push(format!("{method} {path}: body {our_body}, Envoy {body}"));
        }
    }
    assert!(groups.next().is_none(), "Envoy saw requests the emulator did not run");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
