#!/bin/bash
# An idle router's Python calls (cProfile) or user-space instructions (cachegrind) over SECONDS.
#
#   bench/idle_prof.sh TREE OUT SECONDS [--cachegrind]
#
# Starts one mock process with a prefill and a decode engine and TREE's router in front of them through
# `bench/cprofile_router.py` (its config: defaults, token counting on), leaves it idle for SECONDS after it
# is up, and stops it with SIGTERM, which writes OUT (a cProfile file, or with --cachegrind a cachegrind
# file). Start-up and shutdown are in the counts: run 15 and 45 s and divide the difference by 30
# (`bench/cprofile_compare.py B15 B45 A15 A45 --requests 30`, `bench/cachegrind_compare.py` likewise):
# one monitor pass a second at the defaults, so the figures are per pass.
set -euo pipefail
TREE=$(cd "$1" && pwd); OUT=$(realpath -m "$2"); SECS=$3; MODE=${4:-}
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=$HERE/.venv/bin/python
WORK=$(mktemp -d /tmp/narwhal-idle-prof.XXXXXX)
(cd "$HERE" && exec "$PY" -m narwhal mock-engine --engines 2 --prefill-engines 1 \
    --engines-file "$WORK/fleet.json" > "$WORK/engines.log" 2>&1) &
ENGINES=$!
trap 'kill $ENGINES ${ROUTER:-} 2>/dev/null || true' EXIT
for _ in $(seq 1 150); do grep -q mock_fleet_ready "$WORK/engines.log" 2>/dev/null && break; sleep 0.2; done
read -r PREFILL DECODE < <("$PY" -c "import json, sys; e = json.load(open(sys.argv[1]))['engines']; \
print(*[x['url'] for x in sorted(e, key=lambda x: x['role'] != 'prefill')])" "$WORK/fleet.json")
PORT=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
# shellcheck disable=SC2086  # MODE is one flag or nothing
(cd "$HERE" && exec "$PY" bench/cprofile_router.py $MODE "$TREE" "$PORT" "$PREFILL" "$DECODE" "$OUT" \
    serving.count_tokens=true) &
ROUTER=$!
for _ in $(seq 1 600); do
    curl -s -o /dev/null "http://127.0.0.1:$PORT/health" && break
    sleep 0.2
done
sleep "$SECS"
kill -TERM "$ROUTER"
wait "$ROUTER" || true
ROUTER=""
echo "written: $OUT"
