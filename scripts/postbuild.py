#!/usr/bin/env python3
"""Post-build step for one built .wasm artifact: validate, strip, check imports/exports and size.

Usage:
    scripts/postbuild.py --profile envoy IN.wasm OUT.wasm

Settings come from wasm-tools.toml at the repository root: [postbuild] for every artifact, changed per
artifact by [artifact.<profile>] (a scalar replaces, a list adds). The checks use `wasm-tools` (PATH
first, then .tools/bin/ as installed by scripts/setup.sh):

    validate            `wasm-tools validate` on IN and on OUT
    wasm_opt            binaryen's `wasm-opt` with these arguments (e.g. ["-Oz"]) before stripping; `-g` is
                        added so the name section survives for keep_name_section
    strip               `wasm-tools strip` (keep_name_section = false adds --all)
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


def find_wasm_tools() -> str:
    found = shutil.which("wasm-tools")
    if found:
        return found
    local = ROOT / ".tools" / "bin" / "wasm-tools"
    if local.is_file():
        return str(local)
    raise PostbuildError("wasm-tools not found on PATH or in .tools/bin (run scripts/setup.sh)")


def find_wasm_opt() -> str:
    found = shutil.which("wasm-opt")
    if found:
        return found
    raise PostbuildError("wasm-opt not found on PATH (Debian package binaryen; run scripts/setup.sh)")


def wasm_opt(args: tuple[str, ...], src: Path, out: Path) -> None:
    """Runs `wasm-opt ARGS -g SRC -o OUT` (features as the module's target_features section declares)."""
    proc = subprocess.run([find_wasm_opt(), *args, "-g", str(src), "-o", str(out)], capture_output=True, text=True)
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()
        raise PostbuildError(f"wasm-opt {' '.join(args)} failed (exit {proc.returncode}):\n{detail}")


def wasm_tools(tool: str, *args: str) -> str:
    """Runs `wasm-tools ARGS...` and returns its stdout; a failure raises with its stderr."""
    proc = subprocess.run([tool, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()
        raise PostbuildError(f"wasm-tools {args[0]} failed (exit {proc.returncode}):\n{detail}")
    return proc.stdout


# One line per import/export in `wasm-tools print` output, e.g.
#   (import "env" "proxy_log" (func $... (type 5) (param i32 i32 i32) (result i32)))
#   (export "proxy_on_vm_start" (func $proxy_on_vm_start))
_WAT_STRING = r'"((?:[^"\\]|\\.)*)"'
_IMPORT_RE = re.compile(r"^\s*\(import " + _WAT_STRING + " " + _WAT_STRING)
_EXPORT_RE = re.compile(r"^\s*\(export " + _WAT_STRING)
# `wasm-tools objdump` section lines, e.g. "  imports  |  0x136 -  0x592 |  1116 bytes | 37 count"
_OBJDUMP_RE = re.compile(r"^\s*(imports|exports)\s*\|.*\|\s*(\d+) count\s*$")


def _unescape_wat(s: str) -> str:
    """Decodes a WAT string literal's escapes (\\xx hex bytes, \\u{...}, \\n, \\t, \\", ...)."""
    out = bytearray()
    i = 0
    simple = {"n": b"\n", "t": b"\t", "r": b"\r", '"': b'"', "'": b"'", "\\": b"\\"}
    while i < len(s):
        c = s[i]
        if c != "\\":
            out += c.encode()
            i += 1
        elif s[i + 1 : i + 2] in simple:
            out += simple[s[i + 1]]
            i += 2
        elif s[i + 1 : i + 3] == "u{":
            end = s.index("}", i)
            out += chr(int(s[i + 3 : end], 16)).encode()
            i = end + 1
        else:
            out.append(int(s[i + 1 : i + 3], 16))
            i += 3
    return out.decode("utf-8", errors="replace")


def imports_exports(tool: str, wasm: Path) -> tuple[list[str], list[str]]:
    """Returns the module's imports as "module.name" and its export names, in module order."""
    imports: list[str] = []
    exports: list[str] = []
    for line in wasm_tools(tool, "print", "--skeleton", str(wasm)).splitlines():
        if m := _IMPORT_RE.match(line):
            imports.append(f"{_unescape_wat(m.group(1))}.{_unescape_wat(m.group(2))}")
        elif m := _EXPORT_RE.match(line):
            exports.append(_unescape_wat(m.group(1)))
    # Cross-check against the section counts so a change in the text format cannot pass silently.
    counts = {"imports": 0, "exports": 0}
    for line in wasm_tools(tool, "objdump", str(wasm)).splitlines():
        if m := _OBJDUMP_RE.match(line):
            counts[m.group(1)] = int(m.group(2))
    if (len(imports), len(exports)) != (counts["imports"], counts["exports"]):
        raise PostbuildError(
            f"{wasm}: read {len(imports)} imports / {len(exports)} exports from `wasm-tools print`, "
            f"but the sections hold {counts['imports']} / {counts['exports']}"
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


def postbuild(settings: Settings, tool: str, src: Path, out: Path) -> str:
    """Writes the checked artifact to OUT and returns the summary line; raises on any failure."""
    if not src.is_file():
        raise PostbuildError(f"{src}: no such file (did the cargo build run?)")
    if settings.validate:
        wasm_tools(tool, "validate", str(src))
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    stage = tmp.with_suffix(".opt.wasm") if settings.wasm_opt else src
    try:
        if settings.wasm_opt:
            wasm_opt(settings.wasm_opt, src, stage)
        if settings.strip:
            wasm_tools(tool, "strip", *([] if settings.keep_name_section else ["--all"]), str(stage), "-o", str(tmp))
        else:
            shutil.copyfile(stage, tmp)
        if settings.validate:
            wasm_tools(tool, "validate", str(tmp))
        size = tmp.stat().st_size
        imports, exports = imports_exports(tool, tmp)
        problems = check(settings, out, size, imports, exports)
        if problems:
            raise PostbuildError("\n".join(problems))
        digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
        tmp.chmod(0o644)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
        if stage != src:
            stage.unlink(missing_ok=True)

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
        print(postbuild(settings, find_wasm_tools(), args.input, args.output))
    except PostbuildError as e:
        args.output.unlink(missing_ok=True)
        print(f"postbuild [{args.profile}] FAILED:\n{e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
