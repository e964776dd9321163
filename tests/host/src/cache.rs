//! The compile cache ([`crate::HostBuilder::compile_cache`]): modules compiled once, kept on disk as
//! wasmtime's precompiled artifacts and loaded from there next time.
//!
//! A debug build of this crate compiles a 5-10 MB Go module (a Higress wasm-go plugin) in minutes (wasmtime's
//! Cranelift built without optimisation, one thread), a few hundred KB in a second or two; loading the
//! precompiled artifact takes milliseconds. An entry is named after the engine's
//! `precompile_compatibility_hash` (wasmtime's version and every setting that changes the machine code) and
//! the bytes compiled, so a change to either compiles again; an entry wasmtime refuses to load (another
//! version, corrupt) is compiled again and replaced. Entries are written to a temporary file and renamed,
//! so concurrent hosts (test threads, processes) never see a partial one.
//!
//! Loading an artifact is `unsafe` in wasmtime: it is machine code run as is. Only point the cache at a
//! directory no one else writes (the default in the tests is under the build's `target/`).

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::Path;

use wasmtime::{Engine, Module};

/// Loads the module compiled from `wasm` from `dir`, or compiles it and stores it there. Failing to store
/// it only costs the next run a compilation.
///
/// # Errors
/// wasmtime's error when `wasm` does not compile.
pub(crate) fn load_or_compile(engine: &Engine, dir: &Path, wasm: &[u8]) -> wasmtime::Result<Module> {
    let path = dir.join(format!("{}.cwasm", key(engine, wasm)));
    if path.is_file() {
        // SAFETY: the file is one this function wrote (under its content key, by a rename, never modified
        // afterwards) from `Module::serialize` of an engine with the same compatibility hash, in a
        // directory the caller reserves for this cache (see the module documentation); wasmtime itself
        // refuses an artifact of another version or configuration.
        if let Ok(module) = unsafe { Module::deserialize_file(engine, &path) } {
            return Ok(module);
        }
    }
    let module = Module::new(engine, wasm)?;
    if let Ok(artifact) = module.serialize() {
        let _ = store(dir, &path, &artifact);
    }
    Ok(module)
}

/// Writes `artifact` at `path` through a temporary file in `dir`.
fn store(dir: &Path, path: &Path, artifact: &[u8]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let temporary = path.with_extension(format!("tmp.{}", std::process::id()));
    std::fs::write(&temporary, artifact)?;
    std::fs::rename(&temporary, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&temporary);
    })
}

/// The entry's name: two 64-bit hashes (differently seeded) of the engine's compatibility hash and the
/// bytes, and their length.
fn key(engine: &Engine, wasm: &[u8]) -> String {
    let digest = |seed: u64| {
        let mut hasher = DefaultHasher::new();
        seed.hash(&mut hasher);
        engine.precompile_compatibility_hash().hash(&mut hasher);
        wasm.hash(&mut hasher);
        hasher.finish()
    };
    format!("{:016x}{:016x}-{}", digest(1), digest(2), wasm.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_module_is_compiled_once_then_loaded_and_a_bad_entry_is_replaced() -> wasmtime::Result<()> {
        let dir = std::env::temp_dir().join(format!("wasm-host-cache-test-{}", std::process::id()));
        let engine = Engine::default();
        let wasm = wat::parse_str(r#"(module (func (export "f") (result i32) i32.const 7))"#)?;
        let first = load_or_compile(&engine, &dir, &wasm)?;
        let entries: Vec<_> = std::fs::read_dir(&dir)?.collect::<Result<_, _>>()?;
        assert_eq!(entries.len(), 1, "one entry, no temporary file left");
        let again = load_or_compile(&engine, &dir, &wasm)?;
        assert_eq!(first.exports().count(), again.exports().count());
        // A loaded entry is mapped: it must never be written in place (the cache only renames over it).
        drop((first, again));
        // Another module is another entry; a corrupt entry is compiled again and replaced.
        let other = wat::parse_str(r#"(module (func (export "g")))"#)?;
        load_or_compile(&engine, &dir, &other)?;
        assert_eq!(std::fs::read_dir(&dir)?.count(), 2);
        let path = dir.join(format!("{}.cwasm", key(&engine, &wasm)));
        std::fs::remove_file(&path)?;
        std::fs::write(&path, b"not an artifact")?;
        let rebuilt = load_or_compile(&engine, &dir, &wasm)?;
        assert!(rebuilt.get_export("f").is_some());
        assert_ne!(std::fs::read(&path)?, b"not an artifact");
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
