//! `erl-admin`: inspect and change edge-rate-limiter limiters in Redis. They are Redisson 4.x
//! `RRateLimiter`s (DESIGN.md, "Redisson's RRateLimiter layout"), so the tool works as well on limiters
//! a Java service made with Redisson.
//!
//! # Layout
//!
//! Each module uses only those listed before it (and `main` all of them):
//!
//! - [`error`]: every failure, worded for the operator.
//! - [`units`]: durations and times in ms, parsed from the options and written for humans.
//! - [`model`]: the limiter's Redisson layout without I/O: config fields, permit members, window summary,
//!   and what an acquire would meet in a window (as the acquire script counts it).
//! - [`counter`]: the sliding window counter layout (a rule's `layout: "sliding_window_counter"`) without
//!   I/O: its one hash counted as the acquire script counts it, the rule of a limiter name, `show`'s report.
//! - [`calendar`]: calendar quotas (a rule's `calendar`) without I/O: the same hash, one field per period,
//!   counted as the acquire script counts it; the zone names a configuration writes; `show`'s report.
//! - [`request`]: the request `explain` asks about, from its options, as the filter's key code sees it.
//! - [`report`]: what each operation returns (`serde` for `--json`).
//! - [`redis_io`]: one synchronous connection, to a Redis or a Redis Cluster (`--cluster`, see its docs);
//!   scripts by `EVALSHA`, `EVAL` on `NOSCRIPT`; reply decoding.
//! - [`plugin`]: plugin configurations loaded by the filter's own code (`validate`, `explain`).
//! - [`counter_ops`]: a sliding window counter's hash found, read and listed without writing.
//! - [`calendar_ops`]: `show` of a hash `{name}:counter`, a counter's or a calendar quota's.
//! - [`ops`]: the operations (show, set-rate, update-rate, try-set-rate, delete, list), on the filter's own
//!   scripts and key layout (the `edge_rate_limiter` crate), and the read-only reads `explain` makes.
//! - [`explain`]: a request's rules, limiters and verdict.
//! - [`counter_text`]: a sliding window counter's window as text (`show`, `explain`).
//! - [`calendar_text`]: a calendar quota's hash as text (`show`, `explain`), a rate per period.
//! - [`output`]: the reports as text.
//! - `main` (this file): the command line (`clap`), dispatch, exit codes (0 ok, 1 error or an invalid
//!   configuration, 2 usage).

pub mod calendar;
pub mod calendar_ops;
pub mod calendar_text;
pub mod cost_text;
pub mod counter;
pub mod counter_ops;
pub mod counter_text;
pub mod error;
pub mod explain;
pub mod model;
pub mod ops;
pub mod output;
pub mod plugin;
pub mod redis_io;
pub mod report;
pub mod request;
pub mod semaphore;
pub mod units;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::builder::FalseyValueParser;
use clap::{ArgAction, Args, Parser, Subcommand, ValueEnum};
use edge_rate_limiter::config::LimiterType;
use serde::Serialize;

use crate::calendar::ZoneNames;
use crate::error::{AdminError, Result};
use crate::model::{check_keep_alive, Config, Update};
use crate::plugin::{read_document, refusal_line, summarize, Build};
use crate::redis_io::{local_now_ms, Redis};
use crate::report::ValidateReport;
use crate::request::{parse_client_ip, parse_header, Header, Request};
use crate::units::{parse_duration, parse_interval, parse_keep_alive};

/// Inspect and change edge-rate-limiter limiters in Redis (Redisson RRateLimiter, 4.x layout).
///
/// A limiter NAME is the Redis key of its config hash, e.g. `erl:per-user:alice` (docs/configuration.md,
/// "Limiter names in Redis"); Redisson limiters are named as the Java code named them.
///
/// Redis Cluster: give --cluster (or ERL_REDIS_CLUSTER=true) and, as --url, a seed node of the cluster,
/// e.g. `erl-admin --cluster --url redis://:secret@10.0.0.5:6379 list`. The other nodes are found from the
/// seed; several seeds (comma-separated, or --url repeated) are tried in turn. Each limiter's commands go
/// to the master of its hash slot, `list` scans every master. There is no redis+cluster:// scheme.
#[derive(Debug, Parser)]
#[command(name = "erl-admin", version, max_term_width = 110)]
pub struct Cli {
    /// Redis URL: redis://[user:password@]host:port/db
    /// (with --cluster: a seed node of the cluster; several seeds: comma-separated or --url repeated)
    #[arg(
        long,
        env = "ERL_REDIS_URL",
        default_value = "redis://127.0.0.1:6379/0",
        global = true,
        action = ArgAction::Append
    )]
    url: Vec<String>,
    /// The URL names a node of a Redis Cluster: reach every master through it
    #[arg(long, env = "ERL_REDIS_CLUSTER", global = true, value_parser = FalseyValueParser::new())]
    cluster: bool,
    /// Client id (a UUID) whose keys of a per-client limiter to show or change
    #[arg(long, value_name = "UUID", global = true)]
    client_id: Option<String>,
    /// Print JSON instead of text
    #[arg(long, global = true)]
    json: bool,
    /// Clock for "now" (window, ages): local, as Redisson clients and the gateway by default, or Redis TIME
    #[arg(long, value_enum, default_value_t = ClockArg::Local, global = true)]
    clock: ClockArg,
    /// Connect and command timeout (e.g. 500ms, 5s)
    #[arg(long, default_value = "5s", value_parser = parse_duration, global = true)]
    timeout: Duration,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ClockArg {
    /// This machine's clock
    Local,
    /// Redis's TIME
    Redis,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum TypeArg {
    /// One window for every gateway and Redisson client (Redisson RateType.OVERALL)
    Overall,
    /// One window per client instance (Redisson RateType.PER_CLIENT)
    #[value(alias = "per_client")]
    PerClient,
}

impl From<TypeArg> for LimiterType {
    fn from(arg: TypeArg) -> Self {
        match arg {
            TypeArg::Overall => LimiterType::Overall,
            TypeArg::PerClient => LimiterType::PerClient,
        }
    }
}

/// The build that loads a configuration: regular expressions or not is this tool's own build's (cargo
/// feature `regex`: as the -regex artifacts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BuildArg {
    /// edge-rate-limiter-envoy[-regex].wasm: stock Envoy, Istio (redis.transport "http" only)
    Envoy,
    /// edge-rate-limiter-higress[-regex].wasm: Higress ("host" or "http")
    Higress,
}

impl From<BuildArg> for Build {
    fn from(arg: BuildArg) -> Self {
        match arg {
            BuildArg::Envoy => Build::Envoy,
            BuildArg::Higress => Build::Higress,
        }
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Config, available permits, permits in the window (reservations in flight and settled costs listed
    /// apart), TTLs (per-client limiters: every client found); of an in-flight rule's semaphore: the
    /// permits free and held, each one's lease and holder (a gateway's permits share the start of its
    /// client id); of a sliding window counter or a calendar quota (a hash `{NAME}:counter`, no config hash):
    /// its slices or periods, and with --config its rule's rate, what is left and when permits free again
    Show {
        /// Limiter or semaphore name
        name: String,
        /// A counter's or calendar quota's plugin configuration (JSON; - reads stdin): its rate and window are
        /// its rule's (the rule whose `limiter` starts the name)
        #[arg(long, value_name = "PLUGIN_JSON")]
        config: Option<String>,
        /// With --config: the rule, when several rules' limiters could have the name
        #[arg(long, requires = "config")]
        rule: Option<String>,
    },
    /// Write the config and reset the state (Redisson setRate)
    SetRate {
        /// Limiter name
        name: String,
        #[command(flatten)]
        rate: RateArgs,
    },
    /// Change the config keeping consumed permits, no burst (Redisson 4.4+ setRate keeping state);
    /// options not given keep their current value
    UpdateRate {
        /// Limiter name
        name: String,
        /// Permits per interval
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        rate: Option<u64>,
        /// Window length: 1s, 1m, 1h 30m, or ms as a number
        #[arg(long, value_parser = parse_interval)]
        interval: Option<u64>,
        /// Limiter type (a change resets the state)
        #[arg(long = "type", value_enum)]
        limiter_type: Option<TypeArg>,
        /// keepAliveTime: unused keys expire after this long; 0 = never
        #[arg(long, value_parser = parse_keep_alive)]
        keep_alive: Option<u64>,
    },
    /// Create the limiter unless it exists; an existing one is left as it is (Redisson trySetRate)
    TrySetRate {
        /// Limiter name
        name: String,
        #[command(flatten)]
        rate: RateArgs,
    },
    /// Remove every key of the limiter, every client's state too (Redisson delete)
    Delete {
        /// Limiter name
        name: String,
    },
    /// Limiters whose name starts with PREFIX: hashes with the fields rate and interval
    List {
        /// Name prefix
        #[arg(default_value = "erl:")]
        prefix: String,
    },
    /// Check a plugin configuration as the filter loads it (no Redis): a summary and exit 0, or the
    /// filter's own refusal line (`edge-rate-limiter: invalid configuration: ...`) and exit 1
    Validate {
        /// The plugin configuration (JSON); - reads stdin
        config: String,
        /// The build that loads it
        #[arg(long, value_enum, default_value_t = BuildArg::Envoy)]
        build: BuildArg,
    },
    /// Which rules a request meets, their limiters' state in Redis, and whether and when it is allowed
    /// (reads only: nothing is written)
    Explain {
        /// The plugin configuration (JSON); - reads stdin
        config: String,
        #[command(flatten)]
        request: RequestArgs,
    },
}

/// The request `explain` asks about.
#[derive(Debug, Args)]
struct RequestArgs {
    /// A request header, name:value (repeatable; a pseudo-header as :name:value)
    #[arg(long = "header", short = 'H', value_name = "NAME:VALUE", value_parser = parse_header)]
    headers: Vec<Header>,
    /// The :path, query string included [default: /]
    #[arg(long)]
    path: Option<String>,
    /// The :authority, host[:port] (selects a _rules_ entry by domain)
    #[arg(long)]
    authority: Option<String>,
    /// The route name (Envoy: the route's name; Higress: namespace/name) (selects a _rules_ entry)
    #[arg(long)]
    route: Option<String>,
    /// The client address (the source.address property), with or without a port
    #[arg(long, value_name = "IP", value_parser = parse_client_ip)]
    client_ip: Option<SocketAddr>,
}

impl RequestArgs {
    fn request(&self) -> Request {
        Request::new(
            &self.headers,
            self.path.as_deref(),
            self.authority.as_deref(),
            self.client_ip,
            self.route.as_deref(),
        )
    }
}

/// What a command prints, and whether it reports a failure (exit code 1) without an error.
struct Printed {
    text: String,
    failed: bool,
}

impl From<String> for Printed {
    fn from(text: String) -> Self {
        Printed { text, failed: false }
    }
}

#[derive(Debug, Args)]
struct RateArgs {
    /// Permits per interval
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    rate: u64,
    /// Window length: 1s, 1m, 1h 30m, or ms as a number
    #[arg(long, value_parser = parse_interval)]
    interval: u64,
    /// Limiter type
    #[arg(long = "type", value_enum, default_value_t = TypeArg::Overall)]
    limiter_type: TypeArg,
    /// keepAliveTime: unused keys expire after this long; 0 = never (a TTL left on the hash is removed)
    #[arg(long, value_parser = parse_keep_alive, default_value = "0")]
    keep_alive: u64,
}

impl RateArgs {
    fn config(&self) -> Result<Config> {
        let config = Config {
            rate: self.rate,
            interval_ms: self.interval,
            limiter_type: self.limiter_type.into(),
            keep_alive_ms: self.keep_alive,
        };
        check_keep_alive(&config)?;
        Ok(config)
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(Printed { text, failed }) => {
            print!("{text}");
            if failed {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(error) => {
            if cli.json {
                let body = serde_json::json!({ "error": error.to_string() });
                println!("{body}");
            }
            eprintln!("erl-admin: error: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Runs the command; returns what to print.
fn run(cli: &Cli) -> Result<Printed> {
    match &cli.command {
        Command::Validate { config, build } => validate(cli.json, config, (*build).into()),
        Command::Explain { config, request } => {
            // Refused before connecting: an invalid configuration needs no Redis.
            let (plugin, zones) = load_plugin(config)?;
            let mut session = Session::open(cli)?;
            let client_id = session.client_id.as_deref();
            let now_ms = session.now_ms;
            let report = explain::explain(&mut session.redis, &plugin, &zones, request.request(), client_id, now_ms)?;
            render(cli.json, &report, output::explain).map(Printed::from)
        }
        command => on_limiters(cli, command, Session::open(cli)?).map(Printed::from),
    }
}

/// A connection to the limiters' Redis, with the client id selected (`--client-id`) and "now" (`--clock`).
struct Session {
    redis: Redis,
    client_id: Option<String>,
    now_ms: u64,
}

impl Session {
    fn open(cli: &Cli) -> Result<Self> {
        let client_id = match &cli.client_id {
            Some(id) => Some(validate_client_id(id)?),
            None => None,
        };
        let mut redis = connect(cli)?;
        let now_ms = match cli.clock {
            ClockArg::Local => local_now_ms(),
            ClockArg::Redis => redis.time_ms()?,
        };
        Ok(Session { redis, client_id, now_ms })
    }
}

/// The commands on one limiter or a list of them; returns what to print.
fn on_limiters(cli: &Cli, command: &Command, session: Session) -> Result<String> {
    let Session { mut redis, client_id, now_ms } = session;
    let client_id = client_id.as_deref();
    match command {
        // Answered by `run`.
        Command::Validate { .. } | Command::Explain { .. } => Ok(String::new()),
        Command::Show { name, .. } if semaphore::is_semaphore(&mut redis, name)? => {
            let report = semaphore::show(&mut redis, name, now_ms)?;
            render(cli.json, &report, semaphore::text_of)
        }
        Command::Show { name, config, rule } if counter_ops::is_counter(&mut redis, name)? => {
            let loaded = config.as_deref().map(load_plugin).transpose()?;
            let config = loaded.as_ref().map(|(plugin, zones)| (plugin, zones));
            let report = calendar_ops::show(&mut redis, name, config, rule.as_deref(), now_ms)?;
            render(cli.json, &report, calendar_text::show_hash)
        }
        Command::Show { name, .. } => {
            let report = ops::show(&mut redis, name, client_id, now_ms)?;
            render(cli.json, &report, output::show)
        }
        Command::SetRate { name, rate } => {
            let report = ops::set_rate(&mut redis, name, rate.config()?, client_id)?;
            render(cli.json, &report, output::change)
        }
        Command::TrySetRate { name, rate } => {
            let report = ops::try_set_rate(&mut redis, name, rate.config()?, client_id)?;
            render(cli.json, &report, output::change)
        }
        Command::UpdateRate { name, rate, interval, limiter_type, keep_alive } => {
            let update = Update {
                rate: *rate,
                interval_ms: *interval,
                limiter_type: limiter_type.map(Into::into),
                keep_alive_ms: *keep_alive,
            };
            if update == Update::default() {
                return Err(AdminError::Usage(
                    "update-rate: nothing to change (give --rate, --interval, --type or --keep-alive)".to_string(),
                ));
            }
            let report = ops::update_rate(&mut redis, name, update, client_id, now_ms)?;
            render(cli.json, &report, output::change)
        }
        Command::Delete { name } => {
            let report = ops::delete(&mut redis, name, client_id)?;
            render(cli.json, &report, output::delete)
        }
        Command::List { prefix } => {
            let entries = ops::list(&mut redis, prefix, now_ms)?;
            render(cli.json, &entries, |entries| output::list(entries))
        }
    }
}

/// The plugin configuration at `path` as the filter loads it (either transport: which rules apply does not
/// depend on the build), and the zone names its calendar rules write.
fn load_plugin(path: &str) -> Result<(edge_rate_limiter::config::Plugin, ZoneNames)> {
    let bytes = read_document(path)?;
    let plugin =
        plugin::load(&bytes, Build::Higress).map_err(|reason| AdminError::InvalidPlugin(refusal_line(&reason)))?;
    Ok((plugin, ZoneNames::read(&bytes)))
}

/// `validate`: loads the configuration as `build` does; exit 1 when it refuses it.
fn validate(json: bool, path: &str, build: Build) -> Result<Printed> {
    let bytes = read_document(path)?;
    let build_name = build.name();
    let report = match plugin::load(&bytes, build) {
        Ok(plugin) => {
            let configurations = summarize(&plugin, &ZoneNames::read(&bytes));
            ValidateReport { valid: true, build: build_name, error: None, configurations }
        }
        Err(reason) => ValidateReport {
            valid: false,
            build: build_name,
            error: Some(refusal_line(&reason)),
            configurations: Vec::new(),
        },
    };
    let text = render(json, &report, output::validate)?;
    Ok(Printed { text, failed: !report.valid })
}

/// The connection `--url` and `--cluster` ask for.
fn connect(cli: &Cli) -> Result<Redis> {
    if cli.cluster {
        return Redis::connect_cluster(&seeds(&cli.url), cli.timeout);
    }
    match cli.url.as_slice() {
        [url] => Redis::connect(url, cli.timeout),
        _ => Err(AdminError::Usage(
            "several --url are seed nodes of a Redis Cluster: add --cluster (or ERL_REDIS_CLUSTER=true)".to_string(),
        )),
    }
}

/// The seed URLs of `--cluster`: every `--url`, each split at commas.
fn seeds(urls: &[String]) -> Vec<String> {
    urls.iter()
        .flat_map(|url| url.split(','))
        .map(str::trim)
        .filter(|seed| !seed.is_empty())
        .map(String::from)
        .collect()
}

fn render<T: Serialize + ?Sized>(json: bool, report: &T, text: impl Fn(&T) -> String) -> Result<String> {
    if json {
        serde_json::to_string_pretty(report)
            .map(|mut body| {
                body.push('\n');
                body
            })
            .map_err(|error| AdminError::Usage(format!("cannot write JSON: {error}")))
    } else {
        Ok(text(report))
    }
}

/// A client id as Redisson writes it: the hyphenated lowercase form of a UUID.
fn validate_client_id(id: &str) -> Result<String> {
    uuid::Uuid::parse_str(id)
        .map(|uuid| uuid.hyphenated().to_string())
        .map_err(|_| AdminError::BadClientId(id.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn options_may_follow_the_subcommand() {
        let cli = Cli::try_parse_from([
            "erl-admin",
            "set-rate",
            "erl:x",
            "--rate",
            "3",
            "--interval",
            "1m",
            "--type",
            "per_client",
            "--json",
        ])
        .unwrap();
        assert!(cli.json);
        let Command::SetRate { rate, .. } = cli.command else { panic!("set-rate") };
        assert_eq!(rate.config().unwrap().limiter_type, LimiterType::PerClient);
        assert_eq!(rate.config().unwrap().keep_alive_ms, 0);
    }

    #[test]
    fn cluster_seeds_come_from_repeated_or_comma_separated_urls() {
        let seeds_of = |args: &[&str]| {
            let cli = Cli::try_parse_from(args).unwrap();
            assert!(cli.cluster);
            seeds(&cli.url)
        };
        let expected = ["redis://10.0.0.1:7000", "redis://10.0.0.2:7000", "redis://:pw@10.0.0.3:7000"];
        let (both, third) = ("redis://10.0.0.1:7000, redis://10.0.0.2:7000,", "redis://:pw@10.0.0.3:7000");
        assert_eq!(seeds_of(&["erl-admin", "--cluster", "--url", both, "--url", third, "list"]), expected);
        assert_eq!(seeds_of(&["erl-admin", "list", "--cluster", "--url", both, "--url", third]), expected);
        let plain = Cli::try_parse_from(["erl-admin", "list"]).unwrap();
        assert!(!plain.cluster);
        assert_eq!(plain.url, ["redis://127.0.0.1:6379/0"]);
    }

    #[test]
    fn several_urls_without_cluster_are_refused_before_connecting() {
        let cli = Cli::try_parse_from(["erl-admin", "--url", "redis://a:1", "--url", "redis://b:2", "list"]).unwrap();
        let Err(AdminError::Usage(message)) = connect(&cli) else { panic!("a usage error") };
        assert!(message.contains("add --cluster"), "{message}");
    }

    #[test]
    fn show_takes_a_counters_configuration_and_rule() {
        let cli = Cli::try_parse_from(["erl-admin", "show", "erl:u:a", "--config", "p.json", "--rule", "u"]).unwrap();
        let Command::Show { name, config, rule } = cli.command else { panic!("show") };
        assert_eq!((name.as_str(), config.as_deref(), rule.as_deref()), ("erl:u:a", Some("p.json"), Some("u")));
        let error = Cli::try_parse_from(["erl-admin", "show", "erl:u:a", "--rule", "u"]).unwrap_err();
        assert_eq!(error.exit_code(), 2, "--rule needs --config");
    }

    #[test]
    fn client_ids_are_uuids() {
        assert_eq!(
            validate_client_id("6F9619FF-8B86-D011-B42D-00C04FC964FF").unwrap(),
            "6f9619ff-8b86-d011-b42d-00c04fc964ff"
        );
        assert_eq!(validate_client_id("gateway-1"), Err(AdminError::BadClientId("gateway-1".into())));
    }

    #[test]
    fn explain_takes_a_request_as_options() {
        let cli = Cli::try_parse_from([
            "erl-admin",
            "explain",
            "plugin.json",
            "-H",
            "X-User-Id: alice",
            "--header",
            "x-api-key:k:1",
            "--path",
            "/login?next=/",
            "--authority",
            "api.example:8443",
            "--route",
            "default/login",
            "--client-ip",
            "10.0.0.7",
            "--client-id",
            "6f9619ff-8b86-d011-b42d-00c04fc964ff",
            "--json",
        ])
        .unwrap();
        assert!(cli.json);
        let Command::Explain { config, request } = cli.command else { panic!("explain") };
        assert_eq!(config, "plugin.json");
        let request = request.request();
        let view = |name: &str| edge_rate_limiter::key::RequestView::header(&request, name);
        assert_eq!(view("x-user-id"), Some(b"alice".to_vec()));
        assert_eq!(view("x-api-key"), Some(b"k:1".to_vec()));
        assert_eq!(view(":path"), Some(b"/login?next=/".to_vec()));
        assert_eq!(request.authority(), Some("api.example:8443"));
        assert_eq!(request.route.as_deref(), Some("default/login"));
        assert_eq!(request.client_address.as_deref(), Some("10.0.0.7:0"));
    }

    #[test]
    fn explain_and_validate_refuse_malformed_options() {
        for args in [
            &["erl-admin", "explain", "p.json", "--header", "no-colon"][..],
            &["erl-admin", "explain", "p.json", "--client-ip", "gateway-1"],
            &["erl-admin", "explain"],
            &["erl-admin", "validate", "p.json", "--build", "istio"],
        ] {
            let error = Cli::try_parse_from(args).unwrap_err();
            assert_eq!(error.exit_code(), 2, "{args:?}");
        }
        let cli = Cli::try_parse_from(["erl-admin", "validate", "-", "--build", "higress"]).unwrap();
        let Command::Validate { config, build } = cli.command else { panic!("validate") };
        assert_eq!((config.as_str(), Build::from(build)), ("-", Build::Higress));
    }

    #[test]
    fn validate_needs_no_redis_and_fails_with_the_refusal() {
        let dir = std::env::temp_dir().join(format!("erl-admin-validate-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bad.json");
        std::fs::write(&path, r#"{"redis":{"cluster":"c"},"rules":[]}"#).unwrap();
        let path = path.to_string_lossy().into_owned();
        // An unreachable URL: validate never connects.
        let cli =
            Cli::try_parse_from(["erl-admin", "--url", "redis://127.0.0.1:1", "validate", path.as_str()]).unwrap();
        let printed = run(&cli).unwrap();
        assert!(printed.failed);
        assert_eq!(printed.text, "edge-rate-limiter: invalid configuration: rules: at least one rule is required\n");
        let missing = Cli::try_parse_from(["erl-admin", "validate", "/nonexistent/plugin.json"]).unwrap();
        assert!(matches!(run(&missing), Err(AdminError::ConfigFile { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
