#!/bin/bash
# One `narwhal bench` pass with the router alone on CPU 0 and the load generator and the mocks on CPU 1.
#
#   bench/pinned.sh [BENCH ARGS ...]      e.g. bench/pinned.sh --tracing-ratio 1.0 --concurrency 64 --requests 20000
#
# On a 2-core machine a router sharing its core with the load generator and the mocks pays for their cache
# misses and context switches in its own CPU per request; pinned, passes of the same tree agree to about 3%
# (unpinned, 10%). Runs from the current directory's tree (`python -m narwhal` of this checkout's .venv).
# The router is found by its command line once the bench has started it, and moved (all its threads) to CPU 0.
#
# Environment:
#   ROUTER_MATCH="vllm-router"   how to find the router among the bench's children (default "narwhal serve"),
#                                for a router started with --router-cmd
#   WINDOW="5 6"                 also print the router process's user and system CPU over a window of the load:
#                                read from /proc/PID/stat 5 s after the router is found and 6 s later (the
#                                process's own threads, not its children), with the bench's --json tokens/s the
#                                figure per 1,000 tokens; give --duration-s longer than the window's end
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=$HERE/.venv/bin/python
MATCH=${ROUTER_MATCH:-narwhal serve}
taskset -c 1 "$PY" -m narwhal bench "$@" &
BENCH=$!
ROUTER=""
for _ in $(seq 1 100); do
    ROUTER=$(pgrep -P "$BENCH" -f "$MATCH" | head -1 || true)
    [ -n "$ROUTER" ] && break
    sleep 0.1
done
if [ -z "$ROUTER" ]; then
    echo "pinned.sh: no router seen" >&2
    wait "$BENCH"
    exit
fi
taskset -a -p -c 0 "$ROUTER" >/dev/null
if [ -n "${WINDOW:-}" ]; then
    read -r START SECONDS_ <<< "$WINDOW"
    TICK=$(getconf CLK_TCK)
    # Fields 14 and 15 of /proc/PID/stat, counted after the command's closing parenthesis (a name may hold spaces).
    ticks() { sed 's/.*) //' "/proc/$ROUTER/stat" | awk '{print $12, $13}'; }
    sleep "$START"
    read -r U1 S1 < <(ticks)
    sleep "$SECONDS_"
    read -r U2 S2 < <(ticks)
fi
wait "$BENCH"
if [ -n "${WINDOW:-}" ]; then
    "$PY" - "$U1" "$S1" "$U2" "$S2" "$TICK" "$SECONDS_" "$@" <<'PYTHON'
import json
import sys

u1, s1, u2, s2, tick = (int(value) for value in sys.argv[1:6])
seconds = float(sys.argv[6])
bench = sys.argv[7:]
user, system = (u2 - u1) / tick, (s2 - s1) / tick
line = f"router over {seconds:g} s of the load: user {user:.2f} s, system {system:.2f} s"
if "--json" in bench:
    with open(bench[bench.index("--json") + 1]) as f:
        tokens_per_s = json.load(f)["run"]["load"]["tokens_per_s"]
    if tokens_per_s:
        line += f", {(user + system) * 1e6 / (tokens_per_s * seconds):.1f} ms per 1,000 tokens at {tokens_per_s:,.0f} tokens/s"
print(line)
PYTHON
fi
