"""Python calls per request of two routers from `bench/cprofile_router.py` profiles, and where they differ.

Usage: python bench/cprofile_compare.py BEFORE_SMALL.prof BEFORE_BIG.prof AFTER_SMALL.prof AFTER_BIG.prof
           [--requests 2000] [--top 40]

Each pair is one tree's runs of N1 and N2 requests; --requests is N2 - N1. Prints, per tree,
all calls, Narwhal's own calls and trio cancel scopes per request, then the functions whose
calls per request changed most (paths are made relative, so trees in different places compare).
"""

from __future__ import annotations

import argparse
import pstats


def _key(filename: str, name: str) -> str:
    for marker in ("/site-packages/", "/narwhal/"):
        if marker in filename:
            rest = filename.split(marker, 1)[1]
            return f"{'narwhal/' if marker == '/narwhal/' else ''}{rest}:{name}"
    return f"{filename}:{name}"


def _calls(path: str) -> dict[str, int]:
    calls: dict[str, int] = {}
    for (filename, _, name), (_, ncalls, *_rest) in pstats.Stats(path).stats.items():  # type: ignore[attr-defined]
        key = _key(filename, name)
        calls[key] = calls.get(key, 0) + ncalls
    return calls


def per_request(small: str, big: str, requests: int) -> dict[str, float]:
    """Calls per request of every function: (calls in ``big`` - calls in ``small``) / ``requests``."""
    a, b = _calls(small), _calls(big)
    return {key: (b.get(key, 0) - a.get(key, 0)) / requests for key in a.keys() | b.keys()}


def summary(calls: dict[str, float]) -> str:
    everything = sum(calls.values())
    own = sum(v for k, v in calls.items() if k.startswith("narwhal/"))
    scopes = sum(v for k, v in calls.items() if k.endswith("CancelScope>:__init__"))
    return f"{everything:8.1f} calls, {own:6.1f} in Narwhal's functions, {scopes:5.2f} cancel scopes per request"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profiles", nargs=4)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    before = per_request(args.profiles[0], args.profiles[1], args.requests)
    after = per_request(args.profiles[2], args.profiles[3], args.requests)
    print(f"before: {summary(before)}")
    print(f"after:  {summary(after)}")
    rows = sorted(((after.get(k, 0.0) - before.get(k, 0.0), k) for k in before.keys() | after.keys()),
                  key=lambda row: -abs(row[0]))
    for delta, key in rows[:args.top]:
        if abs(delta) >= 0.05:
            print(f"{delta:+8.2f}  {before.get(key, 0.0):8.2f} -> {after.get(key, 0.0):8.2f}  {key}")


if __name__ == "__main__":
    main()
