#!/usr/bin/env python3
"""Post-build step for one built .wasm artifact: validate, strip, check imports/exports and size.

Usage:
    scripts/postbuild.py --profile envoy IN.wasm OUT.wasm

Settings come from wasm-tools.toml at the repository root: [postbuild] for every artifact, changed per
artifact by [artifact.<profile>] (a scalar replaces, a list adds). The tools are Debian's: wabt 1.0.32
(`wasm-validate`, `wasm-objdump`, `wasm-strip`) and binaryen 108 (`wasm-opt`), both installed by
scripts/setup.sh (a cargo-installed wasm-tools took 35-65 s of setup's 2 cores):

    validate            `wasm-validate` on IN and on OUT
    wasm_opt            binaryen's `wasm-opt` with these arguments (e.g. ["-Oz"]) before stripping
    strip               custom sections removed: `wasm-opt --strip-producers --strip-target-features
                        --strip-dwarf` (the name section kept with `-g`) or, with keep_name_section = false,
                        `wasm-strip` (every custom section); any other custom section left fails the check
    size_budget_bytes   OUT must not be larger
    required_exports    names OUT must export
    required_imports    "module.name" imports OUT must have
    forbidden_imports   "module.name" imports OUT must not have
    allowed_imports     fnmatch patterns ("env.proxy_*") every import must match

On success it writes OUT and prints one line: path, size, budget, import and export counts. On failure it
prints every failed check, naming the file, writes no OUT (an old one is removed) and exits 1.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIST_KEYS = {"wasm_opt", "required_exports", "required_imports", "forbidden_imports", "allowed_imports"}
SCALAR_KEYS = {"description", "validate", "strip", "keep_name_section", "size_budget_bytes"}


class PostbuildError(Exception):
    """A failed step or check; the message is shown as is."""


@dataclass(frozen=True)
class Settings:
    profile: str
    validate: bool
    strip: bool
    keep_name_section: bool
    size_budget_bytes: int | None
    wasm_opt: tuple[str, ...]
    required_exports: tuple[str, ...]
    required_imports: tuple[str, ...]
    forbidden_imports: tuple[str, ...]
    allowed_imports: tuple[str, ...]


def load_settings(config_path: Path, profile: str) -> Settings:
    """Reads [postbuild] and [artifact.<profile>] from the TOML file and merges them."""
    try:
        with config_path.open("rb") as f:
            doc = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise PostbuildError(f"{config_path}: {e}") from e

    base = doc.get("postbuild", {})
    artifacts = doc.get("artifact", {})
    if profile not in artifacts:
        known = ", ".join(sorted(artifacts)) or "none"
        raise PostbuildError(f"{config_path}: no [artifact.{profile}] section (profiles: {known})")
    merged: dict[str, object] = {}
    for section, table in (("postbuild", base), (f"artifact.{profile}", artifacts[profile])):
        for key, value in table.items():
            where = f"{config_path}: [{section}] {key}"
            if key in LIST_KEYS:
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise PostbuildError(f"{where}: must be a list of strings")
                merged[key] = [*merged.get(key, []), *value]  # type: ignore[misc]
            elif key in SCALAR_KEYS:
                merged[key] = value
            else:
                known = ", ".join(sorted(LIST_KEYS | SCALAR_KEYS))
                raise PostbuildError(f"{where}: unknown setting (known: {known})")

    def flag(key: str, default: bool) -> bool:
        value = merged.get(key, default)
        if not isinstance(value, bool):
            raise PostbuildError(f"{config_path}: {key} must be true or false")
        return value

    budget = merged.get("size_budget_bytes")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
        raise PostbuildError(f"{config_path}: size_budget_bytes must be a positive integer")

    def names(key: str) -> tuple[str, ...]:
        return tuple(dict.fromkeys(merged.get(key, [])))  # type: ignore[arg-type]

    return Settings(
        profile=profile,
        validate=flag("validate", True),
        strip=flag("strip", False),
        keep_name_section=flag("keep_name_section", True),
        size_budget_bytes=budget,  # type: ignore[arg-type]
        wasm_opt=tuple(merged.get("wasm_opt", [])),  # type: ignore[arg-type]
        required_exports=names("required_exports"),
        required_imports=names("required_imports"),
        forbidden_imports=names("forbidden_imports"),
        allowed_imports=names("allowed_imports"),
    )


def find_tool(name: str, package: str) -> str:
    """The path of Debian tool `name` (package `package`) on PATH; raises when it is missing."""
    found = shutil.which(name)
    if found:
        return found
    raise PostbuildError(f"{name} not found on PATH (Debian package {package}; run scripts/setup.sh)")


def run_tool(name: str, package: str, *args: str) -> str:
    """Runs `NAME ARGS...` and returns its stdout; a failure raises with its stderr."""
    proc = subprocess.run([find_tool(name, package), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()
        raise PostbuildError(f"{name} {' '.join(args)} failed (exit {proc.returncode}):\n{detail}")
    return proc.stdout


def validate(wasm: Path) -> None:
    """`wasm-validate WASM` (wabt): raises with its message when the module is not valid."""
    run_tool("wasm-validate", "wabt", str(wasm))


# The strip passes of wasm-opt: every custom section rustc and LLVM write but the name section.
STRIP_PASSES = ("--strip-producers", "--strip-target-features", "--strip-dwarf")


def wasm_opt(args: tuple[str, ...], keep_names: bool, src: Path, out: Path) -> None:
    """Runs `wasm-opt ARGS [-g] SRC -o OUT` (features as the module's target_features section declares);
    `-g` keeps the name section."""
    run_tool("wasm-opt", "binaryen", *args, *(["-g"] if keep_names else []), str(src), "-o", str(out))


# `wasm-objdump -x` (wabt 1.0.32) lines, e.g.
#   "Import[22]:" / " - func[0] sig=8 <proxy_log> <- env.proxy_log"
#   "Export[16]:" / " - memory[0] -> \"memory\""
# and `wasm-objdump -h` custom section lines, e.g. '   Custom start=0x0005a3d6 end=0x00065a6e (size=...) "name"'.
_SECTION_RE = re.compile(r"^(Import|Export)\[(\d+)\]:$")
_IMPORT_RE = re.compile(r"^ - \w+\[\d+\].* <- (.+)$")
_EXPORT_RE = re.compile(r'^ - \w+\[\d+\].* -> "(.*)"$')
_CUSTOM_RE = re.compile(r'^\s*Custom start=.*"(.*)"$')


def custom_sections(wasm: Path) -> list[str]:
    """The names of the module's custom sections, in module order (`wasm-objdump -h`)."""
    lines = run_tool("wasm-objdump", "wabt", "-h", str(wasm)).splitlines()
    return [m.group(1) for line in lines if (m := _CUSTOM_RE.match(line))]


def imports_exports(wasm: Path) -> tuple[list[str], list[str]]:
    """Returns the module's imports as "module.name" and its export names, in module order."""
    found: dict[str, list[str]] = {"Import": [], "Export": []}
    counts = {"Import": 0, "Export": 0}
    section = None
    for line in run_tool("wasm-objdump", "wabt", "-x", str(wasm)).splitlines():
        if m := _SECTION_RE.match(line):
            section = m.group(1)
            counts[section] = int(m.group(2))
        elif not line.startswith(" - "):
            section = None
        elif section == "Import" and (m := _IMPORT_RE.match(line)):
            found["Import"].append(m.group(1))
        elif section == "Export" and (m := _EXPORT_RE.match(line)):
            found["Export"].append(m.group(1))
    # Cross-check against the section counts so a change in the text format cannot pass silently.
    imports, exports = found["Import"], found["Export"]
    if (len(imports), len(exports)) != (counts["Import"], counts["Export"]):
        raise PostbuildError(
            f"{wasm}: read {len(imports)} imports / {len(exports)} exports from `wasm-objdump -x`, "
            f"but the sections hold {counts['Import']} / {counts['Export']}"
        )
    return imports, exports


def check(settings: Settings, out: Path, size: int, imports: list[str], exports: list[str]) -> list[str]:
    """Returns one message per failed check (empty if all pass)."""
    problems: list[str] = []
    if settings.size_budget_bytes is not None and size > settings.size_budget_bytes:
        problems.append(
            f"{out}: {size} bytes is over the size budget of {settings.size_budget_bytes} bytes "
            f"by {size - settings.size_budget_bytes} (size_budget_bytes)"
        )
    have_exports, have_imports = set(exports), set(imports)
    if missing := [e for e in settings.required_exports if e not in have_exports]:
        problems.append(f"{out}: missing required exports: {', '.join(missing)}")
    if missing := [i for i in settings.required_imports if i not in have_imports]:
        problems.append(f"{out}: missing required imports: {', '.join(missing)}")
    if present := [i for i in settings.forbidden_imports if i in have_imports]:
        problems.append(
            f"{out}: imports forbidden for profile {settings.profile!r}: {', '.join(present)} "
            f"(the host would refuse to load the module)"
        )
    if settings.allowed_imports:
        if stray := [i for i in imports if not any(fnmatch.fnmatchcase(i, p) for p in settings.allowed_imports)]:
            problems.append(
                f"{out}: imports the host does not provide (not in allowed_imports): {', '.join(stray)}"
            )
    return problems


def postbuild(settings: Settings, src: Path, out: Path) -> str:
    """Writes the checked artifact to OUT and returns the summary line; raises on any failure."""
    if not src.is_file():
        raise PostbuildError(f"{src}: no such file (did the cargo build run?)")
    if settings.validate:
        validate(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    keep_names = settings.keep_name_section
    try:
        # One wasm-opt run optimises (wasm_opt) and strips (strip; the name section kept with -g).
        # The strip passes go first: after -Oz they are a second pass over the code whose writing undoes
        # some of -Oz's work (+677 bytes measured, 2026-11-28); first, the output is byte for byte what
        # wasm-opt -Oz then wasm-tools strip wrote.
        passes = (STRIP_PASSES if settings.strip else ()) + settings.wasm_opt
        if passes:
            wasm_opt(passes, keep_names or not settings.strip, src, tmp)
        else:
            shutil.copyfile(src, tmp)
        if settings.strip and not keep_names:
            run_tool("wasm-strip", "wabt", str(tmp))
        if settings.strip and (left := [c for c in custom_sections(tmp) if not (keep_names and c == "name")]):
            raise PostbuildError(f"{out}: custom sections left after stripping: {', '.join(left)}")
        if settings.validate:
            validate(tmp)
        size = tmp.stat().st_size
        imports, exports = imports_exports(tmp)
        problems = check(settings, out, size, imports, exports)
        if problems:
            raise PostbuildError("\n".join(problems))
        digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
        tmp.chmod(0o644)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)

    budget = settings.size_budget_bytes
    budget_text = f"budget {budget} ({size * 100 // budget}%)" if budget else "no budget"
    src_size = src.stat().st_size
    steps = " and ".join(s for s, on in (("wasm-opt", settings.wasm_opt), ("strip", settings.strip)) if on)
    stripped = f", {src_size} before {steps}" if steps and src_size != size else ""
    return (
        f"{out}: {size} bytes{stripped}, {budget_text}, {len(imports)} imports, {len(exports)} exports, "
        f"sha256 {digest}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--profile", required=True, help="artifact profile: [artifact.<profile>] in the config")
    parser.add_argument("--config", type=Path, default=ROOT / "wasm-tools.toml", help="default: wasm-tools.toml")
    parser.add_argument("input", type=Path, help="the .wasm cargo built")
    parser.add_argument("output", type=Path, help="where to write the checked artifact")
    args = parser.parse_args(argv)
    try:
        settings = load_settings(args.config, args.profile)
        print(postbuild(settings, args.input, args.output))
    except PostbuildError as e:
        args.output.unlink(missing_ok=True)
        print(f"postbuild [{args.profile}] FAILED:\n{e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
