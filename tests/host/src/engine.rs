//! The wasm engine the VMs run on, and the few places where engines differ.
//!
//! - **wasmi** (the default): an interpreter. It builds in about 35 s on 2 cores, which is why `make test`
//!   uses it. Its fuel counts wasmi's own (register-machine) instructions, charged a basic block at a time;
//!   the function profile ([`crate::profile`]) cannot be exact on it and is refused.
//! - **wasmtime** (feature `wasmtime`, what `make bench` builds): Cranelift compiles the module. Its fuel is
//!   one unit per wasm instruction, charged as they run, which makes the function profile exact; the fuel
//!   figures of docs/benchmarks.md are in its units. It takes about 230 s (450 core-seconds) to build.
//!
//! The rest of the emulator names the engine's types through this module only.

use std::collections::HashSet;

#[cfg(not(feature = "wasmtime"))]
pub use wasmi::{
    Caller, Config, Engine, Error, Instance, IntoFunc, Linker, Memory, Module, Store, TypedFunc, WasmParams,
    WasmResults,
};
#[cfg(feature = "wasmtime")]
pub use wasmtime::{
    Caller, Config, Engine, Error, Instance, IntoFunc, Linker, Memory, Module, Store, TypedFunc, WasmParams,
    WasmResults,
};

use crate::vm::VmState;

/// Which engine this build runs (`wasmi` or `wasmtime`).
pub const NAME: &str = if cfg!(feature = "wasmtime") { "wasmtime" } else { "wasmi" };

/// Whether fuel is one unit per wasm instruction, charged as each runs (wasmtime): what an exact function
/// profile needs.
pub const EXACT_FUEL: bool = cfg!(feature = "wasmtime");

/// An engine that meters fuel.
///
/// # Errors
/// The engine's, as text (wasmtime refuses a configuration it cannot compile for).
pub fn metering_engine() -> Result<Engine, String> {
    let mut config = Config::default();
    config.consume_fuel(true);
    #[cfg(not(feature = "wasmtime"))]
    return Ok(Engine::new(&config));
    #[cfg(feature = "wasmtime")]
    return Engine::new(&config).map_err(|e| e.to_string());
}

/// An error of a host function: the guest call that made it fails (a trap).
pub fn host_error(message: String) -> Error {
    #[cfg(not(feature = "wasmtime"))]
    return Error::new(message);
    #[cfg(feature = "wasmtime")]
    return Error::msg(message);
}

/// Instantiates `module` and runs its start function, if any.
///
/// # Errors
/// A missing import or one of the wrong type, or a trap in the start function.
pub fn instantiate(imports: &Imports, store: &mut Store<VmState>, module: &Module) -> Result<Instance, Error> {
    #[cfg(not(feature = "wasmtime"))]
    return imports.linker.instantiate_and_start(store, module);
    #[cfg(feature = "wasmtime")]
    return imports.linker.instantiate(store, module);
}

/// An engine error as one line: the trap (`wasm trap: ...`, like Envoy's `Uncaught RuntimeError: ...`), or
/// the innermost cause (a host function's error, e.g. `restricted_callback: ...`).
pub fn describe(error: &Error) -> String {
    #[cfg(not(feature = "wasmtime"))]
    if let Some(trap) = error.as_trap_code() {
        return format!("wasm trap: {trap}");
    }
    #[cfg(not(feature = "wasmtime"))]
    let cause = error.to_string();
    #[cfg(feature = "wasmtime")]
    if let Some(trap) = error.downcast_ref::<wasmtime::Trap>() {
        return format!("wasm trap: {trap}");
    }
    #[cfg(feature = "wasmtime")]
    let cause = error.root_cause().to_string();
    cause.lines().next().unwrap_or_default().to_string()
}

/// The host functions a module may import, and which ones they are: a [`Linker`] that remembers each
/// `module.name` it defines (wasmi's does not list its host functions), so that the host names every
/// missing import before anything runs ([`crate::HostError::MissingImports`]).
pub struct Imports {
    linker: Linker<VmState>,
    defined: HashSet<(String, String)>,
}

impl Imports {
    /// No host function yet, for modules of `engine`.
    pub fn new(engine: &Engine) -> Self {
        Imports { linker: Linker::new(engine), defined: HashSet::new() }
    }

    /// Defines `module.name` as the host function `func` (as `Linker::func_wrap`).
    ///
    /// # Errors
    /// The engine's, e.g. for a name already defined.
    pub fn func_wrap<Params, Args>(
        &mut self,
        module: &str,
        name: &str,
        func: impl IntoFunc<VmState, Params, Args>,
    ) -> Result<&mut Self, Error> {
        self.linker.func_wrap(module, name, func)?;
        self.defined.insert((module.to_string(), name.to_string()));
        Ok(self)
    }

    /// Whether `module.name` is defined.
    pub fn defines(&self, module: &str, name: &str) -> bool {
        self.defined.contains(&(module.to_string(), name.to_string()))
    }
}
