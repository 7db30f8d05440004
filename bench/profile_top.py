"""Top costs of a py-spy profile in collapsed-stack form (``--profile-router FILE.txt``).

Usage: python bench/profile_top.py PROFILE.txt [--top N] [--under FUNCTION]

Prints the functions with the most samples of their own (self) and the most
samples including what they call (inclusive), as percentages of all samples.
``--under`` restricts the count to stacks passing through a frame whose name
contains FUNCTION (e.g. ``RequestCore.handle``), to see one path's breakdown.
"""

from __future__ import annotations

import argparse
import re
import signal
from collections import Counter

_LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")
# "name (file.py:123)" -> "name (file.py)": one entry per function, not per line.
_FRAME_LINE = re.compile(r":\d+\)$")


def _frame(raw: str) -> str:
    return _FRAME_LINE.sub(")", raw.strip())


def top_costs(lines: list[str], under: str | None = None) -> tuple[int, Counter[str], Counter[str]]:
    """(total samples, self samples per function, inclusive samples per function)."""
    total = 0
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for line in lines:
        match = _LINE.match(line.strip())
        if not match:
            continue
        frames = [_frame(f) for f in match["stack"].split(";")]
        if under is not None and not any(under in f for f in frames):
            continue
        count = int(match["count"])
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    return total, own, inclusive


def main() -> None:
    # Piped into head: stop quietly when it has read enough.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--under", help="count only stacks through a frame containing this text")
    args = parser.parse_args()
    with open(args.profile) as f:
        total, own, inclusive = top_costs(f.readlines(), args.under)
    if not total:
        print("no samples")
        return
    print(f"{total} samples" + (f" through {args.under!r}" if args.under else ""))
    print("\nself %   function")
    for name, count in own.most_common(args.top):
        print(f"{100 * count / total:6.1f}   {name}")
    print("\ninclusive %   function")
    for name, count in inclusive.most_common(args.top):
        print(f"{100 * count / total:6.1f}       {name}")


if __name__ == "__main__":
    main()
