#!/usr/bin/env python3
"""Checks that the modules of a Rust crate import each other without a cycle, and the filter's modules
only downwards through the floors of src/lib.rs's map.

    scripts/check_imports.py src tools/admin/src

For each source directory (a crate's `src/`), every top-level module (`foo.rs` or `foo/`) is a node; a
file of module A that names `crate::B` (in a `use` or a path) is an edge A -> B. Exit status 1 and the
cycle, module by module, if the graph has one. For the filter's crate (`src`), every module sits on a
floor ([`FLOORS`], as src/lib.rs describes them) and may import only modules on its own floor or below
(the test support module `testing` excepted): exit status 1 naming each import that goes up, or a module
without a floor. Otherwise one line per crate with its edges (`make lint`).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

CRATE_PATH = re.compile(r"\bcrate::(?:\{\s*)?([a-z_][a-z0-9_]*)")
# `use crate::{a, b::c}`: the names inside the braces.
CRATE_GROUP = re.compile(r"\bcrate::\{([^}]*)\}")


# The floors of src/ (src/lib.rs, "Layout"), lowest first: a module imports only from its floor or below.
FLOORS: dict[str, list[str]] = {
    "src": [
        "prelude quote encoding id_map",                       # 0 base
        "resp host key matching usage",                         # 1 protocol, the host seam, keys
        "config",                                               # 2 the configuration
        "script cache block fallback lease transport response",  # 3 Redis commands and VM/process state
        "limiter",                                              # 4 the decision
        "http_bridge host_redis",                               # 5 the transports
        "filter",                                               # 6 the filter
        "abi",                                                  # 7 the module's ABI
    ],
}
# Imported by tests only (cfg(test)): any floor may use it.
TEST_SUPPORT = {"testing"}


def floor_errors(src: Path, edges: dict[str, set[str]]) -> list[str]:
    """Imports that go up a floor, and modules without one."""
    floors = FLOORS.get(str(src))
    if floors is None:
        return []
    floor_of = {module: level for level, names in enumerate(floors) for module in names.split()}
    errors = []
    for module in sorted(edges):
        if module in TEST_SUPPORT:
            continue
        if module not in floor_of:
            errors.append(f"{src}: module `{module}` has no floor: add it to FLOORS in {__file__} and to src/lib.rs")
            continue
        for target in sorted(edges[module] - TEST_SUPPORT):
            if floor_of.get(target, len(floors)) > floor_of[module]:
                errors.append(f"{src}: `{module}` (floor {floor_of[module]}) imports `{target}` "
                              f"(floor {floor_of.get(target, '?')}): imports go down the floors only")
    return errors


def module_of(src: Path, file: Path) -> str | None:
    relative = file.relative_to(src)
    first = relative.parts[0]
    if first in ("lib.rs", "main.rs"):
        return None
    return first.removesuffix(".rs")


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(line.split("//", 1)[0] for line in text.splitlines())


def graph(src: Path) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for file in sorted(src.rglob("*.rs")):
        module = module_of(src, file)
        if module is None:
            continue
        text = strip_comments(file.read_text())
        targets = set(CRATE_PATH.findall(text))
        for group in CRATE_GROUP.findall(text):
            targets.update(name.strip().split("::")[0] for name in group.split(",") if name.strip())
        edges.setdefault(module, set()).update(t for t in targets if t != module)
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 visiting, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def main(argv: list[str]) -> int:
    status = 0
    for directory in argv or ["src"]:
        src = Path(directory)
        edges = graph(src)
        cycle = find_cycle(edges)
        errors = floor_errors(src, edges)
        for error in errors:
            print(error, file=sys.stderr)
            status = 1
        if cycle:
            print(f"{src}: import cycle: {' -> '.join(cycle)}", file=sys.stderr)
            status = 1
        elif not errors:
            count = sum(len(targets) for targets in edges.values())
            print(f"{src}: {len(edges)} modules, {count} imports, no cycle")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
