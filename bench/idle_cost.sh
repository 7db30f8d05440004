#!/bin/bash
# Idle cost and the monitor pass of one Narwhal tree in front of N mock engines (one mock process).
#
#   bench/idle_cost.sh TREE N [SECONDS]
#
# TREE is a source tree (a checkout, or `git archive COMMIT | tar -x -C DIR`); it runs as
# `python -m narwhal serve` from TREE with this checkout's .venv, with the config `narwhal bench`
# gives a router ([serving] count_tokens, shutdown_grace_s, [fleet] attestation_key, [handoff] path).
# The engines come from this checkout's mock (`mock-engine --engines N`): 2 prefill + 2 decode at
# N=4, else N/4 prefill. After 10 s it prints the router's CPU (utime+stime from /proc) over SECONDS
# of idle, then samples narwhal_monitor_last_pass_seconds once a second for SECONDS (one /metrics
# scrape per second: its own CPU is printed apart) and prints the median pass and the handoff size.
set -euo pipefail
TREE=$(cd "$1" && pwd); N=$2; SECS=${3:-30}
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=$HERE/.venv/bin/python
OUT=$(mktemp -d /tmp/narwhal-idle.XXXXXX)
PREFILL=$(( N <= 4 ? N / 2 : N / 4 ))
(cd "$HERE" && exec "$PY" -m narwhal mock-engine --engines "$N" --prefill-engines "$PREFILL" \
    --engines-file "$OUT/fleet.json" > "$OUT/engines.log" 2>&1) &
ENGINES=$!
trap 'kill $ENGINES ${ROUTER:-} 2>/dev/null || true' EXIT
for _ in $(seq 1 150); do grep -q mock_fleet_ready "$OUT/engines.log" 2>/dev/null && break; sleep 0.2; done
"$PY" - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
lines = ["[serving]", "count_tokens = true", "shutdown_grace_s = 2.0", "", "[fleet]",
         'attestation_key = "narwhal-dev-key"', "", "[handoff]", f'path = "{out}/handoff.json"', ""]
for i, engine in enumerate(json.load(open(f"{out}/fleet.json"))["engines"]):
    lines += ["[[engines]]", f'name = "{engine["role"][0]}{i}"', f'url = "{engine["url"]}"',
              f'role = "{engine["role"]}"', ""]
open(f"{out}/narwhal.toml", "w").write("\n".join(lines))
PY
(cd "$TREE" && exec "$PY" -m narwhal serve --config "$OUT/narwhal.toml" --listen 127.0.0.1:0 \
    > /dev/null 2> "$OUT/router.log") &
ROUTER=$!
for _ in $(seq 1 150); do grep -q router_started "$OUT/router.log" 2>/dev/null && break; sleep 0.2; done
LISTEN=$(grep -o '"listen":"[^"]*"' "$OUT/router.log" | head -1 | cut -d'"' -f4)
sleep 10
ticks() { awk '{print $14 + $15}' "/proc/$ROUTER/stat"; }
HZ=$(getconf CLK_TCK)
a=$(ticks); sleep "$SECS"; b=$(ticks)
awk -v n="$N" -v d=$((b - a)) -v hz="$HZ" -v s="$SECS" 'BEGIN {printf "engines %s: router CPU idle %.1f ms per s\n", n, d * 1000 / hz / s}'
a=$(ticks)
for _ in $(seq 1 "$SECS"); do
    curl -s "http://$LISTEN/metrics" | awk '/^narwhal_monitor_last_pass_seconds /{print $2}' >> "$OUT/pass.txt"
    sleep 1
done
b=$(ticks)
sort -g "$OUT/pass.txt" | awk -v n="$N" '{v[NR]=$1} END {printf "engines %s: monitor pass median %.3f s (min %.3f, max %.3f, %d samples)\n", n, v[int((NR+1)/2)], v[1], v[NR], NR}'
awk -v n="$N" -v d=$((b - a)) -v hz="$HZ" -v s="$SECS" 'BEGIN {printf "engines %s: router CPU with one /metrics scrape per s %.1f ms per s\n", n, d * 1000 / hz / s}'
echo "engines $N: handoff $(stat -c %s "$OUT/handoff.json") bytes"
