//! wasm32-wasip1 modules built by cargo for tests: once per test binary and build, or taken prebuilt from
//! an environment variable (e.g. `ERL_WASM=dist/edge-rate-limiter-envoy.wasm`).

use std::collections::HashMap;
use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

/// The repository root (two levels above this crate's manifest, `tests/support`).
pub fn repo_root() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    std::fs::canonicalize(&root).unwrap_or(root)
}

/// A release build of one crate for `wasm32-wasip1`:
/// `cargo build --release --target wasm32-wasip1 --manifest-path M [-p P] [--no-default-features --features F]
/// --target-dir D`, whose artifact is `D/wasm32-wasip1/release/<artifact>`.
///
/// Give each flavour its own target directory, so that a concurrent build of another flavour (or of the
/// developer's `target/wasm32-wasip1`) never overwrites the module a test loads.
#[derive(Clone, Debug)]
pub struct WasmBuild {
    label: String,
    manifest: PathBuf,
    artifact: String,
    target_dir: PathBuf,
    package: Option<String>,
    features: Option<String>,
    prebuilt_env: Option<String>,
}

impl WasmBuild {
    /// The build of the crate at `manifest` (a `Cargo.toml`) producing `artifact` (e.g.
    /// `edge_rate_limiter.wasm`) in `target_dir`; `label` names it in messages.
    pub fn new(label: &str, manifest: impl Into<PathBuf>, artifact: &str, target_dir: impl Into<PathBuf>) -> Self {
        WasmBuild {
            label: label.to_string(),
            manifest: manifest.into(),
            artifact: artifact.to_string(),
            target_dir: target_dir.into(),
            package: None,
            features: None,
            prebuilt_env: None,
        }
    }

    /// Builds this package of the manifest's workspace (`-p`).
    pub fn package(mut self, package: &str) -> Self {
        self.package = Some(package.to_string());
        self
    }

    /// Builds with exactly these features (`--no-default-features --features F`, comma-separated).
    pub fn only_features(mut self, features: &str) -> Self {
        self.features = Some(features.to_string());
        self
    }

    /// When this environment variable is set, its value is the module's path and nothing is built.
    pub fn prebuilt_from_env(mut self, variable: &str) -> Self {
        self.prebuilt_env = Some(variable.to_string());
        self
    }

    /// Cargo's arguments.
    pub fn args(&self) -> Vec<OsString> {
        let mut args: Vec<OsString> =
            ["build", "--release", "--target", "wasm32-wasip1", "--manifest-path"].map(OsString::from).into();
        args.push(self.manifest.clone().into_os_string());
        if let Some(package) = &self.package {
            args.extend(["-p".into(), package.into()]);
        }
        if let Some(features) = &self.features {
            args.extend(["--no-default-features".into(), "--features".into(), features.into()]);
        }
        args.extend(["--target-dir".into(), self.target_dir.clone().into_os_string()]);
        args
    }

    /// Where the build leaves the module.
    pub fn artifact_path(&self) -> PathBuf {
        self.target_dir.join("wasm32-wasip1/release").join(&self.artifact)
    }

    /// The module: the prebuilt one named by the environment variable, or this build's artifact, built now
    /// unless this process built it before (builds run one at a time; cargo itself skips what is fresh).
    ///
    /// # Errors
    /// cargo cannot be run or fails (its stderr is in the message), or the artifact is missing after it.
    pub fn locate(&self) -> io::Result<PathBuf> {
        static BUILT: Mutex<Option<HashMap<Vec<OsString>, PathBuf>>> = Mutex::new(None);
        if let Some(path) = self.prebuilt_env.as_ref().and_then(std::env::var_os) {
            return Ok(PathBuf::from(path));
        }
        let args = self.args();
        let mut built = BUILT.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(path) = built.get_or_insert_with(HashMap::new).get(&args) {
            return Ok(path.clone());
        }
        let started = Instant::now();
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let output = Command::new(cargo)
            .args(&args)
            .current_dir(self.manifest.parent().unwrap_or(Path::new(".")))
            .output()
            .map_err(|e| io::Error::new(e.kind(), format!("cannot run cargo for {}: {e}", self.label)))?;
        if !output.status.success() {
            return Err(io::Error::other(format!(
                "cargo build of {} failed:\n{}",
                self.label,
                String::from_utf8_lossy(&output.stderr)
            )));
        }
        let path = self.artifact_path();
        if !path.is_file() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("cargo built {} but {} is missing", self.label, path.display()),
            ));
        }
        eprintln!("built {} in {:.1} s", self.label, started.elapsed().as_secs_f64());
        built.get_or_insert_with(HashMap::new).insert(args, path.clone());
        Ok(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_name_the_flavour_and_its_own_target_directory() {
        let build = WasmBuild::new("x", "/r/Cargo.toml", "m.wasm", "/r/target/flavour")
            .package("p")
            .only_features("host-redis");
        let args: Vec<String> = build.args().iter().map(|a| a.to_string_lossy().into_owned()).collect();
        assert_eq!(
            args.join(" "),
            "build --release --target wasm32-wasip1 --manifest-path /r/Cargo.toml -p p --no-default-features \
             --features host-redis --target-dir /r/target/flavour"
        );
        assert_eq!(build.artifact_path(), PathBuf::from("/r/target/flavour/wasm32-wasip1/release/m.wasm"));
    }

    #[test]
    fn a_prebuilt_module_from_the_environment_is_not_built() {
        let build = WasmBuild::new("x", "/nonexistent/Cargo.toml", "m.wasm", "/nonexistent/target")
            .prebuilt_from_env("CARGO_MANIFEST_DIR");
        assert_eq!(build.locate().unwrap(), PathBuf::from(env!("CARGO_MANIFEST_DIR")));
        assert!(WasmBuild::new("x", "/nonexistent/Cargo.toml", "m.wasm", "/nonexistent/t").locate().is_err());
    }
}
