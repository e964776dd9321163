#!/usr/bin/env python3
"""Checks that the modules of a Rust crate import each other without a cycle, and the filter's modules
only downwards through the floors of src/lib.rs's map; inside src/filter/, that its modules import their
siblings only downwards through the floors of src/filter/mod.rs (the tick and the outboxes below the
request driver).

    scripts/check_imports.py src tools/admin/src

For each source directory (a crate's `src/`), every top-level module (`foo.rs` or `foo/`) is a node; a
file of module A that names `crate::B` (in a `use` or a path) is an edge A -> B. Exit status 1 and the
cycle, module by module, if the graph has one. For the filter's crate (`src`), every module sits on a
floor ([`FLOORS`], as src/lib.rs describes them) and may import only modules on its own floor or below
(the test support module `testing` excepted): exit status 1 naming each import that goes up, or a module
without a floor. The same for the submodules of a directory in [`SUBFLOORS`] (`super::x` and
`crate::filter::x` name sibling `x`; test modules excepted). Otherwise one line per crate with its edges
(`make lint`).
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
        "resp host key matching usage calendar",                         # 1 protocol, the host seam, keys
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

# The floors of the submodules of a module directory (src/filter/mod.rs, "Layout"), lowest first: a submodule
# imports only siblings on its own floor or below. Its test modules (`tests`, `*_tests`, `interleavings`) may
# import any sibling.
SUBFLOORS: dict[str, list[str]] = {
    "src/filter": [
        "ids metrics route hold",     # 0 this process's ids, counters and logs, configurations compiled
        "tick",                       # 1 the root context's tick
        "give_back",                  # 2 give-back calls, one at a time
        "outbox settle permit_outbox",  # 3 what leaves from the tick: the outbox, reservations and their settles, in-flight permits
        # 4 the request driver, late replies of requests that stopped waiting, and in-flight permits (before
        # the rate rules, or in the same call as their acquire: the two stages call each other)
        "body end flow coalesce late inflight wait",
        "handover",                   # 5 a configuration that goes away and the one that takes over
    ],
}
SUPER_PATH = re.compile(r"\bsuper::(?:\{\s*)?([a-z_][a-z0-9_]*)")
SUPER_GROUP = re.compile(r"\bsuper::\{([^}]*)\}")


def is_test_module(name: str) -> bool:
    return name == "tests" or name.endswith("_tests") or name == "interleavings"


def subfloor_errors(directory: Path) -> tuple[list[str], int]:
    """Sibling imports inside `directory` that go up its floors, and submodules without a floor; and the
    number of sibling imports."""
    floors = SUBFLOORS[str(directory)]
    floor_of = {module: level for level, names in enumerate(floors) for module in names.split()}
    siblings = {file.stem for file in directory.glob("*.rs") if file.stem != "mod"}
    parent = directory.name
    errors, count = [], 0
    for file in sorted(directory.glob("*.rs")):
        module = file.stem
        if module == "mod" or is_test_module(module):
            continue
        if module not in floor_of:
            errors.append(f"{directory}: submodule `{module}` has no floor: add it to SUBFLOORS in {__file__}")
            continue
        text = strip_comments(file.read_text())
        targets = set(SUPER_PATH.findall(text))
        targets.update(re.findall(rf"\bcrate::{parent}::([a-z_][a-z0-9_]*)", text))
        for group in SUPER_GROUP.findall(text):
            targets.update(name.strip().split("::")[0] for name in group.split(",") if name.strip())
        for target in sorted((targets & siblings) - {module}):
            count += 1
            if is_test_module(target):
                continue
            if floor_of.get(target, len(floors)) > floor_of[module]:
                errors.append(f"{directory}: `{module}` (floor {floor_of[module]}) imports `{target}` "
                              f"(floor {floor_of.get(target, '?')}): imports go down the floors only")
    return errors, count


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
    for directory in SUBFLOORS:
        if not any(directory.startswith(argument.rstrip("/")) for argument in argv or ["src"]):
            continue
        errors, count = subfloor_errors(Path(directory))
        for error in errors:
            print(error, file=sys.stderr)
            status = 1
        if not errors:
            print(f"{directory}: {count} sibling imports, each down its floors")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
