#!/usr/bin/env bash
# Narwhal, vllm-router and sglang-router side by side on the same mock fleet, alternating.
#
# Usage: bench/compare.sh [RESULTS_DIR]      (default bench/results)
#   ROUTERS_VENV  venv holding vllm-router and sglang-router (default /tmp/rustrouters); make it with
#                 python3 -m venv /tmp/rustrouters && /tmp/rustrouters/bin/pip install vllm-router sglang-router
#   PYTHON        the interpreter with Narwhal installed (default python3)
#   REPS          repetitions of each case (default 3); each case runs every router once per repetition
#   CASES         space-separated subset of the cases below (default: all but the *-events/*-batched ones)
#   ROUTERS       space-separated subset of: narwhal vllm-router sglang-router (default all)
#   NARWHAL_TREES space-separated LABEL=DIR pairs: also run Narwhal from another checkout (e.g. one with a
#                 proposed hot-path change) as router LABEL, alternating with the others
#
# Every run is one `python -m narwhal bench ... --json RESULTS_DIR/CASE__ROUTER__REP.json`;
# `python bench/summarize.py RESULTS_DIR` prints the markdown tables of docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-bench/results}
VENV=${ROUTERS_VENV:-/tmp/rustrouters}
PYTHON=${PYTHON:-python3}
REPS=${REPS:-3}
CASES=${CASES:-"c8-keepalive c64-keepalive c8-new c64-new c64-keepalive-count-on paced faults"}
ROUTERS=${ROUTERS:-"narwhal vllm-router sglang-router"}
NARWHAL_TREES=${NARWHAL_TREES:-}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
declare -A TREES=()
for pair in $NARWHAL_TREES; do
  TREES[${pair%%=*}]=$(cd "${pair#*=}" && pwd)
  ROUTERS="$ROUTERS ${pair%%=*}"
done

VLLM_ROUTER="$VENV/bin/vllm-router --vllm-pd-disaggregation {prefill_flags} {decode_flags} \
--host 127.0.0.1 --port {port} --prometheus-port {metrics_port} --policy round_robin"
SGLANG_ROUTER="$VENV/bin/sglang-router launch --pd-disaggregation {prefill_flags_bootstrap} {decode_flags} \
--host 127.0.0.1 --port {port} --prometheus-port {metrics_port} --policy round_robin"

# The load of each case; token counting is off unless the case says otherwise (the Rust routers do not count).
case_args() {
  case "$1" in
    c8-keepalive) echo "--concurrency 8 --requests 10000 --count-tokens off" ;;
    c64-keepalive) echo "--concurrency 64 --requests 10000 --count-tokens off" ;;
    c8-new) echo "--concurrency 8 --requests 5000 --new-connections --count-tokens off" ;;
    c64-new) echo "--concurrency 64 --requests 5000 --new-connections --count-tokens off" ;;
    c64-keepalive-count-on) echo "--concurrency 64 --requests 10000 --count-tokens on" ;;
    paced) echo "--concurrency 64 --tokens 256 --token-delay-s 0.01 --duration-s 20 --count-tokens off" ;;
    faults) echo "--scenario faults --count-tokens off" ;;
    # The same loads against a decode mock that writes each SSE event separately, as vLLM does (issue 15).
    c64-ka-events) echo "--concurrency 64 --requests 6000 --count-tokens off --mock-writes per-event" ;;
    c64-ka-batched) echo "--concurrency 64 --requests 6000 --count-tokens off --mock-writes batched" ;;
    c8-ka-events) echo "--concurrency 8 --requests 4000 --count-tokens off --mock-writes per-event" ;;
    paced-events) echo "--concurrency 64 --tokens 256 --token-delay-s 0.01 --duration-s 10 --count-tokens off --mock-writes per-event" ;;
    c64-new-events) echo "--concurrency 64 --requests 3000 --new-connections --count-tokens off --mock-writes per-event" ;;
    *) echo "unknown case $1" >&2; exit 2 ;;
  esac
}

for rep in $(seq 1 "$REPS"); do
  for case_name in $CASES; do
    for router in $ROUTERS; do
      # Token counting is a Narwhal feature: the other routers run the count-on case only as its baseline.
      if [ "$case_name" = "c64-keepalive-count-on" ] && [ "$router" != "narwhal" ] \
          && [ -z "${TREES[$router]:-}" ]; then continue; fi
      out="$OUT/${case_name}__${router}__${rep}.json"
      # shellcheck disable=SC2046
      set -- $(case_args "$case_name")
      case "$router" in
        narwhal) cmd=("$PYTHON" -m narwhal bench "$@") ;;
        vllm-router) cmd=("$PYTHON" -m narwhal bench "$@" --router-cmd "$VLLM_ROUTER") ;;
        sglang-router) cmd=("$PYTHON" -m narwhal bench "$@" --router-cmd "$SGLANG_ROUTER") ;;
        *) if [ -z "${TREES[$router]:-}" ]; then echo "unknown router $router" >&2; exit 2; fi
           cmd=("$PYTHON" -m narwhal bench "$@") ;;
      esac
      echo "== $case_name $router rep $rep: ${cmd[*]}" >&2
      # A Narwhal tree runs from its own directory, so `-m narwhal` (bench, router and mocks) is that tree's.
      if ! (cd "${TREES[$router]:-.}" && "${cmd[@]}" --quiet --label "$router" --json "$out") \
          > "$OUT/${case_name}__${router}__${rep}.txt" 2>&1; then
        echo "   failed; see $OUT/${case_name}__${router}__${rep}.txt" >&2
      fi
    done
  done
done
"$PYTHON" bench/summarize.py "$OUT"
