//! The host: builds VMs from a module, starts them as Envoy does, and runs the event loop that delivers
//! HTTP call responses, Redis replies, queue notifications and ticks while streams wait.
//!
//! VM start (proxy-wasm-cpp-host `WasmBase::initialize`/`startVm`/`start`/`configure`; observed in Envoy
//! 1.40): instantiate; `_initialize` then `main(0, 0)` if exported (a WASI reactor), else `_start`, with
//! only logging, clock, random, arguments and environment allowed; then the root context (id 1):
//! `proxy_on_context_create(1, 0)`, `proxy_on_vm_start(1, vm_configuration_size)`,
//! `proxy_on_configure(1, plugin_configuration_size)`. `false` from either, or a trap, means the plugin
//! did not load: Envoy logs "Plugin ... failed to load" and exits; here every request answers
//! [`Outcome::Refused`].
//!
//! All VMs run on the calling thread, round-robin: each is its own wasmtime store and instance with its own
//! root context (Envoy: one per worker thread); shared data and metrics are common to all.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::abi::{AbiVersion, LogLevel};
use crate::engine::{Engine, Imports, Instance, Module, Store, TypedFunc, WasmParams, WasmResults};
use crate::error::HostError;
use crate::exchange::{Cost, Outcome, RequestSpec};
use crate::faults::{CallKind, Fate, Faults, MISROUTE_OFFSET};
use crate::flavour::HostFlavour;
use crate::profile::{FunctionProfile, FunctionProfiler};
use crate::shared::{lock, LogLine, LogSource, MetricValue, Shared};
use crate::stream::StreamRun;
use crate::tokens::CallTokens;
use crate::vm::{Context, Event, Setup, UpstreamSpec, VmState};
use crate::{engine, hostcalls, profile, redis, wasi};

/// Builds a [`Host`].
#[derive(Clone, Debug)]
pub struct HostBuilder {
    module: ModuleSource,
    setup: Setup,
    /// [`HostBuilder::higress_properties`], if given: overrides the flavour's choice.
    higress_properties: Option<bool>,
    vms: usize,
    log_level: LogLevel,
    echo_logs: bool,
    fuel_profile: bool,
    function_profile: bool,
    pause_deadline: Duration,
    fuel_per_call: u64,
    faults: Faults,
    clock_offset: Duration,
}

#[derive(Clone, Debug)]
enum ModuleSource {
    Path(PathBuf),
    Bytes(Vec<u8>),
}

impl HostBuilder {
    /// A host for the module at `path` (a `.wasm` file).
    pub fn new(path: impl AsRef<Path>) -> Self {
        Self::with_module(ModuleSource::Path(path.as_ref().to_path_buf()))
    }

    /// A host for a module given as bytes (binary, or WebAssembly text if it came from the `wat` crate).
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Self {
        Self::with_module(ModuleSource::Bytes(bytes.into()))
    }

    fn with_module(module: ModuleSource) -> Self {
        HostBuilder {
            module,
            setup: Setup {
                plugin_config: Vec::new(),
                vm_config: Vec::new(),
                plugin_name: "plugin".into(),
                root_id: String::new(),
                vm_id: String::new(),
                clusters: BTreeMap::new(),
                redis_clusters: BTreeMap::new(),
                properties: BTreeMap::new(),
                upstream: UpstreamSpec::default(),
                destination_address: "127.0.0.1:10000".into(),
                http_call_max: Duration::from_secs(60),
                redis_connect_timeout: Duration::from_secs(1),
                fail_open: false,
                higress_properties: true,
                flavour: HostFlavour::default(),
                call_tokens: CallTokens::default(),
            },
            higress_properties: None,
            vms: 1,
            log_level: LogLevel::Info,
            echo_logs: false,
            fuel_profile: false,
            function_profile: false,
            pause_deadline: Duration::from_secs(5),
            fuel_per_call: 5_000_000_000,
            faults: Faults::NONE,
            clock_offset: Duration::ZERO,
        }
    }

    /// The plugin configuration (Envoy: `configuration`), e.g. JSON text.
    pub fn plugin_config(mut self, config: impl Into<Vec<u8>>) -> Self {
        self.setup.plugin_config = config.into();
        self
    }

    /// The VM configuration (Envoy: `vm_config.configuration`).
    pub fn vm_config(mut self, config: impl Into<Vec<u8>>) -> Self {
        self.setup.vm_config = config.into();
        self
    }

    /// How many VMs (Envoy: worker threads, `--concurrency`); at least 1.
    pub fn vms(mut self, count: usize) -> Self {
        self.vms = count.max(1);
        self
    }

    /// A cluster for HTTP calls and Redis: its name and address (loopback).
    pub fn cluster(mut self, name: impl Into<String>, address: SocketAddr) -> Self {
        self.setup.clusters.insert(name.into(), address);
        self
    }

    /// A cluster from `NAME=127.0.0.1:PORT`.
    ///
    /// # Errors
    /// [`HostError::BadCluster`] if the text is not of that form or the address is not 127.0.0.1.
    pub fn cluster_spec(self, spec: &str) -> Result<Self, HostError> {
        let (name, address) = spec.split_once('=').ok_or_else(|| HostError::BadCluster(spec.into()))?;
        let address: SocketAddr = address.parse().map_err(|_| HostError::BadCluster(spec.into()))?;
        if !address.ip().is_loopback() || name.is_empty() {
            return Err(HostError::BadCluster(spec.into()));
        }
        Ok(self.cluster(name, address))
    }

    /// A cluster of type `envoy.clusters.redis` (a Redis Cluster, its nodes as seeds) for the Redis
    /// extension: `proxy_redis_init` accepts it, `proxy_redis_call` answers InternalFailure as Higress does
    /// (`redis.rs`).
    pub fn redis_cluster(mut self, name: impl Into<String>, seeds: Vec<SocketAddr>) -> Self {
        self.setup.redis_clusters.insert(name.into(), seeds);
        self
    }

    /// A Redis Cluster from `NAME=127.0.0.1:PORT[,127.0.0.1:PORT...]`.
    ///
    /// # Errors
    /// [`HostError::BadCluster`] if the text is not of that form or an address is not loopback.
    pub fn redis_cluster_spec(self, spec: &str) -> Result<Self, HostError> {
        let bad = || HostError::BadCluster(spec.into());
        let (name, addresses) = spec.split_once('=').ok_or_else(bad)?;
        let seeds = addresses
            .split(',')
            .map(|address| address.parse::<SocketAddr>().ok().filter(|a| a.ip().is_loopback()).ok_or_else(bad))
            .collect::<Result<Vec<_>, _>>()?;
        if name.is_empty() {
            return Err(bad());
        }
        Ok(self.redis_cluster(name, seeds))
    }

    /// A property (dotted path, e.g. `node.id`) with raw bytes; overrides the built-in ones.
    pub fn property(mut self, path: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        self.setup.properties.insert(path.into(), value.into());
        self
    }

    /// The plugin's `name`, `root_id` and `vm_config.vm_id` (properties `plugin_name`, `plugin_root_id`,
    /// `plugin_vm_id`).
    pub fn plugin_names(mut self, name: &str, root_id: &str, vm_id: &str) -> Self {
        self.setup.plugin_name = name.into();
        self.setup.root_id = root_id.into();
        self.setup.vm_id = vm_id.into();
        self
    }

    /// The emulated upstream's response (default: 200, `text/plain`, `upstream ok\n`).
    pub fn upstream(mut self, status: u16, headers: &[(&str, &str)], body: impl Into<Vec<u8>>) -> Self {
        self.setup.upstream = UpstreamSpec {
            status,
            headers: headers.iter().map(|(k, v)| (k.to_ascii_lowercase(), v.to_string())).collect(),
            body: body.into(),
        };
        self
    }

    /// Lines below this level are dropped (default info, as Envoy).
    pub fn log_level(mut self, level: LogLevel) -> Self {
        self.log_level = level;
        self
    }

    /// Print every log line on stderr as it is written.
    pub fn echo_logs(mut self, echo: bool) -> Self {
        self.echo_logs = echo;
        self
    }

    /// Record where the guest spends its fuel, by segment between hostcalls ([`crate::shared::FuelProfile`],
    /// read with [`Host::fuel_profile`]); off by default (it costs the host a little per hostcall).
    pub fn fuel_profile(mut self, on: bool) -> Self {
        self.fuel_profile = on;
        self
    }

    /// Record which guest functions spend the fuel, inclusive and exclusive, exactly (fuel units ≈ wasm
    /// instructions; read with [`Host::function_profile`]); off by default. The module is instrumented
    /// before it is compiled (a wrapper around every function, see [`crate::profile`]), which makes the
    /// guest slower and costs the host two calls per guest call, but changes no result: the wrappers' fuel
    /// is removed from the profile and from [`crate::Cost::fuel`]. Independent of [`HostBuilder::fuel_profile`],
    /// whose segments, when both are on, include the wrappers' fuel. Only on wasmtime (feature `wasmtime`,
    /// [`crate::engine`]): [`HostBuilder::build`] refuses it on wasmi ([`HostError::Instrument`]).
    pub fn function_profile(mut self, on: bool) -> Self {
        self.function_profile = on;
        self
    }

    /// How long a paused stream may wait before it counts as [`Outcome::Paused`] (default 5 s).
    pub fn pause_deadline(mut self, deadline: Duration) -> Self {
        self.pause_deadline = deadline;
        self
    }

    /// Fuel for one guest call (a runaway guest traps when it runs out; default 5e9).
    pub fn fuel_per_call(mut self, fuel: u64) -> Self {
        self.fuel_per_call = fuel;
        self
    }

    /// Envoy's `fail_open`: when a VM failed, let its requests through (default: answer 503).
    pub fn fail_open(mut self, fail_open: bool) -> Self {
        self.setup.fail_open = fail_open;
        self
    }

    /// Serve Higress's top-level `route_name`/`cluster_name` properties (default: as the flavour does, on
    /// but for [`HostFlavour::Envoy`]); false answers NotFound for them, as stock Envoy 1.40 does.
    pub fn higress_properties(mut self, on: bool) -> Self {
        self.higress_properties = Some(on);
        self
    }

    /// The host to play (default [`HostFlavour::Compat`], see [`crate::flavour`]): which ABI versions, WASI
    /// functions, hostcalls, foreign functions and properties the module finds.
    pub fn host_flavour(mut self, flavour: HostFlavour) -> Self {
        self.setup.flavour = flavour;
        self
    }

    /// How call tokens are numbered in every VM (default [`CallTokens::Shared`]: one counter for HTTP and
    /// Redis calls, 1, 2, 3, ...). [`CallTokens::PerKind`]: one counter per kind from the same start, so the
    /// first HTTP call and the first Redis call of a VM both get token 1, and each reply still reaches its
    /// own callback with its own token; [`CallTokens::Envoy`]: as Envoy and Higress (HTTP 4, 8, ...; Redis
    /// 7, 11, ...). Envoy's and Higress's numbering and its sources: [`crate::tokens`].
    pub fn call_tokens(mut self, numbering: CallTokens) -> Self {
        self.setup.call_tokens = numbering;
        self
    }

    /// Longest wait for an HTTP call without a timeout (Envoy: none; default 60 s here).
    pub fn http_call_max(mut self, max: Duration) -> Self {
        self.setup.http_call_max = max;
        self
    }

    /// Faults to inject from the start (default none; see [`crate::faults`]); [`Host::set_faults`] changes
    /// them later.
    pub fn faults(self, faults: Faults) -> Self {
        HostBuilder { faults, ..self }
    }

    /// Starts the guest's wall clock this far ahead of real time (default 0): `proxy_get_current_time_nanoseconds`
    /// and WASI `clock_time_get` for the realtime clock answer real time plus the offset. The monotonic
    /// clock, tick delivery, pause deadlines and call timeouts stay on real time. [`Host::advance_clock`]
    /// moves it further.
    pub fn clock_offset(self, clock_offset: Duration) -> Self {
        HostBuilder { clock_offset, ..self }
    }

    /// Checks the module's ABI and imports, compiles it and starts every VM.
    ///
    /// # Errors
    /// Reading, compiling or linking the module; an import this host does not provide
    /// ([`HostError::MissingImports`], naming each `module.name`); no ABI version the flavour supports
    /// ([`HostError::UnknownAbi`], [`HostError::AbiNotSupported`]); an export with the wrong type. The ABI and
    /// the imports are checked before the module is compiled (a refusal costs no compilation). A plugin that
    /// refuses its configuration is not an error: see [`Host::refusal`].
    pub fn build(self) -> Result<Host, HostError> {
        let bytes = match &self.module {
            ModuleSource::Path(path) => {
                std::fs::read(path).map_err(|source| HostError::ReadModule { path: path.clone(), source })?
            }
            ModuleSource::Bytes(bytes) => bytes.clone(),
        };
        if self.function_profile && !engine::EXACT_FUEL {
            return Err(HostError::Instrument(format!(
                "the function profile needs exact fuel, which {} does not count: build the emulator with \
                 --features wasmtime (make bench does)",
                engine::NAME
            )));
        }
        let engine = engine::metering_engine().map_err(HostError::Engine)?;
        // The imports and exports from the module's header sections; a module wasmparser cannot read is
        // compiled first, for wasmtime's own error.
        let mut compiled = None;
        let surface = match Surface::read(&bytes) {
            Some(surface) => surface,
            None => {
                let module = self.compile(&engine, &bytes)?;
                let surface = Surface::of(&module.0);
                compiled = Some(module);
                surface
            }
        };
        let flavour = self.setup.flavour;
        let abi = detect_abi(flavour, &surface.exports)?;
        let mut linker = Imports::new(&engine);
        hostcalls::link(&mut linker, abi, flavour).map_err(|e| HostError::Engine(e.to_string()))?;
        if flavour.redis_extension() {
            redis::link(&mut linker).map_err(|e| HostError::Engine(e.to_string()))?;
        }
        wasi::link(&mut linker, flavour).map_err(|e| HostError::Engine(e.to_string()))?;
        if self.function_profile {
            profile::link(&mut linker).map_err(|e| HostError::Engine(e.to_string()))?;
        }
        check_imports(&surface.imports, &linker)?;
        let (module, functions) = match compiled {
            Some(module) => module,
            None => self.compile(&engine, &bytes)?,
        };

        let shared = Shared::with_profile(self.log_level, self.echo_logs, self.fuel_profile);
        *lock(&shared.faults) = self.faults;
        shared.advance_clock(self.clock_offset);
        let mut setup = self.setup;
        setup.higress_properties = self.higress_properties.unwrap_or(flavour.higress_properties());
        let setup = Arc::new(setup);
        let (sender, receiver) = mpsc::channel();
        let mut host = Host {
            shared,
            setup,
            vms: Vec::new(),
            events: receiver,
            sender,
            streams: HashMap::new(),
            pause_deadline: self.pause_deadline,
            fuel_per_call: self.fuel_per_call,
            refusal: None,
            next_connection_id: 1,
        };
        for index in 0..self.vms {
            let mut state =
                VmState::new(index, abi, Arc::clone(&host.shared), Arc::clone(&host.setup), host.sender.clone());
            state.function_profiler = functions.as_ref().map(|table| FunctionProfiler::new(Arc::clone(table)));
            let mut store = Store::new(&engine, state);
            let instance = engine::instantiate(&linker, &mut store, &module)
                .map_err(|e| HostError::Instantiate(format!("{e:?}")))?;
            let exports = Exports::find(&instance, &mut store)?;
            let memory =
                instance.get_memory(&mut store, "memory").ok_or(HostError::MissingExport("the memory export"))?;
            store.data_mut().memory = Some(memory);
            store.data_mut().alloc = Some(exports.alloc.clone());
            host.vms.push(Vm { store, exports, failed: None, next_ticks: BTreeMap::new(), background_fuel: 0 });
        }
        for index in 0..host.vms.len() {
            if let Err(reason) = host.start_vm(index) {
                host.refuse(reason);
                break;
            }
        }
        Ok(host)
    }
}

/// A compiled module and, with a function profile, its function table.
type Compiled = (Module, Option<Arc<profile::FunctionTable>>);

impl HostBuilder {
    /// Compiles the module (instrumented first with a function profile).
    fn compile(&self, engine: &Engine, bytes: &[u8]) -> Result<Compiled, HostError> {
        let compile = |wasm: &[u8]| Module::new(engine, wasm);
        if !self.function_profile {
            return Ok((compile(bytes).map_err(|e| HostError::Compile(format!("{e:?}")))?, None));
        }
        let instrumented = profile::instrument(bytes).map_err(HostError::Instrument)?;
        let module = compile(&instrumented.wasm).map_err(|e| {
            // The original's own error if it does not compile either; else the instrumentation's fault.
            match Module::validate(engine, bytes) {
                Err(original) => HostError::Compile(format!("{original:?}")),
                Ok(()) => HostError::Instrument(format!("the instrumented module does not compile: {e:?}")),
            }
        })?;
        Ok((module, Some(instrumented.functions)))
    }
}

/// What a module imports (`module.name`) and exports (names), as linking and ABI detection need them.
struct Surface {
    imports: Vec<(String, String)>,
    exports: Vec<String>,
}

impl Surface {
    /// From the module's import and export sections, without compiling it; `None` if they cannot be read.
    fn read(bytes: &[u8]) -> Option<Self> {
        use wasmparser::{Parser, Payload};
        let mut surface = Surface { imports: Vec::new(), exports: Vec::new() };
        for payload in Parser::new(0).parse_all(bytes) {
            match payload.ok()? {
                Payload::Version { encoding: wasmparser::Encoding::Module, .. } => {}
                Payload::Version { .. } => return None,
                Payload::ImportSection(reader) => {
                    for import in reader.into_imports() {
                        let import = import.ok()?;
                        surface.imports.push((import.module.to_string(), import.name.to_string()));
                    }
                }
                Payload::ExportSection(reader) => {
                    for export in reader {
                        surface.exports.push(export.ok()?.name.to_string());
                    }
                }
                // The sections after the exports (code, data) are not needed.
                Payload::CodeSectionStart { .. } | Payload::DataSection(_) | Payload::End(_) => break,
                _ => {}
            }
        }
        Some(surface)
    }

    /// From a compiled module.
    fn of(module: &Module) -> Self {
        Surface {
            imports: module.imports().map(|i| (i.module().to_string(), i.name().to_string())).collect(),
            exports: module.exports().map(|e| e.name().to_string()).collect(),
        }
    }
}

/// The module's ABI version, as the flavour's host reads it: stock Envoy 1.40 knows no
/// `proxy_abi_version_0_2_100` ([`crate::flavour`]).
fn detect_abi(flavour: HostFlavour, exports: &[String]) -> Result<AbiVersion, HostError> {
    let known = exports.iter().map(String::as_str).filter(|name| flavour.abi_0_2_100() || *name != ABI_0_2_100);
    match AbiVersion::detect(known) {
        Some(abi) => Ok(abi),
        None if exports.iter().any(|name| name == ABI_0_2_100) => {
            Err(HostError::AbiNotSupported { export: ABI_0_2_100.to_string(), host: flavour })
        }
        None => Err(HostError::UnknownAbi),
    }
}

/// Higress's ABI version export.
const ABI_0_2_100: &str = "proxy_abi_version_0_2_100";

/// Fails loudly, before anything runs, for every import the host does not provide.
fn check_imports(imports: &[(String, String)], linker: &Imports) -> Result<(), HostError> {
    let missing: Vec<String> =
        imports.iter().filter(|(m, n)| !linker.defines(m, n)).map(|(m, n)| format!("{m}.{n}")).collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(HostError::MissingImports(missing))
    }
}

/// `proxy_on_http_call_response(context, token, headers, body_size, trailers)`.
type HttpCallResponseFn = TypedFunc<(u32, u32, u32, u32, u32), ()>;

/// The guest exports the host calls.
pub(crate) struct Exports {
    pub alloc: TypedFunc<u32, u32>,
    pub initialize: Option<TypedFunc<(), ()>>,
    pub main: Option<TypedFunc<(u32, u32), u32>>,
    pub start: Option<TypedFunc<(), ()>>,
    pub on_context_create: Option<TypedFunc<(u32, u32), ()>>,
    pub on_vm_start: Option<TypedFunc<(u32, u32), u32>>,
    pub on_configure: Option<TypedFunc<(u32, u32), u32>>,
    pub on_tick: Option<TypedFunc<u32, ()>>,
    pub on_queue_ready: Option<TypedFunc<(u32, u32), ()>>,
    pub on_request_headers: Option<TypedFunc<(u32, u32, u32), u32>>,
    pub on_request_body: Option<TypedFunc<(u32, u32, u32), u32>>,
    pub on_response_headers: Option<TypedFunc<(u32, u32, u32), u32>>,
    pub on_response_body: Option<TypedFunc<(u32, u32, u32), u32>>,
    pub on_response_trailers: Option<TypedFunc<(u32, u32), u32>>,
    pub on_http_call_response: Option<HttpCallResponseFn>,
    pub on_redis_call_response: Option<TypedFunc<(u32, u32, u32, u32), ()>>,
    pub on_log: Option<TypedFunc<u32, ()>>,
    pub on_done: Option<TypedFunc<u32, u32>>,
    pub on_delete: Option<TypedFunc<u32, ()>>,
}

fn typed<P: WasmParams, R: WasmResults>(
    instance: &Instance,
    store: &mut Store<VmState>,
    name: &str,
) -> Result<Option<TypedFunc<P, R>>, HostError> {
    match instance.get_func(&mut *store, name) {
        None => Ok(None),
        Some(func) => func
            .typed::<P, R>(&*store)
            .map(Some)
            .map_err(|e| HostError::ExportType { name: name.into(), detail: e.to_string() }),
    }
}

impl Exports {
    fn find(instance: &Instance, store: &mut Store<VmState>) -> Result<Self, HostError> {
        let alloc = match typed::<u32, u32>(instance, store, "malloc")? {
            Some(f) => f,
            None => typed::<u32, u32>(instance, store, "proxy_on_memory_allocate")?
                .ok_or(HostError::MissingExport("malloc or proxy_on_memory_allocate"))?,
        };
        let initialize = typed(instance, store, "_initialize")?;
        Ok(Exports {
            alloc,
            main: if initialize.is_some() { typed(instance, store, "main")? } else { None },
            start: if initialize.is_none() { typed(instance, store, "_start")? } else { None },
            initialize,
            on_context_create: typed(instance, store, "proxy_on_context_create")?,
            on_vm_start: typed(instance, store, "proxy_on_vm_start")?,
            on_configure: typed(instance, store, "proxy_on_configure")?,
            on_tick: typed(instance, store, "proxy_on_tick")?,
            on_queue_ready: typed(instance, store, "proxy_on_queue_ready")?,
            on_request_headers: typed(instance, store, "proxy_on_request_headers")?,
            on_request_body: typed(instance, store, "proxy_on_request_body")?,
            on_response_headers: typed(instance, store, "proxy_on_response_headers")?,
            on_response_body: typed(instance, store, "proxy_on_response_body")?,
            on_response_trailers: typed(instance, store, "proxy_on_response_trailers")?,
            on_http_call_response: typed(instance, store, "proxy_on_http_call_response")?,
            on_redis_call_response: typed(instance, store, "proxy_on_redis_call_response")?,
            on_log: typed(instance, store, "proxy_on_log")?,
            on_done: typed(instance, store, "proxy_on_done")?,
            on_delete: typed(instance, store, "proxy_on_delete")?,
        })
    }
}

/// One VM: a wasmtime store and instance.
pub(crate) struct Vm {
    pub store: Store<VmState>,
    pub exports: Exports,
    /// Set once the VM trapped (Envoy: the VM is failed for good).
    pub failed: Option<String>,
    /// When each root context's next tick is due, by root context id (Envoy: a timer per root context).
    pub next_ticks: BTreeMap<u32, Instant>,
    /// Fuel of guest calls made for no stream (start, configure, ticks, orphan callbacks).
    pub background_fuel: u64,
}

/// The outcome of one guest call.
pub(crate) struct Called<R> {
    /// The result, `None` if the export is missing or the VM failed (now or before).
    pub value: Option<R>,
    /// The VM failed during this call.
    pub trapped: bool,
}

/// A proxy-wasm host for tests: see the crate documentation.
pub struct Host {
    pub(crate) shared: Arc<Shared>,
    pub(crate) setup: Arc<Setup>,
    pub(crate) vms: Vec<Vm>,
    events: Receiver<Event>,
    sender: Sender<Event>,
    pub(crate) streams: HashMap<(usize, u32), StreamRun>,
    pub(crate) pause_deadline: Duration,
    fuel_per_call: u64,
    refusal: Option<String>,
    pub(crate) next_connection_id: u64,
}

impl Host {
    /// Why the plugin did not load (`proxy_on_configure` or `proxy_on_vm_start` answered false, or the VM
    /// failed while starting), with the module's log lines; `None` if it loaded.
    pub fn refusal(&self) -> Option<&str> {
        self.refusal.as_deref()
    }

    /// The host played ([`HostBuilder::host_flavour`]).
    pub fn flavour(&self) -> HostFlavour {
        self.setup.flavour
    }

    /// How many VMs there are.
    pub fn vm_count(&self) -> usize {
        self.vms.len()
    }

    /// Sends one request to a VM and runs the event loop until it ends or its pause deadline passes.
    ///
    /// # Errors
    /// [`HostError::NoSuchVm`] for a bad index, [`HostError::BadRequest`] for a bad specification.
    pub fn send_request(&mut self, vm: usize, spec: RequestSpec) -> Result<Outcome, HostError> {
        let mut outcomes = self.send_batch(vec![(vm, spec)])?;
        outcomes.pop().ok_or_else(|| HostError::BadRequest("no outcome".into()))
    }

    /// Sends several requests at once (all in flight together, as concurrent clients would) and runs the
    /// event loop until every one ended or passed its pause deadline. Outcomes in the order given.
    ///
    /// # Errors
    /// As [`Host::send_request`].
    pub fn send_batch(&mut self, requests: Vec<(usize, RequestSpec)>) -> Result<Vec<Outcome>, HostError> {
        for (vm, _) in &requests {
            if *vm >= self.vms.len() {
                return Err(HostError::NoSuchVm { index: *vm, count: self.vms.len() });
            }
        }
        if let Some(reason) = &self.refusal {
            return Ok(requests.iter().map(|_| Outcome::Refused { reason: reason.clone() }).collect());
        }
        let mut keys = Vec::with_capacity(requests.len());
        for (vm, spec) in requests {
            keys.push(self.start_stream(vm, spec)?);
        }
        let deadline =
            keys.iter().filter_map(|k| self.streams.get(k).map(|s| s.deadline)).max().unwrap_or_else(Instant::now);
        self.run_until(deadline, |host| keys.iter().all(|k| host.streams.get(k).is_none_or(|s| s.outcome.is_some())));
        let now = Instant::now();
        for key in &keys {
            let expired = self.streams.get(key).is_some_and(|s| s.outcome.is_none() && s.deadline <= now);
            if expired {
                self.expire(*key);
            }
        }
        let outcomes = keys
            .iter()
            .map(|k| {
                self.streams.remove(k).and_then(|s| s.outcome).unwrap_or(Outcome::Paused { cost: Cost::default() })
            })
            .collect();
        Ok(outcomes)
    }

    /// Runs the event loop for a while: delivers replies and ticks (e.g. between requests).
    pub fn run_for(&mut self, duration: Duration) {
        let deadline = Instant::now() + duration;
        self.run_until(deadline, |_| false);
    }

    /// Metrics by the guest's names (Envoy shows them as `wasmcustom.<name>`), shared by all VMs.
    pub fn metrics(&self) -> BTreeMap<String, MetricValue> {
        lock(&self.shared.metrics).snapshot()
    }

    /// A counter's or gauge's value (0 if undefined).
    pub fn metric(&self, name: &str) -> u64 {
        self.metrics().get(name).map_or(0, |m| m.value)
    }

    /// Every log line so far.
    pub fn logs(&self) -> Vec<LogLine> {
        lock(&self.shared.logs).clone()
    }

    /// Takes the log lines so far.
    pub fn take_logs(&self) -> Vec<LogLine> {
        std::mem::take(&mut *lock(&self.shared.logs))
    }

    /// A shared data entry (value, CAS), as any VM sees it.
    pub fn shared_data(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        lock(&self.shared.data).get(key.as_bytes()).ok()
    }

    /// How many shared data entries have a key starting with `prefix`, and their size.
    pub fn shared_data_usage(&self, prefix: &str) -> crate::shared::SharedDataUsage {
        lock(&self.shared.data).usage(prefix.as_bytes())
    }

    /// The faults in force now (with the refusals of `proxy_set_effective_context` still to come).
    pub fn faults(&self) -> Faults {
        *lock(&self.shared.faults)
    }

    /// Replaces the faults in force (all VMs; see [`crate::faults`]). A change is logged by the host (debug).
    pub fn set_faults(&mut self, faults: Faults) {
        *lock(&self.shared.faults) = faults;
        self.shared.log(None, LogLevel::Debug, 0, LogSource::Host, format!("faults now {faults:?}"));
    }

    /// How far the guest's wall clock is ahead of real time ([`HostBuilder::clock_offset`]).
    pub fn clock_offset(&self) -> Duration {
        self.shared.clock_offset()
    }

    /// Moves the guest's wall clock ahead by `by` at once (as an NTP step would); returns the total offset.
    /// Only what the guest reads as the time changes: ticks, deadlines and timeouts stay on real time.
    pub fn advance_clock(&mut self, by: Duration) -> Duration {
        let total = self.shared.advance_clock(by);
        self.shared.log(
            None,
            LogLevel::Debug,
            0,
            LogSource::Host,
            format!("guest clock advanced by {by:?} to +{total:?}"),
        );
        total
    }

    /// The fuel profile so far, if enabled ([`HostBuilder::fuel_profile`]).
    pub fn fuel_profile(&self) -> Option<crate::shared::FuelProfile> {
        self.shared.fuel_profile.as_ref().map(|profile| lock(profile).clone())
    }

    /// The function profile so far, all VMs together, if enabled ([`HostBuilder::function_profile`]):
    /// calls, inclusive and exclusive fuel of every guest function called (fuel units ≈ wasm instructions,
    /// exact, the instrumentation's own cost removed; see [`crate::profile`]).
    pub fn function_profile(&self) -> Option<FunctionProfile> {
        let mut profiles = self.vms.iter().filter_map(|vm| vm.store.data().function_profiler.as_ref());
        let mut total = profiles.next()?.snapshot();
        for profiler in profiles {
            total.merge(&profiler.snapshot());
        }
        Some(total)
    }

    /// Forgets the function profile so far (e.g. the VMs' start, to profile requests alone).
    pub fn reset_function_profile(&mut self) {
        for vm in &mut self.vms {
            if let Some(profiler) = vm.store.data_mut().function_profiler.as_mut() {
                profiler.reset();
            }
        }
    }

    /// Fuel each VM spent outside any request (start, configuration, ticks, callbacks of ended streams).
    pub fn background_fuel(&self) -> Vec<u64> {
        self.vms.iter().map(|vm| vm.background_fuel).collect()
    }

    /// Whether a VM failed, and why.
    pub fn vm_failure(&self, vm: usize) -> Option<&str> {
        self.vms.get(vm).and_then(|v| v.failed.as_deref())
    }

    fn refuse(&mut self, reason: String) {
        let lines: Vec<String> = self
            .logs()
            .iter()
            .filter(|l| l.source != LogSource::Host)
            .map(|l| format!("  [{}] {}", l.level, l.message))
            .collect();
        let full = if lines.is_empty() { reason } else { format!("{reason}; module log:\n{}", lines.join("\n")) };
        self.shared.log(None, LogLevel::Critical, 0, LogSource::Host, format!("plugin failed to load: {full}"));
        self.refusal = Some(full);
    }

    /// Starts a VM as Envoy does; `Err` with the reason if the plugin did not load.
    fn start_vm(&mut self, index: usize) -> Result<(), String> {
        let vm = self.vms.get_mut(index).ok_or("no such VM")?;
        vm.store.data_mut().starting = true;
        let init = vm.exports.initialize.clone();
        let main = vm.exports.main.clone();
        let start = vm.exports.start.clone();
        if let Some(f) = init {
            self.call(index, "_initialize", 0, None, |s| f.call(s, ()));
            if let Some(m) = main {
                self.call(index, "main", 0, None, |s| m.call(s, (0, 0)));
            }
        } else if let Some(f) = start {
            self.call(index, "_start", 0, None, |s| f.call(s, ()));
        }
        let vm = self.vms.get_mut(index).ok_or("no such VM")?;
        vm.store.data_mut().starting = false;
        if let Some(failure) = &vm.failed {
            return Err(format!("VM {index} failed to start: {failure}"));
        }
        let root = vm.store.data_mut().allocate_context();
        vm.store.data_mut().root_id = root;
        vm.store.data_mut().contexts.insert(root, Context::Root);
        let create = vm.exports.on_context_create.clone();
        let vm_start = vm.exports.on_vm_start.clone();
        let configure = vm.exports.on_configure.clone();
        let vm_config_size = u32::try_from(self.setup.vm_config.len()).unwrap_or(u32::MAX);
        let plugin_config_size = u32::try_from(self.setup.plugin_config.len()).unwrap_or(u32::MAX);
        if let Some(f) = create {
            self.call(index, "proxy_on_context_create", root, None, |s| f.call(s, (root, 0)));
        }
        let started = match vm_start {
            Some(f) => self.call(index, "proxy_on_vm_start", root, None, |s| f.call(s, (root, vm_config_size))),
            None => Called { value: Some(1), trapped: false },
        };
        self.check_start(index, "proxy_on_vm_start", &started)?;
        self.with_state(index, |s| s.configuring = true);
        let configured = match configure {
            Some(f) => self.call(index, "proxy_on_configure", root, None, |s| f.call(s, (root, plugin_config_size))),
            None => Called { value: Some(1), trapped: false },
        };
        self.with_state(index, |s| s.configuring = false);
        self.check_start(index, "proxy_on_configure", &configured)?;
        Ok(())
    }

    /// A new plugin configuration for the running VMs, as Envoy applies a control plane's update to a plugin
    /// whose VM configuration is unchanged: in each VM, a new root context (`proxy_on_context_create`,
    /// `proxy_on_configure` with the new configuration) takes the new streams, and the old root context is
    /// deleted (`proxy_on_done`, `proxy_on_delete`). Ticks belong to root contexts, as in Envoy: the new root
    /// context starts without one (until something sets it), the old one keeps its own until it is deleted,
    /// and a tick set while the old root context is the effective context (in its `proxy_on_done` or
    /// `proxy_on_delete`, unless the guest made the new root context effective first with
    /// `proxy_set_effective_context`) is the old root's and goes with it. Shared data stays (it belongs to the
    /// VMs). `Err` names the VM whose configure answered false or trapped, or refuses while a stream is
    /// still open: Envoy keeps the old root context until its streams end, which is not emulated (their
    /// replies would reach the new root context).
    pub fn reconfigure(&mut self, plugin_config: impl Into<Vec<u8>>) -> Result<(), String> {
        let open = self.streams.values().filter(|run| run.outcome.is_none()).count();
        if open > 0 {
            return Err(format!("{open} stream(s) still open: reconfigure when no request is in flight"));
        }
        let mut setup = (*self.setup).clone();
        setup.plugin_config = plugin_config.into();
        self.setup = Arc::new(setup);
        let plugin_config_size = u32::try_from(self.setup.plugin_config.len()).unwrap_or(u32::MAX);
        for index in 0..self.vms.len() {
            let setup = Arc::clone(&self.setup);
            let Some(vm) = self.vms.get_mut(index) else { continue };
            let state = vm.store.data_mut();
            state.setup = setup;
            let old_root = state.root_id;
            let root = state.allocate_context();
            state.root_id = root;
            state.contexts.insert(root, Context::Root);
            let exports = &vm.exports;
            let (create, configure, done, delete) = (
                exports.on_context_create.clone(),
                exports.on_configure.clone(),
                exports.on_done.clone(),
                exports.on_delete.clone(),
            );
            if let Some(f) = create {
                self.call(index, "proxy_on_context_create", root, None, |s| f.call(s, (root, 0)));
            }
            self.with_state(index, |s| s.configuring = true);
            let configured = match configure {
                Some(f) => {
                    self.call(index, "proxy_on_configure", root, None, |s| f.call(s, (root, plugin_config_size)))
                }
                None => Called { value: Some(1), trapped: false },
            };
            self.with_state(index, |s| s.configuring = false);
            self.check_start(index, "proxy_on_configure", &configured)?;
            if let Some(f) = done {
                self.call(index, "proxy_on_done", old_root, None, |s| f.call(s, old_root));
            }
            if let Some(f) = delete {
                self.call(index, "proxy_on_delete", old_root, None, |s| f.call(s, old_root));
            }
            self.with_state(index, |s| s.remove_context(old_root));
            self.after_call(index);
        }
        Ok(())
    }

    fn check_start(&self, index: usize, what: &str, called: &Called<u32>) -> Result<(), String> {
        if let Some(failure) = self.vms.get(index).and_then(|v| v.failed.as_ref()) {
            return Err(format!("VM {index}: {failure}"));
        }
        match called.value {
            Some(0) => Err(format!("VM {index}: {what} returned false (Envoy: \"Plugin ... failed to load\")")),
            _ => Ok(()),
        }
    }

    pub(crate) fn with_state<T>(&mut self, vm: usize, f: impl FnOnce(&mut VmState) -> T) -> Option<T> {
        self.vms.get_mut(vm).map(|v| f(v.store.data_mut()))
    }

    /// Calls into a guest for `context`, charging the fuel to `stream` (or to the VM's background).
    /// A trap fails the VM for good, as in Envoy, and is logged as Envoy logs it.
    pub(crate) fn call<R>(
        &mut self,
        vm: usize,
        name: &str,
        context: u32,
        stream: Option<u32>,
        f: impl FnOnce(&mut Store<VmState>) -> Result<R, crate::engine::Error>,
    ) -> Called<R> {
        let fuel_per_call = self.fuel_per_call;
        let Some(v) = self.vms.get_mut(vm) else { return Called { value: None, trapped: false } };
        if v.failed.is_some() {
            return Called { value: None, trapped: false };
        }
        {
            let state = v.store.data_mut();
            state.current = context;
            state.effective = 0;
            state.call_stream = stream;
            state.stop_iteration = false;
        }
        if v.store.set_fuel(fuel_per_call).is_err() {
            return Called { value: None, trapped: false };
        }
        if v.store.data().shared.fuel_profile.is_some() {
            v.store.data_mut().profile_mark = Some((name.to_string(), fuel_per_call));
        }
        let overhead_before = v.store.data_mut().function_profiler.as_mut().map_or(0, |profiler| {
            profiler.begin_call();
            profiler.overhead()
        });
        let result = f(&mut v.store);
        // With a function profile, the wrappers' fuel is not the guest's.
        let overhead =
            v.store.data().function_profiler.as_ref().map_or(0, |p| p.overhead().saturating_sub(overhead_before));
        let used = fuel_per_call.saturating_sub(v.store.get_fuel().unwrap_or(0)).saturating_sub(overhead);
        if let Some((label, before)) = v.store.data_mut().profile_mark.take() {
            if let Some(profile) = &v.store.data().shared.fuel_profile {
                let left = v.store.get_fuel().unwrap_or(0);
                crate::shared::lock(profile).add(format!("{label} -> return"), before.saturating_sub(left));
            }
        }
        {
            let state = v.store.data_mut();
            state.current = 0;
            state.effective = 0;
        }
        match stream.and_then(|s| self.streams.get_mut(&(vm, s))) {
            Some(run) => {
                run.cost.fuel = run.cost.fuel.saturating_add(used);
                run.cost.guest_calls = run.cost.guest_calls.saturating_add(1);
            }
            None => {
                if let Some(v) = self.vms.get_mut(vm) {
                    v.background_fuel = v.background_fuel.saturating_add(used);
                }
            }
        }
        match result {
            Ok(value) => Called { value: Some(value), trapped: false },
            Err(error) => {
                let message = format!("Function: {name} failed: {}", engine::describe(&error));
                self.shared.log(Some(vm), LogLevel::Error, context, LogSource::Host, message.clone());
                if let Some(v) = self.vms.get_mut(vm) {
                    v.failed = Some(message);
                }
                Called { value: None, trapped: true }
            }
        }
    }

    fn run_until(&mut self, deadline: Instant, mut done: impl FnMut(&Self) -> bool) {
        loop {
            self.fire_ticks();
            self.expire_overdue();
            if done(self) {
                return;
            }
            let now = Instant::now();
            if now >= deadline {
                return;
            }
            let mut wake = deadline;
            for vm in &self.vms {
                if let Some(t) = vm.next_ticks.values().min() {
                    wake = wake.min(*t);
                }
            }
            for run in self.streams.values() {
                if run.outcome.is_none() {
                    wake = wake.min(run.deadline);
                }
            }
            match self.events.recv_timeout(wake.saturating_duration_since(now)) {
                Ok(event) => {
                    self.dispatch(event);
                    while let Ok(event) = self.events.try_recv() {
                        self.dispatch(event);
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    /// Streams waiting past their deadline end as [`Outcome::Paused`].
    fn expire_overdue(&mut self) {
        let now = Instant::now();
        let overdue: Vec<(usize, u32)> =
            self.streams.iter().filter(|(_, s)| s.outcome.is_none() && s.deadline <= now).map(|(k, _)| *k).collect();
        for key in overdue {
            self.expire(key);
        }
    }

    /// Delivers the ticks that are due: `proxy_on_tick(root)` to each root context whose timer expired, its
    /// next tick one period later (Envoy's `Wasm::tickHandler` re-arms the root's timer after the call). A
    /// root context deleted meanwhile gets nothing: its timer is gone with it.
    fn fire_ticks(&mut self) {
        let now = Instant::now();
        for index in 0..self.vms.len() {
            self.reschedule_tick(index, now);
            let due: Vec<u32> = self.vms.get(index).map_or_else(Vec::new, |vm| {
                vm.next_ticks.iter().filter(|(_, at)| **at <= now).map(|(root, _)| *root).collect()
            });
            for root in due {
                let Some(vm) = self.vms.get_mut(index) else { break };
                // An earlier tick of this round may have changed or stopped this one.
                if vm.next_ticks.get(&root).is_none_or(|at| *at > now) {
                    continue;
                }
                let state = vm.store.data();
                let alive = matches!(state.contexts.get(&root), Some(Context::Root));
                match state.ticks.get(&root).copied().filter(|_| alive) {
                    Some(period) => vm.next_ticks.insert(root, now + period),
                    None => vm.next_ticks.remove(&root),
                };
                if !alive {
                    continue;
                }
                if let Some(f) = vm.exports.on_tick.clone() {
                    self.call(index, "proxy_on_tick", root, None, |s| f.call(s, root));
                    self.after_call(index);
                }
            }
        }
    }

    /// Picks up the tick periods the guest set since the last look (Envoy: a root context's timer starts,
    /// one period from now, when its period is set, and stops when it is set to 0 or the root context goes).
    pub(crate) fn reschedule_tick(&mut self, index: usize, now: Instant) {
        if let Some(vm) = self.vms.get_mut(index) {
            for (root, period) in vm.store.data_mut().take_tick_changes() {
                match period {
                    Some(period) => vm.next_ticks.insert(root, now + period),
                    None => vm.next_ticks.remove(&root),
                };
            }
        }
    }

    /// The tick period of each root context of a VM that has one, by root context id (empty for a bad
    /// index). A root context's tick is set by `proxy_set_tick_period_milliseconds` from that root context,
    /// from one of its HTTP contexts, or from any context whose effective context is one of those.
    pub fn ticks(&self, vm: usize) -> BTreeMap<u32, Duration> {
        self.vms.get(vm).map(|v| v.store.data().ticks.clone()).unwrap_or_default()
    }

    /// The root context new streams of a VM are created for (the plugin's current configuration), if any.
    pub fn root_context(&self, vm: usize) -> Option<u32> {
        self.vms.get(vm).map(|v| v.store.data().root_id)
    }

    fn dispatch(&mut self, event: Event) {
        match event {
            Event::HttpCall { vm, token, response } => {
                let Some((token, owner)) = self.claim(vm, token, CallKind::Http) else { return };
                let Some(v) = self.vms.get_mut(vm) else { return };
                let root = v.store.data().root_id;
                let Some(f) = v.exports.on_http_call_response.clone() else { return };
                let (headers, body, trailers) = (
                    u32::try_from(response.headers.len()).unwrap_or(u32::MAX),
                    u32::try_from(response.body.len()).unwrap_or(u32::MAX),
                    u32::try_from(response.trailers.len()).unwrap_or(u32::MAX),
                );
                v.store.data_mut().call_response = Some(response);
                self.call(vm, "proxy_on_http_call_response", root, owner, |s| {
                    f.call(s, (root, token, headers, body, trailers))
                });
                self.with_state(vm, |s| s.call_response = None);
                self.after_call(vm);
            }
            Event::Redis { vm, token, status, reply } => {
                let Some((token, owner)) = self.claim(vm, token, CallKind::Redis) else { return };
                let Some(v) = self.vms.get_mut(vm) else { return };
                let root = v.store.data().root_id;
                let Some(f) = v.exports.on_redis_call_response.clone() else {
                    self.shared.log(
                        Some(vm),
                        LogLevel::Warn,
                        root,
                        LogSource::Host,
                        format!(
                            "the module does not export proxy_on_redis_call_response: reply to call {token} dropped"
                        ),
                    );
                    return;
                };
                let size = u32::try_from(reply.len()).unwrap_or(u32::MAX);
                v.store.data_mut().redis_reply = Some(reply);
                self.call(vm, "proxy_on_redis_call_response", root, owner, |s| f.call(s, (root, token, status, size)));
                self.with_state(vm, |s| s.redis_reply = None);
                self.after_call(vm);
            }
            Event::QueueReady { vm, root, token } => {
                let Some(f) = self.vms.get(vm).and_then(|v| v.exports.on_queue_ready.clone()) else { return };
                self.call(vm, "proxy_on_queue_ready", root, None, |s| f.call(s, (root, token)));
                self.after_call(vm);
            }
        }
    }

    /// Takes a finished call off the VM's pending calls: the token to deliver its reply with and the stream
    /// it was made for, or `None` if the reply is dropped (a fault). Faults are logged.
    fn claim(&mut self, vm: usize, token: u32, kind: CallKind) -> Option<(u32, Option<u32>)> {
        let call = self.with_state(vm, |s| s.calls.remove(&(kind, token))).flatten();
        let (owner, fate) = call.map_or((None, Fate::Deliver), |c| (c.owner, c.fate));
        let what = kind.reply_name();
        let (delivered, note) = match fate {
            Fate::Deliver => return Some((token, owner)),
            Fate::Drop => (None, format!("fault: the {what} to call {token} is dropped")),
            Fate::Misroute => {
                let wrong = token.wrapping_add(MISROUTE_OFFSET);
                (Some((wrong, owner)), format!("fault: the {what} to call {token} is delivered with token {wrong}"))
            }
        };
        let root = self.vms.get(vm).map_or(0, |v| v.store.data().root_id);
        self.shared.log(Some(vm), LogLevel::Debug, root, LogSource::Host, note);
        delivered
    }

    /// A new connection id for a stream (the `connection_id` property).
    pub(crate) fn connection_id(&mut self) -> u64 {
        let id = self.next_connection_id;
        self.next_connection_id += 1;
        id
    }
}
