#!/usr/bin/env python3
"""Writes src/calendar_zones.tsv: the IANA zones a rule's `calendar.time_zone` may name, by the POSIX TZ rule
their tzdata file ends with (the footer, RFC 8536 section 3.3): one line a rule, `rule<TAB>` then its zones
grouped by area, `Area/City,City;Area/City` (`/UTC` for a name without an area), to keep the module small.

    python3 scripts/zones.py [/usr/share/zoneinfo]

The zones are the canonical ones of tzdata's zone1970.tab, and UTC. Left out: a zone whose file has no
footer, and a zone whose future the footer does not give (its file lists transitions after it: Morocco's,
whose daylight saving time follows Ramadan). tests/calendar_zoneinfo.rs checks every zone written against
Python's zoneinfo.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

# Zones whose files list transitions for decades ahead that their footer does not describe.
NOT_BY_RULE = {"Africa/Casablanca", "Africa/El_Aaiun"}


def footer(data: bytes) -> str | None:
    """The POSIX TZ rule at the end of a TZif version 2+ file, if any."""
    if data[:4] != b"TZif" or data[4:5] == b"\0":
        return None
    text = data.rstrip(b"\n").rsplit(b"\n", 1)[-1].decode()
    return text or None


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/usr/share/zoneinfo")
    names = ["UTC"]
    for line in (root / "zone1970.tab").read_text().splitlines():
        if line and not line.startswith("#"):
            names.append(line.split("\t")[2])
    by_rule: dict[str, dict[str, list[str]]] = {}
    for name in sorted(set(names)):
        rule = footer((root / name).read_bytes())
        if rule and name not in NOT_BY_RULE:
            area, _, city = name.rpartition("/")
            by_rule.setdefault(rule, {}).setdefault(area, []).append(city)
    # One line a rule: `rule<TAB>Area/City,City;Area/City` (a name without an area: `/UTC`).
    lines = [rule + "\t" + ";".join(f"{area}/{','.join(cities)}" for area, cities in areas.items())
             for rule, areas in sorted(by_rule.items())]
    out = Path(__file__).resolve().parent.parent / "src" / "calendar_zones.tsv"
    out.write_text("\n".join(lines) + "\n")
    print(f"{out}: {sum(len(c) for a in by_rule.values() for c in a.values())} zones, {len(lines)} rules",
          file=sys.stderr)


if __name__ == "__main__":
    main()
