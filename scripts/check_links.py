#!/usr/bin/env python3
"""Checks the documentation's links offline: every relative link and every anchor in README.md and
docs/*.md must resolve to an existing file and, for a `#anchor`, to a heading of the Markdown file it
names; and every citation of a documentation section in the repository's files (`docs/operating.md,
"Metrics"`, `README.md, "Tests"`) must name an existing page and the start of one of its headings.

Anchors follow GitHub's rules: the heading's text (inline code, emphasis and links reduced to their
text) lowercased, every character but letters, digits, `_`, `-` and spaces removed, spaces turned into
`-`; a repeated anchor gets `-1`, `-2`... Links inside fenced code blocks and inline code are not links.
External links (`https:`, `mailto:`...) are not checked: the check runs offline.

    python3 scripts/check_links.py               # checks the repository, exits 1 naming each broken link
    python3 scripts/check_links.py --self-test   # checks that the checker catches broken links

Python standard library only (run by `make lint`).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import unicodedata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# [text](target) and [text](target "title"); images ![alt](target) alike. Targets hold no spaces here.
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^\s)>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
# A citation of a documentation section: `docs/page.md, "Heading"` or `README.md "Heading"`, possibly
# wrapped after the comma onto a comment line, possibly followed by more headings (`, "Other"`).
CITATION = re.compile(
    r"\b(README\.md|docs/[A-Za-z0-9_-]+\.md)(?:,\s*|\s+)(?:(?://[/!]?|#)\s*)?\"([^\"\n]+)\"((?:,\s*\"[^\"\n]+\")*)"
)
# Where citations are looked for (the documentation's own text is checked through its links).
CITING_SUFFIXES = {".rs", ".py", ".toml", ".yaml", ".yml", ".sh", ".lua", ".txt", ".cfg"}
CITING_NAMES = {"Makefile", "run"}
SKIP_DIRS = {".git", "target", ".venv", ".tools", "node_modules", "dist"}


def plain_text(markdown: str) -> str:
    """A heading's text as GitHub renders it: code, links and emphasis reduced to their text."""
    text = INLINE_CODE.sub(lambda m: m.group(2).strip(), markdown)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"(\*{1,3})(.+?)\1", r"\2", text)
    return text.strip()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading (without the suffix of a repeated one)."""
    kept = []
    for char in plain_text(heading).lower():
        category = unicodedata.category(char)
        if char in " -" or category[0] in "LMN" or category == "Pc":
            kept.append(char)
    return "".join(kept).replace(" ", "-")


def strip_code(lines: list[str]) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, with their numbers, inline code removed."""
    out = []
    fenced = False
    for number, line in enumerate(lines, 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, INLINE_CODE.sub("", line)))
    return out


def headings(path: Path) -> list[str]:
    """The headings of a Markdown file, as written (outside code blocks)."""
    found = []
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            found.append(match.group(2))
    return found


def anchors(path: Path) -> set[str]:
    """Every anchor GitHub gives the headings of a Markdown file."""
    seen: dict[str, int] = {}
    result = set()
    for heading in headings(path):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link of a Markdown file."""
    found = []
    for number, line in strip_code(path.read_text(encoding="utf-8").splitlines()):
        definition = REFERENCE_DEFINITION.match(line)
        if definition:
            found.append((number, definition.group(1)))
            continue
        found.extend((number, match.group(1)) for match in INLINE_LINK.finditer(line))
    return found


def check_link(source: Path, target: str, root: Path) -> str | None:
    """Why this link of `source` is broken, or None."""
    if SCHEME.match(target) or target.startswith("//"):
        return None
    path_part, _, anchor = target.partition("#")
    if path_part:
        resolved = (source.parent / path_part).resolve()
        if root not in resolved.parents and resolved != root:
            return f"{path_part} is outside the repository"
        if not resolved.exists():
            return f"no file {path_part}"
    else:
        resolved = source
    if anchor and resolved.is_file() and resolved.suffix == ".md":
        if anchor not in anchors(resolved):
            return f"no heading with anchor #{anchor} in {resolved.relative_to(root)}"
    return None


def documentation(root: Path) -> list[Path]:
    pages = [root / "README.md"] if (root / "README.md").exists() else []
    return pages + sorted((root / "docs").glob("*.md"))


def citing_files(root: Path) -> list[Path]:
    """The repository's files (tracked or new, not ignored) that may cite documentation sections."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=root, capture_output=True, text=True, check=True,
        ).stdout.splitlines()
        files = [root / name for name in listed]
    except (OSError, subprocess.CalledProcessError):
        files = [p for p in root.rglob("*") if not SKIP_DIRS & set(p.relative_to(root).parts)]
    return sorted(
        p for p in files
        if p.is_file() and (p.suffix in CITING_SUFFIXES or p.name in CITING_NAMES)
        and not SKIP_DIRS & set(p.relative_to(root).parts)
    )


def check_citations(path: Path, root: Path) -> list[str]:
    problems = []
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return problems
    for match in CITATION.finditer(text):
        page = root / match.group(1)
        cited = [match.group(2)] + re.findall(r"\"([^\"\n]+)\"", match.group(3))
        line = text.count("\n", 0, match.start()) + 1
        where = f"{path.relative_to(root)}:{line}"
        if not page.is_file():
            problems.append(f"{where}: cites {match.group(1)}, which does not exist")
            continue
        titles = [plain_text(h) for h in headings(page)]
        for heading in cited:
            if not any(title.startswith(heading) for title in titles):
                problems.append(f"{where}: cites {match.group(1)}, \"{heading}\": no heading starts so")
    return problems


def check(root: Path) -> list[str]:
    """Every problem found under `root`, one line each."""
    problems = []
    for page in documentation(root):
        for number, target in links(page):
            why = check_link(page, target, root)
            if why:
                problems.append(f"{page.relative_to(root)}:{number}: broken link ({target}): {why}")
    for path in citing_files(root):
        if path == Path(__file__).resolve():
            continue  # its own examples
        problems.extend(check_citations(path, root))
    return problems


def self_test() -> int:
    """Builds a small repository with good and broken links and checks that exactly the broken ones fail."""
    cases = {
        "GitHub's anchors": [
            (slug("Metrics (Envoy stats, prefix `wasmcustom.` in Envoy)"), "metrics-envoy-stats-prefix-wasmcustom-in-envoy"),
            (slug("`rate_source: \"config\"` across evictions"), "rate_source-config-across-evictions"),
            (slug("9. Peers"), "9-peers"),
            (slug("Operating limiters: **`erl-admin`**"), "operating-limiters-erl-admin"),
            (slug("All-or-nothing rules"), "all-or-nothing-rules"),
        ],
    }
    failures = [f"{name}: {got!r} != {want!r}" for name, pairs in cases.items() for got, want in pairs if got != want]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp).resolve()
        (root / "docs").mkdir()
        (root / "src").mkdir()
        (root / "README.md").write_text(
            "# Title\n\n## Tests\n\n[ok](docs/page.md) [ok](docs/page.md#leases-for-hot-limiters) "
            "[ok](#tests) [ok](https://example.com/x#y) [ok](src/) [ok](docs/page.md#usage-1)\n"
            "[broken file](docs/missing.md)\n"
            "[broken anchor](docs/page.md#no-such-heading)\n"
            "```\n[not a link](nowhere.md)\n```\n`[not a link](nowhere.md)`\n"
            "[ref]: docs/gone.md\n",
            encoding="utf-8",
        )
        (root / "docs" / "page.md").write_text(
            "# Page\n\n## Leases for hot limiters\n\n## Usage\n\n## Usage\n\n[ok](../README.md#title) "
            "[broken self anchor](#usage-2)\n",
            encoding="utf-8",
        )
        (root / "src" / "lib.rs").write_text(
            '// ok (docs/page.md, "Leases")\n// ok (docs/page.md,\n// "Leases for hot limiters", "Usage")\n'
            '// broken (docs/page.md, "Degraded mode")\n// broken (README.md, "Quick start")\n'
            '// broken (docs/gone.md, "Usage")\n',
            encoding="utf-8",
        )
        problems = check(root)
    expected = [
        "README.md:6: broken link (docs/missing.md)",
        "README.md:7: broken link (docs/page.md#no-such-heading)",
        "README.md:12: broken link (docs/gone.md)",
        "docs/page.md:9: broken link (#usage-2)",
        'src/lib.rs:4: cites docs/page.md, "Degraded mode"',
        'src/lib.rs:5: cites README.md, "Quick start"',
        "src/lib.rs:6: cites docs/gone.md, which does not exist",
    ]
    for want in expected:
        if not any(problem.startswith(want) for problem in problems):
            failures.append(f"not caught: {want}")
    for problem in problems:
        if not any(problem.startswith(want) for want in expected):
            failures.append(f"reported wrongly: {problem}")
    for failure in failures:
        print(f"check_links self-test: {failure}", file=sys.stderr)
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--self-test", action="store_true", help="check that the checker catches broken links")
    parser.add_argument("--root", type=Path, default=REPO, help="the repository (default: this script's)")
    args = parser.parse_args()
    if args.self_test:
        return self_test()
    root = args.root.resolve()
    problems = check(root)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print(f"check_links: {len(problems)} broken link(s) or citation(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
