//! A per-function fuel profile: which guest functions spend the fuel, inclusive and exclusive, counted
//! exactly by wasmtime's fuel (one unit per wasm instruction, with wasmtime's default costs: `nop`, `drop`,
//! `block`, `loop`, `end`, `else`, `return` and `unreachable` are free, `memory.copy`/`memory.fill` also
//! cost one per byte, and entering a function costs one). Only on wasmtime (the emulator's feature
//! `wasmtime`, which `make bench` builds; [`crate::engine`]): wasmi charges its fuel a basic block at a time,
//! in units of its own instructions, so the host refuses the profile there.
//!
//! # How
//!
//! [`instrument`] rewrites the module before it is compiled. It imports two functions,
//! `erl_profile.enter` and `erl_profile.exit` (`(i32) -> ()`, after the module's own imports), and for
//! every defined function `f` (original index `o`) keeps at `f`'s (shifted) index a *wrapper* of `f`'s type:
//!
//! ```text
//! i32.const o; call enter; local.get 0 .. local.get n-1; call inner_f; i32.const o; call exit
//! ```
//!
//! and appends `f`'s original body as a new function `inner_f`. Every function index (calls, `ref.func`,
//! exports, element segments, the start function, the `name` section) is remapped, so exports and tables
//! point at the wrappers and every call, direct or indirect, goes through `enter` and `exit`; returns,
//! branches and traps inside bodies need no rewriting.
//!
//! The host side ([`FunctionProfiler`], one per VM store) reads the fuel left at each `enter`/`exit` and
//! keeps a stack of (function, fuel at entry, fuel of its children, wrapper fuel nested in it). At `exit` it
//! adds to the function's totals: one call, its inclusive fuel (its body and everything it called) and its
//! exclusive fuel (its body alone).
//!
//! # Exactness
//!
//! The wrappers burn fuel too: a wrapper of a function with `n` parameters costs exactly `n + 6` units
//! ([`wrapper_overhead`]: its own entry, `i32.const`, `call enter`, `n` × `local.get`, `call inner`,
//! `i32.const`, `call exit`; `end` is free; the entry of the body is the original function's), `n + 3` of
//! them between its own `enter` and `exit` ([`span_overhead`]), the other 3 in its caller's span.
//! The profiler removes every wrapper's cost from the functions it ran under, so, under wasmtime's default
//! cost table, the profile is *exact*: a function's exclusive fuel is what its own instructions burn in the
//! uninstrumented module, its inclusive fuel what the call costs there (its own `call` instruction, which
//! belongs to the caller, excluded), and the exclusive fuel of all functions adds up to the fuel of the
//! uninstrumented module (checked by this module's tests). The host also removes the wrappers' cost from
//! [`crate::Cost::fuel`] and the VMs' background fuel, which stay what the uninstrumented module would burn.
//!
//! Hostcalls count as zero: the host burns no fuel; only the guest's `call` instruction (one unit, in the
//! caller) is counted. Guest code the host runs during a hostcall (`proxy_on_memory_allocate`) nests under
//! the function that made the hostcall, as it would in a native profiler. The profile is not exact where a
//! call never returns normally: a trap (the VM fails) or an exception unwinding through wrappers skips their
//! `exit`; such frames are dropped (counted in [`FunctionProfile::discarded_frames`]), their fuel lost to
//! the profile. For recursive functions, inclusive fuel counts only the outermost activation (no double
//! counting); calls and exclusive fuel count every activation.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::engine::Caller;
use wasm_encoder::reencode::{Error as ReencodeError, Reencode};
use wasmparser::{CompositeInnerType, KnownCustom, Name, Parser, Payload, TypeRef};

use crate::engine::Imports;

use crate::vm::VmState;

/// The module of the two imports the instrumented module calls.
pub const IMPORT_MODULE: &str = "erl_profile";
/// Called by every wrapper before the body, with the function's original index.
pub const ENTER: &str = "enter";
/// Called by every wrapper after the body returned, with the function's original index.
pub const EXIT: &str = "exit";

/// Fuel a wrapper of a function with `params` parameters burns in all (`params + 6`, measured: see the
/// module documentation).
pub const fn wrapper_overhead(params: u32) -> u64 {
    params as u64 + 6
}

/// Fuel a wrapper of a function with `params` parameters burns between its `enter` and `exit`
/// (`params + 3`: the `local.get`s, `call inner`, `i32.const`, `call exit`; the other 3, its entry,
/// `i32.const` and `call enter`, fall in the caller's span).
pub const fn span_overhead(params: u32) -> u64 {
    params as u64 + 3
}

/// The functions of the original module, by original index (imports first, as in the module): their names
/// and parameter counts.
#[derive(Debug, Clone, Default)]
pub struct FunctionTable {
    names: Vec<String>,
    params: Vec<u32>,
}

impl FunctionTable {
    /// How many functions (imported and defined).
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Whether the module has no function.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// A function's name: from the module's `name` section (Rust symbols demangled, without their hash
    /// `::h0123...`; ` [<index>]` appended to a name several functions share), else `func[<index>]`.
    pub fn name(&self, index: u32) -> String {
        usize::try_from(index).ok().and_then(|i| self.names.get(i)).cloned().unwrap_or_else(|| format!("func[{index}]"))
    }

    fn params(&self, index: u32) -> u32 {
        usize::try_from(index).ok().and_then(|i| self.params.get(i)).copied().unwrap_or(0)
    }
}

/// A module instrumented by [`instrument`].
#[derive(Debug, Clone)]
pub struct Instrumented {
    /// The instrumented module (binary).
    pub wasm: Vec<u8>,
    /// The original module's functions.
    pub functions: Arc<FunctionTable>,
}

/// The module's function types: the parameter count of each type index (`None`: not a function type).
#[derive(Default)]
struct Scan {
    type_params: Vec<Option<u32>>,
    imported: u32,
    /// The type index of each defined function.
    defined: Vec<u32>,
    names: BTreeMap<u32, String>,
    module_name: Option<String>,
}

/// A function's name for people: a Rust symbol demangled (legacy `_ZN...E` or v0 `_R...`), without its
/// hash; other names as they are.
fn readable(name: &str) -> String {
    let demangled = format!("{:#}", rustc_demangle::demangle(name));
    without_hash(&demangled).to_string()
}

/// Removes a Rust symbol hash (`::h` and 16 hex digits) from the end of an already demangled name.
fn without_hash(name: &str) -> &str {
    if let Some(at) = name.rfind("::h") {
        let tail = name.get(at + 3..).unwrap_or_default();
        if tail.len() == 16 && tail.bytes().all(|b| b.is_ascii_hexdigit()) {
            return name.get(..at).unwrap_or(name);
        }
    }
    name
}

fn parse_error(e: &wasmparser::BinaryReaderError) -> String {
    format!("cannot parse the module: {e}")
}

fn reencode_error(e: ReencodeError<String>) -> String {
    match e {
        ReencodeError::ParseError(e) => parse_error(&e),
        other => format!("cannot re-encode the module: {other}"),
    }
}

fn count(n: usize, what: &str) -> Result<u32, String> {
    u32::try_from(n).map_err(|_| format!("too many {what}"))
}

fn scan(wasm: &[u8]) -> Result<Scan, String> {
    let mut scan = Scan::default();
    for payload in Parser::new(0).parse_all(wasm) {
        match payload.map_err(|e| parse_error(&e))? {
            Payload::Version { encoding: wasmparser::Encoding::Module, .. } => {}
            Payload::Version { .. } => return Err("not a core wasm module (a component?)".into()),
            Payload::TypeSection(reader) => {
                for group in reader {
                    for sub in group.map_err(|e| parse_error(&e))?.types() {
                        scan.type_params.push(match &sub.composite_type.inner {
                            CompositeInnerType::Func(ty) => Some(count(ty.params().len(), "parameters")?),
                            _ => None,
                        });
                    }
                }
            }
            Payload::ImportSection(reader) => {
                for import in reader.into_imports() {
                    let import = import.map_err(|e| parse_error(&e))?;
                    if import.module == IMPORT_MODULE {
                        return Err(format!(
                            "the module already imports {}.{}: cannot add the profiler's imports",
                            import.module, import.name
                        ));
                    }
                    if matches!(import.ty, TypeRef::Func(_) | TypeRef::FuncExact(_)) {
                        scan.imported = scan.imported.checked_add(1).ok_or("too many imports")?;
                    }
                }
            }
            Payload::FunctionSection(reader) => {
                for ty in reader {
                    scan.defined.push(ty.map_err(|e| parse_error(&e))?);
                }
            }
            Payload::CustomSection(section) => {
                // Names are optional: a malformed name section only loses names.
                if let KnownCustom::Name(reader) = section.as_known() {
                    for subsection in reader.into_iter().flatten() {
                        match subsection {
                            Name::Module { name, .. } => scan.module_name = Some(name.to_string()),
                            Name::Function(map) => {
                                for naming in map.into_iter().flatten() {
                                    scan.names.insert(naming.index, naming.name.to_string());
                                }
                            }
                            _ => {}
                        }
                    }
                }
            }
            _ => {}
        }
    }
    Ok(scan)
}

/// Remaps function indices: imports stay, defined functions move up by 2 (the two profiler imports).
struct Shift {
    imported: u32,
}

impl Reencode for Shift {
    type Error = String;

    fn function_index(&mut self, func: u32) -> Result<u32, ReencodeError<String>> {
        if func < self.imported {
            Ok(func)
        } else {
            func.checked_add(2).ok_or_else(|| ReencodeError::UserError("too many functions".into()))
        }
    }
}

/// The rewritten module being assembled, with the sections the instrumentation needs even when the
/// original has none.
struct Output {
    module: wasm_encoder::Module,
    types_done: bool,
    imports_done: bool,
    /// The type index of `(i32) -> ()`.
    hook_type: u32,
}

impl Output {
    fn add_hook_type(&self, types: &mut wasm_encoder::TypeSection) {
        types.ty().function([wasm_encoder::ValType::I32], []);
    }

    fn add_hooks(&self, imports: &mut wasm_encoder::ImportSection) {
        imports.import(IMPORT_MODULE, ENTER, wasm_encoder::EntityType::Function(self.hook_type));
        imports.import(IMPORT_MODULE, EXIT, wasm_encoder::EntityType::Function(self.hook_type));
    }

    /// Emits the type and import sections if the module had none by now.
    fn ensure(&mut self, through_imports: bool) {
        if !self.types_done {
            let mut types = wasm_encoder::TypeSection::new();
            self.add_hook_type(&mut types);
            self.module.section(&types);
            self.types_done = true;
        }
        if through_imports && !self.imports_done {
            let mut imports = wasm_encoder::ImportSection::new();
            self.add_hooks(&mut imports);
            self.module.section(&imports);
            self.imports_done = true;
        }
    }
}

/// Instruments a module for the function profile (see the module documentation).
///
/// # Errors
/// A message if the module cannot be parsed or re-encoded, is a component, or already imports from
/// [`IMPORT_MODULE`].
pub fn instrument(wasm: &[u8]) -> Result<Instrumented, String> {
    let scan = scan(wasm)?;
    let imported = scan.imported;
    let defined = count(scan.defined.len(), "functions")?;
    let total = imported.checked_add(defined).ok_or("too many functions")?;
    // Wrapper of defined function j: imported + 2 + j; its body: imported + 2 + defined + j.
    let first_inner = total.checked_add(2).ok_or("too many functions")?;
    first_inner.checked_add(defined).ok_or("too many functions")?;
    let (enter, exit) = (imported, imported + 1);

    let mut table = FunctionTable::default();
    let readable_names: BTreeMap<u32, String> = scan.names.iter().map(|(i, n)| (*i, readable(n))).collect();
    let mut uses: BTreeMap<&str, u32> = BTreeMap::new();
    for name in readable_names.values() {
        *uses.entry(name.as_str()).or_default() += 1;
    }
    for index in 0..total {
        // Names shared by several functions (generic instances, once their hashes are gone) get the index.
        let name = match readable_names.get(&index) {
            Some(name) if uses.get(name.as_str()).copied().unwrap_or(0) > 1 => format!("{name} [{index}]"),
            Some(name) => name.clone(),
            None => format!("func[{index}]"),
        };
        table.names.push(name);
        let params = match index.checked_sub(imported) {
            Some(j) => {
                let ty = usize::try_from(j).ok().and_then(|j| scan.defined.get(j)).copied();
                ty.and_then(|t| usize::try_from(t).ok())
                    .and_then(|t| scan.type_params.get(t).copied().flatten())
                    .ok_or_else(|| format!("function {index} has no function type"))?
            }
            None => 0,
        };
        table.params.push(params);
    }

    let mut out = Output {
        module: wasm_encoder::Module::new(),
        types_done: false,
        imports_done: false,
        hook_type: count(scan.type_params.len(), "types")?,
    };
    let mut shift = Shift { imported };
    for payload in Parser::new(0).parse_all(wasm) {
        let payload = payload.map_err(|e| parse_error(&e))?;
        match payload {
            Payload::Version { .. } => {}
            Payload::TypeSection(reader) => {
                let mut types = wasm_encoder::TypeSection::new();
                shift.parse_type_section(&mut types, reader).map_err(reencode_error)?;
                out.add_hook_type(&mut types);
                out.module.section(&types);
                out.types_done = true;
            }
            Payload::ImportSection(reader) => {
                out.ensure(false);
                let mut imports = wasm_encoder::ImportSection::new();
                shift.parse_import_section(&mut imports, reader).map_err(reencode_error)?;
                out.add_hooks(&mut imports);
                out.module.section(&imports);
                out.imports_done = true;
            }
            Payload::FunctionSection(_) => {
                out.ensure(true);
                let mut functions = wasm_encoder::FunctionSection::new();
                for ty in scan.defined.iter().chain(scan.defined.iter()) {
                    functions.function(*ty);
                }
                out.module.section(&functions);
            }
            Payload::TableSection(reader) => {
                out.ensure(true);
                let mut tables = wasm_encoder::TableSection::new();
                shift.parse_table_section(&mut tables, reader).map_err(reencode_error)?;
                out.module.section(&tables);
            }
            Payload::MemorySection(reader) => {
                out.ensure(true);
                let mut memories = wasm_encoder::MemorySection::new();
                shift.parse_memory_section(&mut memories, reader).map_err(reencode_error)?;
                out.module.section(&memories);
            }
            Payload::TagSection(reader) => {
                out.ensure(true);
                let mut tags = wasm_encoder::TagSection::new();
                shift.parse_tag_section(&mut tags, reader).map_err(reencode_error)?;
                out.module.section(&tags);
            }
            Payload::GlobalSection(reader) => {
                out.ensure(true);
                let mut globals = wasm_encoder::GlobalSection::new();
                shift.parse_global_section(&mut globals, reader).map_err(reencode_error)?;
                out.module.section(&globals);
            }
            Payload::ExportSection(reader) => {
                out.ensure(true);
                let mut exports = wasm_encoder::ExportSection::new();
                shift.parse_export_section(&mut exports, reader).map_err(reencode_error)?;
                out.module.section(&exports);
            }
            Payload::StartSection { func, .. } => {
                out.ensure(true);
                let function_index = shift.start_section(func).map_err(reencode_error)?;
                out.module.section(&wasm_encoder::StartSection { function_index });
            }
            Payload::ElementSection(reader) => {
                out.ensure(true);
                let mut elements = wasm_encoder::ElementSection::new();
                shift.parse_element_section(&mut elements, reader).map_err(reencode_error)?;
                out.module.section(&elements);
            }
            Payload::DataCountSection { count, .. } => {
                out.ensure(true);
                out.module.section(&wasm_encoder::DataCountSection { count });
            }
            Payload::DataSection(reader) => {
                out.ensure(true);
                let mut data = wasm_encoder::DataSection::new();
                shift.parse_data_section(&mut data, reader).map_err(reencode_error)?;
                out.module.section(&data);
            }
            Payload::CodeSectionStart { count: bodies, range, .. } => {
                out.ensure(true);
                if bodies != defined {
                    return Err(format!("the module declares {defined} functions but has {bodies} bodies"));
                }
                let mut code = wasm_encoder::CodeSection::new();
                for j in 0..defined {
                    let original = i32::try_from(imported + j).map_err(|_| "too many functions".to_string())?;
                    let params = table.params(imported + j);
                    let mut wrapper = wasm_encoder::Function::new([]);
                    let mut sink = wrapper.instructions();
                    sink.i32_const(original).call(enter);
                    for local in 0..params {
                        sink.local_get(local);
                    }
                    sink.call(first_inner + j).i32_const(original).call(exit).end();
                    code.function(&wrapper);
                }
                let bytes = wasm.get(range.clone()).ok_or("the code section is out of bounds")?;
                let reader = wasmparser::CodeSectionReader::new(wasmparser::BinaryReader::new(bytes, range.start))
                    .map_err(|e| parse_error(&e))?;
                shift.parse_code_section(&mut code, reader).map_err(reencode_error)?;
                out.module.section(&code);
            }
            // The bodies were taken whole at the code section's start.
            Payload::CodeSectionEntry(_) => {}
            Payload::CustomSection(section) => match section.name() {
                "name" => {
                    out.module.section(&names(&scan, &table, imported, defined, first_inner));
                }
                // Kept: metadata without code offsets or function indices. Dropped: DWARF (`.debug_*`),
                // branch hints, linking and relocation sections, whose offsets and indices would be stale.
                "producers" | "target_features" => {
                    let data = section.data();
                    out.module.section(&wasm_encoder::CustomSection { name: section.name().into(), data: data.into() });
                }
                _ => {}
            },
            Payload::End(_) => out.ensure(true),
            other => {
                let id = other.as_section().map(|(id, _)| id);
                return Err(format!("unsupported section in the module (id {id:?})"));
            }
        }
    }
    Ok(Instrumented { wasm: out.module.finish(), functions: Arc::new(table) })
}

/// The rebuilt `name` section: the module name and function names at their new indices (wrappers keep the
/// original name, bodies get `<name> (body)`); other subsections are dropped.
fn names(
    scan: &Scan,
    table: &FunctionTable,
    imported: u32,
    defined: u32,
    first_inner: u32,
) -> wasm_encoder::NameSection {
    let mut section = wasm_encoder::NameSection::new();
    if let Some(name) = &scan.module_name {
        section.module(name);
    }
    let mut sorted: BTreeMap<u32, String> = BTreeMap::new();
    for (&index, name) in &scan.names {
        if index < imported {
            sorted.insert(index, name.clone());
        } else if let Some(j) = index.checked_sub(imported).filter(|j| *j < defined) {
            sorted.insert(index + 2, table.name(index));
            sorted.insert(first_inner + j, format!("{} (body)", table.name(index)));
        }
    }
    sorted.insert(imported, format!("{IMPORT_MODULE}.{ENTER}"));
    sorted.insert(imported + 1, format!("{IMPORT_MODULE}.{EXIT}"));
    let mut map = wasm_encoder::NameMap::new();
    for (index, name) in &sorted {
        map.append(*index, name);
    }
    section.functions(&map);
    section
}

/// Adds `erl_profile.enter` and `erl_profile.exit`, which feed the VM's [`FunctionProfiler`] (and do nothing
/// in a VM without one).
///
/// # Errors
/// If the linker refuses a definition.
pub fn link(linker: &mut Imports) -> Result<(), crate::engine::Error> {
    linker.func_wrap(IMPORT_MODULE, ENTER, |mut caller: Caller<'_, VmState>, function: u32| {
        let left = caller.get_fuel().unwrap_or(0);
        if let Some(profiler) = caller.data_mut().function_profiler.as_mut() {
            profiler.enter(function, left);
        }
    })?;
    linker.func_wrap(IMPORT_MODULE, EXIT, |mut caller: Caller<'_, VmState>, function: u32| {
        let left = caller.get_fuel().unwrap_or(0);
        if let Some(profiler) = caller.data_mut().function_profiler.as_mut() {
            profiler.exit(function, left);
        }
    })?;
    Ok(())
}

/// A function's totals so far.
#[derive(Debug, Clone, Copy, Default)]
struct Totals {
    calls: u64,
    inclusive: u64,
    exclusive: u64,
}

/// A function running now.
#[derive(Debug, Clone, Copy)]
struct Frame {
    function: u32,
    /// Fuel left at its `enter`.
    entered: u64,
    /// Inclusive fuel of the calls it made so far.
    children: u64,
    /// Wrapper fuel burnt inside its span by the calls it made (theirs and their callees').
    nested_overhead: u64,
}

/// The per-VM recorder behind the function profile (store data; see the module documentation).
#[derive(Debug, Clone)]
pub struct FunctionProfiler {
    table: Arc<FunctionTable>,
    totals: Vec<Totals>,
    /// Activations of each function on the stack (for recursion).
    active: Vec<u32>,
    stack: Vec<Frame>,
    overhead: u64,
    discarded: u64,
}

impl FunctionProfiler {
    /// An empty profile for a module's functions.
    pub fn new(table: Arc<FunctionTable>) -> Self {
        let n = table.len();
        FunctionProfiler {
            table,
            totals: vec![Totals::default(); n],
            active: vec![0; n],
            stack: Vec::new(),
            overhead: 0,
            discarded: 0,
        }
    }

    /// A guest call from the host starts: frames left from an earlier call (it trapped) are dropped.
    pub fn begin_call(&mut self) {
        while let Some(frame) = self.stack.pop() {
            self.drop_frame(frame);
        }
    }

    /// Total wrapper fuel burnt so far (every completed call's [`wrapper_overhead`]).
    pub fn overhead(&self) -> u64 {
        self.overhead
    }

    /// Forgets the totals (not the calls running now).
    pub fn reset(&mut self) {
        self.totals.iter_mut().for_each(|t| *t = Totals::default());
        self.overhead = 0;
        self.discarded = 0;
    }

    fn enter(&mut self, function: u32, left: u64) {
        if let Some(active) = usize::try_from(function).ok().and_then(|i| self.active.get_mut(i)) {
            *active += 1;
            self.stack.push(Frame { function, entered: left, children: 0, nested_overhead: 0 });
        }
    }

    fn drop_frame(&mut self, frame: Frame) {
        if let Some(active) = usize::try_from(frame.function).ok().and_then(|i| self.active.get_mut(i)) {
            *active = active.saturating_sub(1);
        }
        self.discarded += 1;
    }

    fn exit(&mut self, function: u32, left: u64) {
        // Normally the top frame; frames above it were skipped by an unwind and are dropped.
        let Some(at) = self.stack.iter().rposition(|f| f.function == function) else {
            self.discarded += 1;
            return;
        };
        while self.stack.len() > at + 1 {
            if let Some(frame) = self.stack.pop() {
                self.drop_frame(frame);
            }
        }
        let Some(frame) = self.stack.pop() else { return };
        let params = self.table.params(function);
        let raw = frame.entered.saturating_sub(left);
        let inclusive = raw.saturating_sub(span_overhead(params)).saturating_sub(frame.nested_overhead);
        let exclusive = inclusive.saturating_sub(frame.children);
        let index = usize::try_from(function).unwrap_or(usize::MAX);
        let outermost = match self.active.get_mut(index) {
            Some(active) => {
                *active = active.saturating_sub(1);
                *active == 0
            }
            None => true,
        };
        if let Some(totals) = self.totals.get_mut(index) {
            totals.calls += 1;
            totals.exclusive += exclusive;
            if outermost {
                totals.inclusive += inclusive;
            }
        }
        let overhead = wrapper_overhead(params);
        self.overhead += overhead;
        if let Some(parent) = self.stack.last_mut() {
            parent.children += inclusive;
            parent.nested_overhead += frame.nested_overhead + overhead;
        }
    }

    /// The profile so far.
    pub fn snapshot(&self) -> FunctionProfile {
        let functions = self
            .totals
            .iter()
            .enumerate()
            .filter(|(_, t)| t.calls > 0)
            .map(|(i, t)| {
                let index = u32::try_from(i).unwrap_or(u32::MAX);
                FunctionStats {
                    index,
                    name: self.table.name(index),
                    calls: t.calls,
                    inclusive: t.inclusive,
                    exclusive: t.exclusive,
                }
            })
            .collect();
        FunctionProfile { functions, wrapper_overhead: self.overhead, discarded_frames: self.discarded }
    }
}

/// One function's totals in a [`FunctionProfile`]. Fuel is in wasmtime fuel units (≈ one per wasm
/// instruction), as the uninstrumented module burns it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FunctionStats {
    /// The function's index in the original module (imports included).
    pub index: u32,
    /// Its name (the module's `name` section, Rust symbols demangled without their hash, ` [<index>]`
    /// appended to a name several functions share; else `func[<index>]`).
    pub name: String,
    /// How many times it was called (by the guest, or by the host as an export).
    pub calls: u64,
    /// Fuel of its calls, callees included (recursive activations counted once, at the outermost).
    pub inclusive: u64,
    /// Fuel of its own instructions, callees excluded.
    pub exclusive: u64,
}

/// Where the guest spends its fuel, by function ([`crate::HostBuilder::function_profile`]): exact under
/// wasmtime's default fuel costs (see [`crate::profile`]), all VMs together.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct FunctionProfile {
    /// Every function called at least once, by index.
    pub functions: Vec<FunctionStats>,
    /// Fuel the instrumentation's wrappers burnt (removed from every figure, and from
    /// [`crate::Cost::fuel`]).
    pub wrapper_overhead: u64,
    /// Calls that never returned normally (a trap failed the VM, or an unwind skipped them): not counted.
    pub discarded_frames: u64,
}

impl FunctionProfile {
    /// The fuel of all profiled guest code: the sum of the exclusive fuel.
    pub fn total(&self) -> u64 {
        self.functions.iter().map(|f| f.exclusive).sum()
    }

    /// The functions, most exclusive fuel first.
    pub fn by_exclusive(&self) -> Vec<&FunctionStats> {
        let mut rows: Vec<_> = self.functions.iter().collect();
        rows.sort_by_key(|f| (core::cmp::Reverse(f.exclusive), f.index));
        rows
    }

    /// The functions, most inclusive fuel first.
    pub fn by_inclusive(&self) -> Vec<&FunctionStats> {
        let mut rows: Vec<_> = self.functions.iter().collect();
        rows.sort_by_key(|f| (core::cmp::Reverse(f.inclusive), f.index));
        rows
    }

    /// A function by name (the first one, if several share it).
    pub fn function(&self, name: &str) -> Option<&FunctionStats> {
        self.functions.iter().find(|f| f.name == name)
    }

    /// Adds another profile of the same module (another VM's).
    pub fn merge(&mut self, other: &FunctionProfile) {
        let mut by_index: BTreeMap<u32, FunctionStats> = self.functions.drain(..).map(|f| (f.index, f)).collect();
        for f in &other.functions {
            by_index
                .entry(f.index)
                .and_modify(|mine| {
                    mine.calls += f.calls;
                    mine.inclusive += f.inclusive;
                    mine.exclusive += f.exclusive;
                })
                .or_insert_with(|| f.clone());
        }
        self.functions = by_index.into_values().collect();
        self.wrapper_overhead += other.wrapper_overhead;
        self.discarded_frames += other.discarded_frames;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostBuilder;
    #[cfg(feature = "wasmtime")]
    use crate::{Outcome, RequestSpec};

    /// A proxy-wasm module whose request callback runs `$outer(number of headers)`: `$outer` calls
    /// `$spin(n)`, a loop that calls `$leaf` n times, then `$leaf` once more and `$fact(5)` (recursive),
    /// then `$leaf` through a table; it answers a local reply whose status depends on the result. Before,
    /// it reads the request headers, for which the host calls `proxy_on_memory_allocate` (function 3).
    const MODULE: &str = r#"(module
      (import "env" "proxy_send_local_response" (func $reply (param i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
      (import "env" "proxy_get_header_map_pairs" (func $pairs (param i32 i32 i32) (result i32)))
      (memory (export "memory") 2)
      (global $heap (mut i32) (i32.const 65536))
      (table 1 funcref)
      (elem (i32.const 0) $leaf)
      (func (export "proxy_abi_version_0_2_1"))
      (func (export "proxy_on_memory_allocate") (param $size i32) (result i32)
        (local $p i32)
        (local.set $p (global.get $heap))
        (global.set $heap (i32.add (global.get $heap) (local.get $size)))
        (local.get $p))
      (func (export "proxy_on_context_create") (param i32 i32))
      (func (export "proxy_on_vm_start") (param i32 i32) (result i32) (i32.const 1))
      (func (export "proxy_on_configure") (param i32 i32) (result i32) (i32.const 1))
      (func (export "proxy_on_done") (param i32) (result i32) (i32.const 1))
      (func $leaf (param $x i32) (result i32) (i32.add (i32.mul (local.get $x) (i32.const 3)) (i32.const 1)))
      (func $spin (param $n i32) (result i32) (local $acc i32)
        (block $done
          (loop $again
            (br_if $done (i32.eqz (local.get $n)))
            (local.set $acc (call $leaf (local.get $acc)))
            (local.set $n (i32.sub (local.get $n) (i32.const 1)))
            (br $again)))
        (local.get $acc))
      (func $fact (param $n i32) (result i32)
        (if (result i32) (i32.le_u (local.get $n) (i32.const 1))
          (then (i32.const 1))
          (else (i32.mul (local.get $n) (call $fact (i32.sub (local.get $n) (i32.const 1)))))))
      (func $outer (param $n i32) (result i32)
        (i32.add
          (i32.add (call $spin (local.get $n)) (call $leaf (local.get $n)))
          (i32.add (call $fact (i32.const 5)) (call_indirect (param i32) (result i32) (i32.const 2) (i32.const 0)))))
      (func (export "proxy_on_request_headers") (param $ctx i32) (param $n i32) (param i32) (result i32)
        (drop (call $pairs (i32.const 0) (i32.const 0) (i32.const 4)))
        (drop (call $reply
          (i32.add (i32.const 200) (i32.rem_u (call $outer (local.get $n)) (i32.const 300)))
          (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const -1)))
        (i32.const 1)))"#;

    #[cfg(feature = "wasmtime")]
    fn request(headers: usize) -> RequestSpec {
        let pairs: Vec<(String, String)> = (0..headers).map(|i| (format!("x-h{i}"), "v".to_string())).collect();
        RequestSpec { headers: pairs, ..RequestSpec::default() }
    }

    #[cfg(feature = "wasmtime")]
    /// Runs one request with `headers` headers; the outcome and, if profiling, the profile of the request
    /// alone.
    fn run(headers: usize, profile: bool) -> (Outcome, Option<FunctionProfile>) {
        let wasm = wat::parse_str(MODULE).unwrap();
        let mut host = HostBuilder::from_bytes(wasm).function_profile(profile).build().unwrap();
        assert!(host.refusal().is_none(), "{:?}", host.refusal());
        host.reset_function_profile();
        let outcome = host.send_request(0, request(headers)).unwrap();
        (outcome, host.function_profile())
    }

    #[cfg(feature = "wasmtime")]
    fn stats<'a>(profile: &'a FunctionProfile, name: &str) -> &'a FunctionStats {
        profile.function(name).unwrap_or_else(|| panic!("no {name} in {profile:#?}"))
    }

    #[test]
    #[cfg(not(feature = "wasmtime"))]
    fn the_profile_is_refused_without_exact_fuel() {
        let wasm = wat::parse_str(MODULE).unwrap();
        let error = HostBuilder::from_bytes(wasm).function_profile(true).build().err();
        assert!(
            matches!(&error, Some(crate::HostError::Instrument(m)) if m.contains("--features wasmtime")),
            "{error:?}"
        );
    }

    /// On wasmtime only: the profile's exactness rests on its fuel ([`crate::engine`]). `make bench` runs it
    /// before the sections that use the profile.
    #[test]
    #[cfg(feature = "wasmtime")]
    fn the_profile_is_exact_and_consistent() {
        let (plain_few, none) = run(2, false);
        assert!(none.is_none());
        let (few, profile_few) = run(2, true);
        let (plain_many, _) = run(40, false);
        let (many, profile_many) = run(40, true);
        let (few_profile, many_profile) = (profile_few.unwrap(), profile_many.unwrap());

        // Same results with and without instrumentation; the instrumentation's cost is removed from Cost.
        assert_eq!(few.status(), plain_few.status());
        assert_eq!(many.status(), plain_many.status());
        assert!(matches!(few, Outcome::LocalReply { .. }), "{few:?}");
        let fuel = |o: &Outcome| o.cost().unwrap().fuel;
        assert_eq!(fuel(&few), fuel(&plain_few));
        assert_eq!(fuel(&many), fuel(&plain_many));
        // The exclusive fuel of all functions is the request's fuel, to the unit.
        assert_eq!(few_profile.total(), fuel(&plain_few), "{few_profile:#?}");
        assert_eq!(many_profile.total(), fuel(&plain_many), "{many_profile:#?}");
        assert_eq!(few_profile.discarded_frames, 0);
        assert!(few_profile.wrapper_overhead > 0);

        for profile in [&few_profile, &many_profile] {
            let outer = stats(profile, "outer");
            let (spin, leaf, fact) = (stats(profile, "spin"), stats(profile, "leaf"), stats(profile, "fact"));
            let (handler, alloc) = (stats(profile, "func[12]"), stats(profile, "func[3]"));
            assert_eq!((outer.calls, spin.calls, handler.calls, alloc.calls), (1, 1, 1, 1));
            assert_eq!(fact.calls, 5, "recursive activations are calls");
            // $leaf: n times from $spin, once directly, once through the table. Each call costs its entry
            // and its 5 instructions (`end` is free) and calls nothing.
            let n = leaf.calls - 2;
            assert_eq!(leaf.exclusive, 6 * leaf.calls);
            assert_eq!(leaf.inclusive, leaf.exclusive);
            // $spin: its entry, 11 instructions per iteration, 3 for the last test, 1 for the result.
            assert_eq!(spin.exclusive, 1 + 11 * n + 3 + 1, "{profile:#?}");
            assert_eq!(spin.inclusive, spin.exclusive + 6 * n);
            // $fact: inclusive counts the outermost call only, which covers the five bodies.
            assert_eq!(fact.inclusive, fact.exclusive);
            // The outer function's inclusive fuel covers its children's, and exactly its own body more.
            let children = spin.inclusive + fact.inclusive + 2 * 6;
            assert!(outer.inclusive >= children, "{profile:#?}");
            assert_eq!(outer.inclusive, outer.exclusive + children);
            // The allocator the host ran during the hostcall nests under the handler; the hostcall is free.
            assert_eq!(handler.inclusive, handler.exclusive + outer.inclusive + alloc.inclusive);
            assert!(alloc.inclusive > 0);
        }
        // The loop's exclusive fuel grows with the iteration count (the number of headers).
        let (n_few, n_many) = (stats(&few_profile, "leaf").calls - 2, stats(&many_profile, "leaf").calls - 2);
        assert_eq!(n_many - n_few, 38);
        assert!(stats(&many_profile, "spin").exclusive > stats(&few_profile, "spin").exclusive);
    }

    #[test]
    fn names_and_indices_survive_instrumentation() {
        let wasm = wat::parse_str(MODULE).unwrap();
        let instrumented = instrument(&wasm).unwrap();
        // 2 imports + 11 defined functions.
        assert_eq!(instrumented.functions.len(), 13);
        assert_eq!(instrumented.functions.name(0), "reply");
        assert_eq!(instrumented.functions.name(8), "leaf");
        assert_eq!(instrumented.functions.name(12), "func[12]");
        let engine = crate::engine::metering_engine().unwrap();
        let module = crate::engine::Module::new(&engine, &instrumented.wasm).unwrap();
        let imports: Vec<String> = module.imports().map(|i| format!("{}.{}", i.module(), i.name())).collect();
        let expected = [
            "env.proxy_send_local_response",
            "env.proxy_get_header_map_pairs",
            "erl_profile.enter",
            "erl_profile.exit",
        ];
        assert_eq!(imports, expected);
        assert_eq!(module.exports().count(), crate::engine::Module::new(&engine, &wasm).unwrap().exports().count());
    }

    #[test]
    fn bad_modules_are_refused_with_a_message() {
        assert!(instrument(b"not wasm").unwrap_err().contains("cannot parse"));
        let clash = wat::parse_str(r#"(module (import "erl_profile" "enter" (func (param i32))))"#).unwrap();
        assert!(instrument(&clash).unwrap_err().contains("already imports erl_profile.enter"));
        if crate::engine::EXACT_FUEL {
            let error = HostBuilder::from_bytes(b"\0asm\x01\0\0\0\x01".to_vec()).function_profile(true).build().err();
            assert!(matches!(error, Some(crate::HostError::Instrument(_))), "{error:?}");
        }
        // A module without types, imports or functions still gets the profiler's imports.
        let empty = instrument(&wat::parse_str("(module)").unwrap()).unwrap();
        let module = crate::engine::Module::new(&crate::engine::metering_engine().unwrap(), &empty.wasm).unwrap();
        assert_eq!(module.imports().count(), 2);
    }

    #[test]
    fn hashes_are_removed_from_names() {
        assert_eq!(without_hash("core::fmt::write::h0123456789abcdef"), "core::fmt::write");
        assert_eq!(without_hash("a::hello"), "a::hello");
        assert_eq!(without_hash("x"), "x");
        assert_eq!(readable("_ZN4core3fmt5write17h0123456789abcdefE"), "core::fmt::write");
        assert_eq!(readable("_RNvNtNtCsdHhIpgkcIfN_4core3str8converts9from_utf8"), "core::str::converts::from_utf8");
        assert_eq!(readable("memcmp"), "memcmp");
    }
}
