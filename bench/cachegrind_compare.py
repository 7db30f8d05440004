"""Instructions per request of two routers from `bench/cprofile_router.py --cachegrind` runs, by function.

Usage: python bench/cachegrind_compare.py BEFORE_SMALL.cg BEFORE_BIG.cg AFTER_SMALL.cg AFTER_BIG.cg
           [--requests 1000] [--top 30]

Each pair is one tree's runs of N1 and N2 requests; --requests is N2 - N1 (startup, shutdown and
the idle monitor cancel out). Prints each tree's instructions per request, then the functions
(C level: the interpreter, dicts, hashing, the parser) whose share changed most. Needs cg_annotate.
"""

from __future__ import annotations

import argparse
import re
import subprocess

_LINE = re.compile(r"^\s*([\d,]+)\s+(?:\(\s*[\d.]+%\)\s+)?(\S.*)$")


def _by_function(path: str) -> dict[str, int]:
    out = subprocess.run(["cg_annotate", "--auto=no", "--threshold=0", path], capture_output=True, text=True,
                         check=True).stdout
    counts: dict[str, int] = {}
    for line in out.splitlines():
        match = _LINE.match(line)
        if match and ":" in match.group(2):
            # The build directory differs between machines: keep the source path from the project down.
            name = re.sub(r"^.*/Python-[\d.]+/", "", match.group(2))
            counts[name] = counts.get(name, 0) + int(match.group(1).replace(",", ""))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("runs", nargs=4, metavar="CG")
    parser.add_argument("--requests", type=float, default=1000.0)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    before_small, before_big, after_small, after_big = (_by_function(path) for path in args.runs)
    rows = []
    for name in set(before_small) | set(before_big) | set(after_small) | set(after_big):
        before = (before_big.get(name, 0) - before_small.get(name, 0)) / args.requests
        after = (after_big.get(name, 0) - after_small.get(name, 0)) / args.requests
        rows.append((after - before, before, after, name))
    before_total, after_total = sum(row[1] for row in rows), sum(row[2] for row in rows)
    print(f"before: {before_total:,.0f} instructions per request")
    print(f"after:  {after_total:,.0f} instructions per request ({after_total / before_total - 1:+.2%})")
    rows.sort(key=lambda row: -abs(row[0]))
    for change, before, after, name in rows[:args.top]:
        print(f"{change:+9.0f} {before:10.0f} -> {after:10.0f}  {name}")


if __name__ == "__main__":
    main()
