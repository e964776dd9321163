//! Errors of the emulator itself (loading a module, using the API wrongly). What a guest does wrong at run
//! time is not an error here: a trap fails its VM as in Envoy and shows as [`crate::Outcome::VmFailed`].

use std::path::PathBuf;

/// Why the host could not be built or a call to it could not be made.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// The module file could not be read.
    #[error("cannot read the module {path}: {source}")]
    ReadModule {
        /// The path given.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The engine could not compile the module.
    #[error("cannot compile the module: {0}")]
    Compile(String),
    /// The module could not be instrumented for the function profile ([`crate::profile`]), the
    /// instrumented module (unlike the original) does not compile, or the engine counts no exact fuel.
    #[error("cannot instrument the module for the function profile: {0}")]
    Instrument(String),
    /// The module imports functions this host does not provide (Envoy refuses such a module too:
    /// "Failed to load Wasm module due to a missing import").
    #[error("the module imports what this host does not provide: {}", .0.join(", "))]
    MissingImports(Vec<String>),
    /// The module declares no proxy-wasm ABI version this host supports.
    #[error("missing or unknown Proxy-Wasm ABI version (exports no proxy_abi_version_0_2_0/0_2_1/0_2_100)")]
    UnknownAbi,
    /// The module's only ABI version is one this flavour's host does not know (stock Envoy 1.40 and
    /// `proxy_abi_version_0_2_100`: "Missing or unknown Proxy-Wasm ABI version").
    #[error(
        "missing or unknown Proxy-Wasm ABI version: the module exports {export}, which the {host} host does not know"
    )]
    AbiNotSupported {
        /// The module's ABI export.
        export: String,
        /// The host played.
        host: crate::HostFlavour,
    },
    /// An export the host calls has the wrong type.
    #[error("export {name} has the wrong type: {detail}")]
    ExportType {
        /// The export.
        name: String,
        /// What the engine said.
        detail: String,
    },
    /// The module has no memory export or no allocator (`malloc` / `proxy_on_memory_allocate`).
    #[error("the module is missing {0}")]
    MissingExport(&'static str),
    /// The engine could not instantiate the module.
    #[error("cannot instantiate the module: {0}")]
    Instantiate(String),
    /// The engine could not be configured.
    #[error("cannot set up the engine: {0}")]
    Engine(String),
    /// A VM index out of range.
    #[error("no VM {index} (the host has {count})")]
    NoSuchVm {
        /// The index asked for.
        index: usize,
        /// How many VMs there are.
        count: usize,
    },
    /// A request specification the host cannot play.
    #[error("bad request: {0}")]
    BadRequest(String),
    /// A cluster specification that is not `NAME=IP:PORT` on 127.0.0.1.
    #[error("bad cluster {0:?}: expected NAME=127.0.0.1:PORT")]
    BadCluster(String),
}
