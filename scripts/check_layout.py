#!/usr/bin/env python3
"""Checks that a crate's source files and functions stay small enough to read (`make lint`).

    scripts/check_layout.py src tools/admin/src

For each `.rs` file under the given directories: at most MAX_FILE_LINES lines before its tests (an inline
`#[cfg(test)] mod ... {` block at the end does not count; a file that is only tests, `#![cfg(test)]` or
declared `#[cfg(test)] mod x;` by its parent, is skipped), and no function longer than MAX_FN_LINES lines
(from its `fn` line to its closing brace, test functions excepted). Exit status 1 with one line per file or
function over the limit; otherwise one summary line per directory.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

MAX_FILE_LINES = 500
MAX_FN_LINES = 80

TEST_BLOCK = re.compile(r"^#\[cfg\((?:all\()?test")
FN_START = re.compile(r"^\s*(?:pub(?:\([a-z]+\))?\s+)?(?:const\s+)?(?:unsafe\s+)?(?:extern\s+\"C\"\s+)?fn\s+(\w+)")
TEST_MODULE_DECL = re.compile(r"^#\[cfg\((?:all\()?test[^\]]*\]\s*\n\s*(?:pub(?:\([a-z]+\))?\s+)?mod\s+(\w+);", re.M)


def test_only_files(src: Path) -> set[Path]:
    """Files of modules their parent declares only under `#[cfg(test)]` (or `#[cfg(all(test, ...))]`)."""
    files: set[Path] = set()
    for parent in src.rglob("*.rs"):
        text = parent.read_text()
        base = parent.parent if parent.name in ("lib.rs", "mod.rs", "main.rs") else parent.with_suffix("")
        for name in TEST_MODULE_DECL.findall(text):
            for candidate in (base / f"{name}.rs", base / name / "mod.rs"):
                files.add(candidate)
    return files


def code_lines(lines: list[str]) -> int:
    """Lines before the file's trailing test module."""
    for index, line in enumerate(lines):
        if TEST_BLOCK.match(line) and index + 1 < len(lines) and re.match(r"\s*(?:pub(?:\([a-z]+\))?\s+)?mod\s+\w+\s*\{", lines[index + 1]):
            return index
    return len(lines)


def long_functions(lines: list[str], limit: int) -> list[tuple[str, int, int]]:
    """(name, first line, length) of every function longer than `limit` lines, outside test modules."""
    found = []
    end = code_lines(lines)
    index = 0
    while index < end:
        match = FN_START.match(lines[index])
        if not match:
            index += 1
            continue
        depth, started, last = 0, False, index
        for position in range(index, end):
            text = re.sub(r'"(?:\\.|[^"\\])*"', '""', lines[position].split("//", 1)[0])
            text = re.sub(r"'(?:\\.|[^'\\])'", "''", text)
            depth += text.count("{") - text.count("}")
            started |= "{" in text
            if started and depth <= 0:
                last = position
                break
            if not started and text.rstrip().endswith(";"):
                last = position
                break
        length = last - index + 1
        if length > limit:
            found.append((match.group(1), index + 1, length))
        index += 1
    return found


def main(directories: list[str]) -> int:
    failed = False
    for directory in directories:
        src = Path(directory)
        skip = test_only_files(src)
        files = [f for f in sorted(src.rglob("*.rs")) if f not in skip and "#![cfg(test)]" not in f.read_text()]
        biggest = 0
        for file in files:
            lines = file.read_text().splitlines()
            count = code_lines(lines)
            biggest = max(biggest, count)
            if count > MAX_FILE_LINES:
                print(f"{file}: {count} lines before its tests (at most {MAX_FILE_LINES})")
                failed = True
            for name, line, length in long_functions(lines, MAX_FN_LINES):
                print(f"{file}:{line}: fn {name} is {length} lines (at most {MAX_FN_LINES})")
                failed = True
        print(f"{directory}: {len(files)} files, the longest {biggest} lines before its tests")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["src"]))
