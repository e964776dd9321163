//! `wasm-host`: run a proxy-wasm module in the emulator from the command line.
//!
//! ```text
//! wasm-host serve  --module M.wasm --config cfg.json --vms K --cluster NAME=127.0.0.1:PORT ...
//! wasm-host replay --module M.wasm --config cfg.json --vms K --requests file.jsonl --cluster ...
//! ```
//!
//! `serve` reads JSON lines on stdin and answers one JSON line each:
//! - a request: `{"headers": [["x-user-id","alice"]], "source_address": "10.0.0.1:1234",
//!   "route_name": "r", "body": "...", "vm": 0}` (every field optional; without `vm`, VMs take turns;
//!   `"body_chunks": ["...", ...]` instead of `body` sends the body in pieces, and `"response"` gives the
//!   upstream's answer, `trailers` included: see the library's `RequestSpec` and `ResponseSpec`)
//!   -> `{"kind": "local_reply", "status": 429, "headers": [...], "body": "...", "fuel": ...,
//!   "redis_calls": 1, "http_calls": 0, "guest_calls": ..., "elapsed_ms": ..., "vm": 0}`;
//! - `{"batch": [request, ...]}`: all in flight at once -> `{"batch": [result, ...]}`;
//! - `{"metrics": true}` -> `{"metrics": {...}}`; `{"logs": true}` -> `{"logs": [...]}` (lines since the
//!   last such request); `{"wait_ms": 500}` runs the event loop (ticks, late replies) -> `{"waited_ms": 500}`;
//! - `{"faults": {"refuse_effective_context": 3, "drop_redis_replies": true, "drop_http_call_responses":
//!   false, "misroute_tokens": false}}` replaces the faults in force (omitted ones are off; `{"faults": {}}`
//!   clears them) -> `{"faults": {...the faults now in force...}}`; `{"faults": true}` only reports them;
//! - `{"advance_clock_ms": 60000}` moves the guest's wall clock ahead -> `{"clock_offset_ms": <total>}`.
//!
//! Every line may carry an `"id"` (any JSON value), echoed in its answer, errors included (a line that is
//! not JSON has no id to echo), so a client that gave up on an answer can tell a late one from the next.
//!
//! `replay` runs every request of a file of such lines (`--concurrency N` at a time) and prints a summary:
//! outcomes by kind and status, Redis round trips and HTTP calls per request, fuel per allowed and per
//! rejected request (mean, p50, p99), latency. `--json` prints it as JSON. `--fuel-profile` also prints, on
//! stderr, the fuel by segment between hostcalls; `--function-profile`, the fuel by guest function per
//! request (the top 40 by exclusive and by inclusive fuel, with calls per request), exact to the
//! instruction (the library's `profile` module).
//!
//! `--host envoy|compat|higress` picks the host played (the library's `flavour` module; default compat).
//! `--call-tokens shared|per-kind|envoy` picks how HTTP and Redis call tokens are numbered (the library's
//! `tokens` module; default shared: one counter for both kinds).
//!
//! When the plugin refuses its configuration, both print the module's log lines on stderr and exit 2.

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};
use proxy_wasm_host::exchange::ResponseSpec;
use proxy_wasm_host::summary::Distribution;
use proxy_wasm_host::{
    CallTokens, Faults, FunctionProfile, FunctionStats, Host, HostBuilder, HostFlavour, LogLevel, Outcome, RequestSpec,
};
use serde::Deserialize;
use serde_json::{json, Value};

#[derive(Parser)]
#[command(name = "wasm-host", version, about = "Run a proxy-wasm module in an Envoy-faithful emulator")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Read requests as JSON lines on stdin, answer one JSON line each.
    Serve(Common),
    /// Run a file of requests and print a summary.
    Replay {
        #[command(flatten)]
        common: Common,
        /// JSON lines, one request each (as `serve` reads them).
        #[arg(long)]
        requests: PathBuf,
        /// Requests in flight at once.
        #[arg(long, default_value_t = 1)]
        concurrency: usize,
        /// Print the summary as JSON.
        #[arg(long)]
        json: bool,
        /// Also print where the guest spent its fuel, by segment between hostcalls (on stderr).
        #[arg(long)]
        fuel_profile: bool,
        /// Also print which guest functions spent the fuel, per request, by exclusive and by inclusive fuel
        /// (on stderr; the module is instrumented, exact figures: see the library's `profile` module).
        #[arg(long)]
        function_profile: bool,
    },
}

#[derive(Args)]
struct Common {
    /// The proxy-wasm module.
    #[arg(long)]
    module: PathBuf,
    /// The host to play: envoy (stock Envoy 1.40: no ABI 0.2.100, no Redis extension), compat (the
    /// emulator's original mix, Envoy with Higress's Redis extension) or higress (Higress's gateway).
    #[arg(long = "host", default_value_t = HostFlavour::Compat, value_name = "envoy|compat|higress")]
    host: HostFlavour,
    /// File with the plugin configuration (e.g. JSON); none if omitted.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Number of VMs (Envoy: worker threads).
    #[arg(long, default_value_t = 1)]
    vms: usize,
    /// A cluster for HTTP calls and Redis: NAME=127.0.0.1:PORT (repeatable).
    #[arg(long = "cluster", value_name = "NAME=127.0.0.1:PORT")]
    clusters: Vec<String>,
    /// A cluster of type envoy.clusters.redis (Redis Cluster) for the Redis extension: its Redis calls
    /// fail with InternalFailure, as in Higress (repeatable).
    #[arg(long = "redis-cluster", value_name = "NAME=127.0.0.1:PORT[,...]")]
    redis_clusters: Vec<String>,
    /// A property: PATH=VALUE, e.g. node.id=gw-1 (repeatable).
    #[arg(long = "property", value_name = "PATH=VALUE")]
    properties: Vec<String>,
    /// Log level of the module's lines (trace, debug, info, warn, error, critical).
    #[arg(long, default_value = "info")]
    log_level: String,
    /// Print the module's log lines on stderr as they come.
    #[arg(long)]
    echo_logs: bool,
    /// How long a paused request may wait, in ms, before it counts as stuck.
    #[arg(long, default_value_t = 5000)]
    pause_deadline_ms: u64,
    /// Envoy's fail_open: let requests through when the VM failed.
    #[arg(long)]
    fail_open: bool,
    /// Start the guest's wall clock this many ms ahead of real time (proxy_get_current_time_nanoseconds,
    /// WASI realtime clock; ticks and timeouts stay on real time).
    #[arg(long, default_value_t = 0, value_name = "MS")]
    clock_offset_ms: u64,
    /// How call tokens are numbered: shared (one counter for HTTP and Redis calls: 1, 2, 3...), per-kind
    /// (one counter per kind: the first HTTP call and the first Redis call both get 1) or envoy (as Envoy
    /// and Higress: HTTP 4, 8, 12...; Redis 7, 11, 15...). See the library's `tokens` module.
    #[arg(long, default_value_t = CallTokens::Shared, value_name = "shared|per-kind|envoy")]
    call_tokens: CallTokens,
    #[command(flatten)]
    faults: FaultArgs,
}

/// Faults injected on purpose (all off by default; see the library's `faults` module).
#[derive(Args)]
struct FaultArgs {
    /// Fault: proxy_set_effective_context answers BadArgument for the next N calls (4294967295: always).
    #[arg(long, default_value_t = 0, value_name = "N")]
    refuse_effective_context: u32,
    /// Fault: Redis calls are made but their replies are never delivered to the guest.
    #[arg(long)]
    drop_redis_replies: bool,
    /// Fault: HTTP calls are made but their responses are never delivered to the guest.
    #[arg(long)]
    drop_http_call_responses: bool,
    /// Fault: replies are delivered with a token the guest was never given (its own + 1000000).
    #[arg(long)]
    misroute_tokens: bool,
}

impl FaultArgs {
    fn faults(&self) -> Faults {
        Faults {
            refuse_effective_context: self.refuse_effective_context,
            drop_redis_replies: self.drop_redis_replies,
            drop_http_call_responses: self.drop_http_call_responses,
            misroute_tokens: self.misroute_tokens,
        }
    }
}

/// One request line (a [`RequestSpec`] plus the VM).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RequestLine {
    #[serde(default)]
    headers: Vec<(String, String)>,
    #[serde(default)]
    source_address: Option<String>,
    #[serde(default)]
    route_name: Option<String>,
    #[serde(default)]
    body: Option<String>,
    #[serde(default)]
    body_chunks: Vec<String>,
    #[serde(default)]
    response: Option<ResponseSpec>,
    #[serde(default)]
    vm: Option<usize>,
}

impl RequestLine {
    fn split(self) -> (Option<usize>, RequestSpec) {
        let spec = RequestSpec {
            headers: self.headers,
            source_address: self.source_address,
            route_name: self.route_name,
            body: self.body,
            body_chunks: self.body_chunks,
            response: self.response,
        };
        (self.vm, spec)
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(common) => build(&common).and_then(serve),
        Command::Replay { common, requests, concurrency, json, fuel_profile, function_profile } => {
            build_with(&common, fuel_profile, function_profile)
                .and_then(|host| replay(host, &requests, concurrency.max(1), json))
        }
    };
    match result {
        Ok(code) => code,
        Err(message) => {
            eprintln!("wasm-host: {message}");
            ExitCode::from(1)
        }
    }
}

fn parse_level(text: &str) -> Result<LogLevel, String> {
    serde_json::from_value(json!(text)).map_err(|_| format!("unknown log level {text:?}"))
}

fn build(common: &Common) -> Result<Host, String> {
    build_with(common, false, false)
}

fn build_with(common: &Common, fuel_profile: bool, function_profile: bool) -> Result<Host, String> {
    let mut builder = HostBuilder::new(&common.module)
        .host_flavour(common.host)
        .fuel_profile(fuel_profile)
        .function_profile(function_profile)
        .vms(common.vms)
        .log_level(parse_level(&common.log_level)?)
        .echo_logs(common.echo_logs)
        .pause_deadline(Duration::from_millis(common.pause_deadline_ms))
        .fail_open(common.fail_open)
        .clock_offset(Duration::from_millis(common.clock_offset_ms))
        .call_tokens(common.call_tokens)
        .faults(common.faults.faults());
    if let Some(path) = &common.config {
        let config = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        builder = builder.plugin_config(config);
    }
    for spec in &common.clusters {
        builder = builder.cluster_spec(spec).map_err(|e| e.to_string())?;
    }
    for spec in &common.redis_clusters {
        builder = builder.redis_cluster_spec(spec).map_err(|e| e.to_string())?;
    }
    for property in &common.properties {
        let (path, value) = property.split_once('=').ok_or_else(|| format!("bad property {property:?}: PATH=VALUE"))?;
        builder = builder.property(path, value.as_bytes().to_vec());
    }
    builder.build().map_err(|e| e.to_string())
}

/// Prints the refusal and the module's log lines; exit code 2.
fn refused(host: &Host) -> Option<ExitCode> {
    let reason = host.refusal()?;
    eprintln!("wasm-host: the plugin refused its configuration: {reason}");
    Some(ExitCode::from(2))
}

fn serve(mut host: Host) -> Result<ExitCode, String> {
    if let Some(code) = refused(&host) {
        return Ok(code);
    }
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout().lock();
    let mut turn = 0usize;
    for line in stdin.lock().lines() {
        let line = line.map_err(|e| format!("stdin: {e}"))?;
        if line.trim().is_empty() {
            continue;
        }
        let answer = serve_line(&mut host, &line, &mut turn);
        writeln!(stdout, "{answer}").map_err(|e| format!("stdout: {e}"))?;
        stdout.flush().map_err(|e| format!("stdout: {e}"))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The answer to one input line, with the line's `id` (if any) echoed.
fn serve_line(host: &mut Host, line: &str, turn: &mut usize) -> Value {
    let mut value: Value = match serde_json::from_str(line) {
        Ok(value) => value,
        Err(e) => return json!({"error": format!("not JSON: {e}")}),
    };
    let id = value.as_object_mut().and_then(|map| map.remove("id"));
    let mut answer = answer_line(host, value, turn);
    if let (Some(id), Some(map)) = (id, answer.as_object_mut()) {
        map.insert("id".into(), id);
    }
    answer
}

fn answer_line(host: &mut Host, value: Value, turn: &mut usize) -> Value {
    if let Some(faults) = value.get("faults") {
        if faults != &Value::Bool(true) {
            match Faults::deserialize(faults) {
                Ok(faults) => host.set_faults(faults),
                Err(e) => return json!({"error": format!("bad faults: {e}")}),
            }
        }
        return json!({"faults": host.faults()});
    }
    if let Some(ms) = value.get("advance_clock_ms").and_then(Value::as_u64) {
        let total = host.advance_clock(Duration::from_millis(ms));
        return json!({"clock_offset_ms": u64::try_from(total.as_millis()).unwrap_or(u64::MAX)});
    }
    if let Some(config) = value.get("configure") {
        let bytes = match config {
            Value::String(text) => text.clone().into_bytes(),
            other => other.to_string().into_bytes(),
        };
        return match host.reconfigure(bytes) {
            Ok(()) => json!({"configured": true}),
            Err(e) => json!({"error": e}),
        };
    }
    if let Some(prefix) = value.get("shared_data").and_then(Value::as_str) {
        return json!({"shared_data": host.shared_data_usage(prefix)});
    }
    if value.get("metrics").is_some() {
        return json!({"metrics": host.metrics()});
    }
    if value.get("logs").is_some() {
        return json!({"logs": host.take_logs()});
    }
    if let Some(ms) = value.get("wait_ms").and_then(Value::as_u64) {
        host.run_for(Duration::from_millis(ms));
        return json!({"waited_ms": ms});
    }
    if let Some(batch) = value.get("batch").and_then(Value::as_array) {
        let mut requests = Vec::new();
        for item in batch {
            match parse_request(item.clone(), host, turn) {
                Ok(request) => requests.push(request),
                Err(e) => return json!({"error": e}),
            }
        }
        let vms: Vec<usize> = requests.iter().map(|(vm, _)| *vm).collect();
        return match host.send_batch(requests) {
            Ok(outcomes) => {
                json!({"batch": outcomes.iter().zip(vms).map(|(o, vm)| with_vm(o, vm)).collect::<Vec<_>>()})
            }
            Err(e) => json!({"error": e.to_string()}),
        };
    }
    match parse_request(value, host, turn) {
        Ok((vm, spec)) => match host.send_request(vm, spec) {
            Ok(outcome) => with_vm(&outcome, vm),
            Err(e) => json!({"error": e.to_string()}),
        },
        Err(e) => json!({"error": e}),
    }
}

fn with_vm(outcome: &Outcome, vm: usize) -> Value {
    let mut value = outcome.to_json();
    if let Some(map) = value.as_object_mut() {
        map.insert("vm".into(), json!(vm));
    }
    value
}

fn parse_request(value: Value, host: &Host, turn: &mut usize) -> Result<(usize, RequestSpec), String> {
    let line: RequestLine = serde_json::from_value(value).map_err(|e| format!("bad request: {e}"))?;
    let (vm, spec) = line.split();
    let vm = vm.unwrap_or_else(|| {
        let vm = *turn % host.vm_count();
        *turn += 1;
        vm
    });
    Ok((vm, spec))
}

fn replay(mut host: Host, path: &PathBuf, concurrency: usize, as_json: bool) -> Result<ExitCode, String> {
    if let Some(code) = refused(&host) {
        return Ok(code);
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut requests = Vec::new();
    let mut turn = 0usize;
    for (number, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let value: Value = serde_json::from_str(line).map_err(|e| format!("{}:{}: {e}", path.display(), number + 1))?;
        requests.push(
            parse_request(value, &host, &mut turn).map_err(|e| format!("{}:{}: {e}", path.display(), number + 1))?,
        );
    }
    // The function profile covers the requests alone (not the VMs' start and configuration).
    host.reset_function_profile();
    let background_before: u64 = host.background_fuel().iter().sum();
    let started = Instant::now();
    let mut outcomes = Vec::with_capacity(requests.len());
    let mut pending = requests.into_iter().peekable();
    while pending.peek().is_some() {
        let batch: Vec<_> = pending.by_ref().take(concurrency).collect();
        outcomes.extend(host.send_batch(batch).map_err(|e| e.to_string())?);
    }
    let elapsed = started.elapsed();
    let summary = summarize(&outcomes, elapsed, &host);
    if as_json {
        println!("{summary}");
    } else {
        print_table(&summary);
    }
    if let Some(profile) = host.fuel_profile() {
        let requests = outcomes.len().max(1) as u64;
        eprintln!("fuel by segment (guest code between hostcalls), per request over {requests} requests:");
        for (segment, times, fuel) in profile.ranked() {
            eprintln!("{:>9} {:>7} calls  {segment}", fuel / requests, times);
        }
    }
    if let Some(profile) = host.function_profile() {
        let background = host.background_fuel().iter().sum::<u64>().saturating_sub(background_before);
        print_function_profile(&profile, outcomes.len(), background);
    }
    Ok(ExitCode::SUCCESS)
}

/// How many functions each function-profile table shows.
const TOP_FUNCTIONS: usize = 40;

/// The function profile on stderr, per request: the top functions by exclusive, then by inclusive fuel.
/// `background`: the fuel of guest calls made for no request during the run (ticks, late callbacks), which
/// the profile includes and the requests' fuel does not.
fn print_function_profile(profile: &FunctionProfile, requests: usize, background: u64) {
    let per = requests.max(1) as f64;
    let total = profile.total() as f64;
    eprintln!(
        "\nfuel by function, per request over {requests} requests (during the requests, VM start excluded; exact, \
         in wasm instructions):"
    );
    eprintln!(
        "  total {:.1} = requests {:.1} + outside any request (ticks, late callbacks) {:.1}; the profiler's \
         wrappers burnt {:.1} more, removed; {} calls not counted (traps)",
        total / per,
        (total - background as f64) / per,
        background as f64 / per,
        profile.wrapper_overhead as f64 / per,
        profile.discarded_frames
    );
    let table = |title: &str, rows: Vec<&FunctionStats>| {
        eprintln!("\ntop {TOP_FUNCTIONS} by {title} fuel:");
        eprintln!("  {:>10} {:>6} {:>10} {:>6} {:>9}  function", "exclusive", "%", "inclusive", "%", "calls");
        for f in rows.into_iter().take(TOP_FUNCTIONS) {
            let share = |fuel: u64| if total > 0.0 { 100.0 * fuel as f64 / total } else { 0.0 };
            eprintln!(
                "  {:>10.1} {:>6.1} {:>10.1} {:>6.1} {:>9.2}  {}",
                f.exclusive as f64 / per,
                share(f.exclusive),
                f.inclusive as f64 / per,
                share(f.inclusive),
                f.calls as f64 / per,
                f.name
            );
        }
    };
    table("exclusive", profile.by_exclusive());
    table("inclusive", profile.by_inclusive());
}

fn dist(samples: &[f64]) -> Value {
    json!(Distribution::of(samples))
}

fn summarize(outcomes: &[Outcome], elapsed: Duration, host: &Host) -> Value {
    let mut by_kind: BTreeMap<String, usize> = BTreeMap::new();
    let mut round_trips: BTreeMap<u32, usize> = BTreeMap::new();
    let (mut redis, mut http, mut latency, mut allowed, mut rejected) = (vec![], vec![], vec![], vec![], vec![]);
    for outcome in outcomes {
        let key = match outcome.status() {
            Some(status) => format!("{} {status}", outcome.kind()),
            None => outcome.kind().to_string(),
        };
        *by_kind.entry(key).or_default() += 1;
        if let Some(cost) = outcome.cost() {
            *round_trips.entry(cost.redis_calls).or_default() += 1;
            redis.push(f64::from(cost.redis_calls));
            http.push(f64::from(cost.http_calls));
            latency.push(cost.elapsed.as_secs_f64() * 1000.0);
            let fuel = cost.fuel as f64;
            match outcome {
                Outcome::Continued { .. } => allowed.push(fuel),
                Outcome::LocalReply { .. } => rejected.push(fuel),
                _ => {}
            }
        }
    }
    let seconds = elapsed.as_secs_f64();
    json!({
        "requests": outcomes.len(),
        "elapsed_s": seconds,
        "requests_per_s": if seconds > 0.0 { outcomes.len() as f64 / seconds } else { 0.0 },
        "outcomes": by_kind,
        "redis_round_trips": {"per_request": dist(&redis), "histogram": round_trips},
        "http_calls_per_request": dist(&http),
        "fuel_allowed": dist(&allowed),
        "fuel_rejected": dist(&rejected),
        "latency_ms": dist(&latency),
        "metrics": host.metrics().into_iter().map(|(k, v)| (k, v.value)).collect::<BTreeMap<_, _>>(),
    })
}

/// A field of a JSON object (`Null` if absent).
fn field<'a>(value: &'a Value, key: &str) -> &'a Value {
    value.get(key).unwrap_or(&Value::Null)
}

fn print_table(summary: &Value) {
    let num = |v: &Value, k: &str| field(v, k).as_f64().unwrap_or(0.0);
    println!(
        "requests: {}   elapsed: {:.3} s   ({:.1} req/s)",
        field(summary, "requests"),
        num(summary, "elapsed_s"),
        num(summary, "requests_per_s")
    );
    println!("\noutcome                 count");
    if let Some(map) = field(summary, "outcomes").as_object() {
        for (kind, n) in map {
            println!("  {kind:<20} {n:>6}");
        }
    }
    let row = |name: &str, d: &Value| {
        println!(
            "  {name:<28} {:>8} {:>14.1} {:>14.1} {:>14.1} {:>14.1}",
            field(d, "count"),
            num(d, "mean"),
            num(d, "p50"),
            num(d, "p99"),
            num(d, "max")
        );
    };
    let round_trips = field(summary, "redis_round_trips");
    println!("\n  {:<28} {:>8} {:>14} {:>14} {:>14} {:>14}", "per request", "count", "mean", "p50", "p99", "max");
    row("redis round trips", field(round_trips, "per_request"));
    row("http calls", field(summary, "http_calls_per_request"));
    row("fuel (allowed: continued)", field(summary, "fuel_allowed"));
    row("fuel (rejected: local reply)", field(summary, "fuel_rejected"));
    row("latency (ms)", field(summary, "latency_ms"));
    if let Some(map) = field(round_trips, "histogram").as_object() {
        let parts: Vec<String> = map.iter().map(|(k, v)| format!("{k}: {v}")).collect();
        println!("\nredis round trips per request (round trips: requests): {}", parts.join(", "));
    }
    if let Some(map) = field(summary, "metrics").as_object() {
        if !map.is_empty() {
            println!("\nmetrics");
            for (name, value) in map {
                println!("  {name:<40} {value}");
            }
        }
    }
}
