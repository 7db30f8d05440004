#!/bin/bash
# One `narwhal bench` pass with the router alone on CPU 0 and the load generator and the mocks on CPU 1.
#
#   bench/pinned.sh [BENCH ARGS ...]      e.g. bench/pinned.sh --tracing-ratio 1.0 --concurrency 64 --requests 20000
#
# On a 2-core machine a router sharing its core with the load generator and the mocks pays for their cache
# misses and context switches in its own CPU per request; pinned, passes of the same tree agree to about 3%
# (unpinned, 10%). Runs from the current directory's tree (`python -m narwhal` of this checkout's .venv).
# The router is found by its command line once the bench has started it, and moved (all its threads) to CPU 0.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=$HERE/.venv/bin/python
taskset -c 1 "$PY" -m narwhal bench "$@" &
BENCH=$!
ROUTER=""
for _ in $(seq 1 100); do
    ROUTER=$(pgrep -P "$BENCH" -f "narwhal serve" | head -1 || true)
    [ -n "$ROUTER" ] && break
    sleep 0.1
done
if [ -n "$ROUTER" ]; then taskset -a -p -c 0 "$ROUTER" >/dev/null; else echo "pinned.sh: no router seen" >&2; fi
wait "$BENCH"
