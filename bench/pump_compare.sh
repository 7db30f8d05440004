#!/usr/bin/env bash
# Issue 24's measurement in one go: Narwhal trees (before / after a change) and vllm-router on the same
# mock fleet, alternating, then a py-spy profile and `strace -c` syscall counts per router.
#
# Usage: bench/pump_compare.sh RESULTS_DIR LABEL=REF [LABEL=REF ...]
#   REF is a directory (measured as it is) or a git commit-ish of this repository, frozen for the run in a
#   detached `git worktree` under $TREES_DIR (default /tmp), removed at the end unless KEEP_TREES=1.
#   The first tree is "before", the last "after": the target table compares the last one to vllm-router.
# Environment:
#   PYTHON        the interpreter with Narwhal's dependencies (default: .venv/bin/python if present, else python3)
#   ROUTERS_VENV  venv holding vllm-router (default /tmp/rustrouters; see docs/benchmarks.md)
#   REPS          repetitions of the CPU/latency cases (default 3); every router runs once per repetition,
#                 the order rotated from one repetition to the next
#   CASES         subset of: paced-c64 paced-c8 unpaced-c64 unpaced-c8 unpaced-open (default all but unpaced-open)
#   PACED_S       duration of each paced run (default 20); UNPACED_N requests of each unpaced run (default 10000)
#   RATE, OPEN_S  unpaced-open: an open loop (`bench --rate`) of RATE requests/s (default 1500) for OPEN_S seconds
#                 (default 10), the latencies at one offered load rather than at each router's saturation
#   PROFILE       1 (default): per tree, a paced-c64 run (PROFILE_S seconds, default 10) and an unpaced-c64 run
#                 under py-spy
#   STRACE        1 (default): per router under `strace -f -c`, paced-c64 runs of STRACE_N1 and STRACE_N2
#                 requests (default 64 and 192; the difference: syscalls per 1,000 tokens) and unpaced-c64 runs
#                 of STRACE_REQ_N1 and STRACE_REQ_N2 (1000 and 3000; the difference: syscalls per request)
#   SET_<LABEL>   space-separated SECTION.KEY=VALUE config values for that tree's router (label's - as _)
#
# Every run is one `python -m narwhal bench` (from the tree's directory, so bench, mocks and router are the
# tree's; vllm-router runs from the first tree) writing RESULTS_DIR/CASE__ROUTER__REP.json.
# `python bench/pump_summary.py RESULTS_DIR` prints the tables (also at the end of this script).
set -euo pipefail
cd "$(dirname "$0")/.."
HERE=$(pwd)

if [ $# -lt 2 ]; then sed -n '2,25p' "$0" >&2; exit 2; fi
OUT=$1; shift
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=$HERE/.venv/bin/python; else PYTHON=python3; fi
fi
VENV=${ROUTERS_VENV:-/tmp/rustrouters}
REPS=${REPS:-3}
CASES=${CASES:-"paced-c64 paced-c8 unpaced-c64 unpaced-c8"}
PACED_S=${PACED_S:-20}
RATE=${RATE:-1500}
OPEN_S=${OPEN_S:-10}
UNPACED_N=${UNPACED_N:-10000}
PROFILE=${PROFILE:-1}
PROFILE_S=${PROFILE_S:-10}
STRACE=${STRACE:-1}
STRACE_N1=${STRACE_N1:-64}
STRACE_N2=${STRACE_N2:-192}
STRACE_REQ_N1=${STRACE_REQ_N1:-1000}
STRACE_REQ_N2=${STRACE_REQ_N2:-3000}
TREES_DIR=${TREES_DIR:-/tmp}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

# Freeze every tree: a directory is used as it is; a commit gets its own detached worktree.
declare -A TREE=()
LABELS=()
FROZEN=()
cleanup() {
  if [ "${KEEP_TREES:-0}" != 1 ]; then
    for dir in "${FROZEN[@]}"; do git worktree remove --force "$dir" >/dev/null 2>&1 || true; done
  fi
}
trap cleanup EXIT
: > "$OUT/trees.txt"
for pair in "$@"; do
  label=${pair%%=*}; ref=${pair#*=}
  if [ -d "$ref" ]; then
    dir=$(cd "$ref" && pwd)
    desc="$dir (directory, at $(git -C "$dir" rev-parse --short HEAD 2>/dev/null || echo '?'))"
    if [ -n "$(git -C "$dir" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
      desc="$desc, with uncommitted changes"
    fi
  else
    sha=$(git rev-parse --verify "$ref^{commit}")
    dir=$TREES_DIR/narwhal-tree-${sha:0:12}
    if [ ! -d "$dir" ]; then
      git worktree add --detach "$dir" "$sha" >/dev/null
      FROZEN+=("$dir")
    fi
    desc="commit ${sha:0:12} ($ref), frozen in $dir"
  fi
  TREE[$label]=$dir
  LABELS+=("$label")
  echo "$label: $desc" | tee -a "$OUT/trees.txt" >&2
done
BASE=${TREE[${LABELS[0]}]}
ROUTERS=("${LABELS[@]}" vllm-router)

VLLM_ROUTER="$VENV/bin/vllm-router --vllm-pd-disaggregation {prefill_flags} {decode_flags} \
--host 127.0.0.1 --port {port} --prometheus-port {metrics_port} --policy round_robin"
# Every case: 1 prefill + 1 decode mock writing each SSE event separately (as vLLM does), counting off.
COMMON="--count-tokens off --mock-writes per-event --quiet"
case_args() {
  case "$1" in
    paced-c64) echo "--concurrency 64 --tokens 256 --token-delay-s 0.01 --duration-s $PACED_S" ;;
    paced-c8) echo "--concurrency 8 --tokens 256 --token-delay-s 0.01 --duration-s $PACED_S" ;;
    unpaced-c64) echo "--concurrency 64 --requests $UNPACED_N" ;;
    unpaced-c8) echo "--concurrency 8 --requests $UNPACED_N" ;;
    unpaced-open) echo "--rate $RATE --duration-s $OPEN_S" ;;
    *) echo "unknown case $1" >&2; exit 2 ;;
  esac
}

# run ROUTER NAME STRACE_OUT ARGS...: one bench run, its report in $OUT/NAME.json and .txt; with STRACE_OUT,
# the router runs under `strace -f -c -o STRACE_OUT`.
run() {
  local router=$1 name=$2 strace_out=$3; shift 3
  local dir=${TREE[$router]:-$BASE} set_var="SET_${router//-/_}" cmd item
  cmd=("$PYTHON" -m narwhal bench "$@" $COMMON --label "$router" --json "$OUT/$name.json")
  if [ "$router" = vllm-router ]; then
    cmd+=(--router-cmd "${strace_out:+strace -f -c -o $strace_out }$VLLM_ROUTER")
  elif [ -n "$strace_out" ]; then
    cmd+=(--router-cmd "$PYTHON $HERE/bench/strace_router.py {port} {prefill[0]} {decode[0]} $strace_out ${!set_var:-}")
  else
    for item in ${!set_var:-}; do cmd+=(--set "$item"); done
  fi
  echo "== $(date -u +%H:%M:%S) $name: (cd $dir && ${cmd[*]})" >&2
  if ! (cd "$dir" && "${cmd[@]}") > "$OUT/$name.txt" 2>&1; then
    echo "   failed; see $OUT/$name.txt" >&2
  fi
}

n=${#ROUTERS[@]}
for rep in $(seq 1 "$REPS"); do
  for case_name in $CASES; do
    # shellcheck disable=SC2046
    set -- $(case_args "$case_name")
    for i in $(seq 0 $((n - 1))); do
      router=${ROUTERS[$(( (i + rep - 1) % n ))]}
      run "$router" "${case_name}__${router}__${rep}" "" "$@"
    done
  done
done

if [ "$PROFILE" = 1 ]; then
  for label in "${LABELS[@]}"; do
    # paced-c64 for ~PROFILE_S seconds, unpaced-c64 for UNPACED_N requests.
    # shellcheck disable=SC2046
    run "$label" "profile__$label" "" $(case_args paced-c64 | sed "s/--duration-s [0-9.]*/--duration-s $PROFILE_S/") \
      --profile-router "$OUT/profile__$label.collapsed.txt"
    # shellcheck disable=SC2046
    run "$label" "profile-unpaced__$label" "" $(case_args unpaced-c64) \
      --profile-router "$OUT/profile-unpaced__$label.collapsed.txt"
  done
fi

if [ "$STRACE" = 1 ]; then
  command -v strace >/dev/null || { echo "strace not found; no syscall counts" >&2; STRACE=0; }
fi
if [ "$STRACE" = 1 ]; then
  for router in "${ROUTERS[@]}"; do
    for count in "$STRACE_N1" "$STRACE_N2"; do
      name="strace__${router}__$count"
      # shellcheck disable=SC2046
      run "$router" "$name" "$OUT/$name.strace" \
        $(case_args paced-c64 | sed "s/--duration-s [0-9.]*/--requests $count/") --warmup 0
    done
    for count in "$STRACE_REQ_N1" "$STRACE_REQ_N2"; do
      name="strace-unpaced__${router}__$count"
      # shellcheck disable=SC2046
      run "$router" "$name" "$OUT/$name.strace" \
        $(case_args unpaced-c64 | sed "s/--requests [0-9]*/--requests $count/") --warmup 0
    done
  done
fi

"$PYTHON" bench/pump_summary.py "$OUT" | tee "$OUT/summary.md"
