"""bench/pump_summary.py: the tables of issue 24's measurement, from a results directory made up here;
bench/relay_cost.py's counted workload and bench/trace_work.py's traced request, run small."""

from __future__ import annotations

import importlib.util
import json
import os
import pstats
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from narwhal.config import TracingConfig
from narwhal.tracing.tracer import Tracer

_REPO = Path(__file__).resolve().parent.parent

# The shape `strace -c` prints: the errors column is empty for syscalls that never failed.
_STRACE = """\
% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 40.00    0.004000           2      {read}           read
 35.00    0.003500           2      {write}         {write_errors} write
 25.00    0.002500          10       300           epoll_wait
------ ----------- ----------- --------- --------- ----------------
100.00    0.010000                  2000        3 total
"""


def _report(*, tokens: int, ttft_ms: float, cpu_req: float, cpu_1k: float, errors: int = 0) -> dict[str, object]:
    return {"run": {"load": {"tokens": tokens, "errors": errors, "requests_per_s": 10.0, "tokens_per_s": 100.0,
                             "ttft": {"p50_ms": ttft_ms, "p99_ms": 2 * ttft_ms}},
                    "router": {"cpu_ms_per_request": cpu_req, "cpu_ms_per_1k_tokens": cpu_1k,
                               "cpu_utilization": 0.5}}}


def _write(directory: Path, name: str, report: dict[str, object]) -> None:
    (directory / f"{name}.json").write_text(json.dumps(report))


def _summary(directory: Path) -> str:
    result = subprocess.run([sys.executable, "bench/pump_summary.py", str(directory)], cwd=_REPO,
                            capture_output=True, text=True, timeout=60, check=True)
    return result.stdout


def test_targets_compare_the_last_tree_to_vllm_router_per_median_and_per_repetition(tmp_path: Path) -> None:
    (tmp_path / "trees.txt").write_text("old: commit aaa\nnew: commit bbb\n")
    # vllm-router: 20 ms per 1,000 tokens; old 30 (1.5x); new 22, 24, 26 over the repetitions (median 24: 1.2x).
    for rep, new_cpu in enumerate((22.0, 24.0, 26.0), start=1):
        _write(tmp_path, f"paced-c64__vllm-router__{rep}", _report(tokens=1000, ttft_ms=10, cpu_req=5, cpu_1k=20))
        _write(tmp_path, f"paced-c64__old__{rep}", _report(tokens=1000, ttft_ms=15, cpu_req=8, cpu_1k=30))
        _write(tmp_path, f"paced-c64__new__{rep}", _report(tokens=1000, ttft_ms=9, cpu_req=6, cpu_1k=new_cpu))
    out = _summary(tmp_path)
    cpu_row = next(line for line in out.splitlines() if line.startswith("| CPU ms per 1,000 tokens, paced c64"))
    cells = [c.strip() for c in cpu_row.strip("|").split("|")]
    # target, old, new, vllm, old/vllm, new/vllm, new/old, per repetition, goal, met
    assert cells[1:4] == ["30.0", "24.0", "20.0"]
    assert cells[4:7] == ["1.50x", "1.20x", "0.80x"]
    assert cells[7] == "1.10x, 1.20x, 1.30x"
    assert cells[9] == "**yes**"
    ttft_row = next(line for line in out.splitlines() if line.startswith("| TTFT p50 ms, paced c64"))
    assert ttft_row.rstrip().endswith("| <= 1.0x | **yes** |")
    # A case that was not run shows no figures and no verdict, not a pass.
    missing = next(line for line in out.splitlines() if line.startswith("| TTFT p50 ms, unpaced c8"))
    assert missing.rstrip().endswith("| <= 1.0x | - |")


def test_the_open_loop_case_compares_latencies_at_one_offered_rate(tmp_path: Path) -> None:
    (tmp_path / "trees.txt").write_text("new: commit bbb\n")
    for router, ttft_ms in (("new", 2.0), ("vllm-router", 2.5)):
        report = _report(tokens=1000, ttft_ms=ttft_ms, cpu_req=1, cpu_1k=1)
        report["run"]["load"]["offered_rate"] = 1500.0  # type: ignore[index]
        _write(tmp_path, f"unpaced-open__{router}__1", report)
    out = _summary(tmp_path)
    p50 = next(line for line in out.splitlines() if line.startswith("| TTFT p50 ms, unpaced open loop"))
    assert [c.strip() for c in p50.strip("|").split("|")][1:4] == ["2.00", "2.50", "0.80x"]
    assert p50.rstrip().endswith("| <= 1.0x | **yes** |")
    table = out.split("#### unpaced-open", 1)[1]
    assert "| offered req/s |" in table and "| new | 1 | 1,500 |" in table


def test_syscalls_per_1k_tokens_are_the_difference_of_two_runs(tmp_path: Path) -> None:
    (tmp_path / "trees.txt").write_text("new: commit bbb\n")
    runs = {  # router: ((requests, tokens, read, write, write errors) for the small and the large run)
        "new": ((64, 16_384, 20_000, 19_000, ""), (192, 49_152, 53_000, 52_000, "1000")),
        "vllm-router": ((64, 16_384, 30_000, 30_000, ""), (192, 49_152, 63_000, 63_000, "")),
    }
    for router, pair in runs.items():
        for requests, tokens, read, write, write_errors in pair:
            name = f"strace__{router}__{requests}"
            _write(tmp_path, name, _report(tokens=tokens, ttft_ms=1, cpu_req=1, cpu_1k=1))
            (tmp_path / f"{name}.strace").write_text(
                _STRACE.format(read=read, write=write, write_errors=write_errors or "    "))
    out = _summary(tmp_path)
    lines = out.splitlines()
    # 32,768 tokens between the runs: new read 33,000 more (1,007 per 1,000), vllm-router 33,000 too.
    assert "| read | 1,007 | 1,007 |" in lines
    # Failed calls (EAGAIN reads, say) are shown per 1,000 tokens beside the calls: 1,000 / 32.768 = 31.
    assert "| write | 1,007 (31 failed) | 1,007 |" in lines
    # epoll_wait is the same in both runs of each router: it costs nothing per token.
    assert "| all | **2,014** | **2,014** |" in lines
    assert "new: 32,768 tokens between the runs" in out


def test_syscalls_per_request_come_from_the_unpaced_pair_of_runs(tmp_path: Path) -> None:
    (tmp_path / "trees.txt").write_text("new: commit bbb\n")
    for requests, read, write in ((1000, 4_000, 3_000), (3000, 10_000, 9_000)):
        name = f"strace-unpaced__new__{requests}"
        report = _report(tokens=32 * requests, ttft_ms=1, cpu_req=1, cpu_1k=1)
        report["run"]["load"]["ok"] = requests  # type: ignore[index]
        _write(tmp_path, name, report)
        (tmp_path / f"{name}.strace").write_text(_STRACE.format(read=read, write=write, write_errors="    "))
    out = _summary(tmp_path)
    assert "#### Syscalls per request (unpaced c64, strace -f -c)" in out
    # 6,000 more reads and writes over 2,000 more requests: 3 each per request.
    assert "| read | 3.00 |" in out.splitlines()
    assert "| all | **6.00** |" in out.splitlines()


def _profile(path: Path, requests: int) -> None:
    import cProfile

    from narwhal.serving.exchange import Leg

    def serve(n: int) -> None:
        for _ in range(n):
            Leg("prefill", None, 1, "/v1/completions", {})  # type: ignore[arg-type]

    profiler = cProfile.Profile()
    profiler.runcall(serve, requests)
    profiler.dump_stats(str(path))


def test_cprofile_compare_gives_calls_per_request_from_two_runs_of_each_tree(tmp_path: Path) -> None:
    # Each run makes one Leg per request: the difference of two runs, divided by the requests between them.
    for name, requests in (("a1", 10), ("a2", 30), ("b1", 10), ("b2", 50)):
        _profile(tmp_path / f"{name}.prof", requests)
    result = subprocess.run([sys.executable, "bench/cprofile_compare.py",
                             *(str(tmp_path / f"{n}.prof") for n in ("a1", "a2", "b1", "b2")), "--requests", "20"],
                            cwd=_REPO, capture_output=True, text=True, timeout=60, check=True)
    before, after, *rows = result.stdout.splitlines()
    assert before.startswith("before:") and " 1.0 in Narwhal's functions" in before
    assert " 2.0 in Narwhal's functions" in after
    assert any(row.endswith("narwhal/serving/exchange.py:__init__") and "1.00 ->     2.00" in row for row in rows)


def test_the_relay_cost_workload_relays_every_token_and_counts_per_token() -> None:
    # Two small runs of the real data plane (the driver checks every token reaches every client). The runs differ
    # by 200 tokens: with 8 the scheduler's few hundred calls of timing noise once made the difference negative.
    result = subprocess.run([sys.executable, "bench/relay_cost.py", "--tool", "cprofile", "--streams", "2",
                             "--requests", "1", "--tokens", "2", "102"], cwd=_REPO, capture_output=True, text=True,
                            timeout=120, check=True)
    assert "Python calls per token:" in result.stdout
    per_token = float(result.stdout.split("Python calls per token:")[1].split()[0].replace(",", ""))
    # In C (the relay's read and the hub's round) a token makes no Python call, and the scheduler's noise can make
    # the difference a little negative; the Python path makes about 25 a token.
    assert -20 < per_token < 500


def test_the_relay_cost_strace_parser_sums_the_rows() -> None:
    sys.path.insert(0, str(_REPO / "bench"))
    try:
        import relay_cost
    finally:
        sys.path.pop(0)
    text = _STRACE.format(read=1000, write=700, write_errors=3)
    assert relay_cost._strace_kinds(text) == {"read": 1000, "write": 700, "epoll_wait": 300}
    assert relay_cost._strace_total(text) == 2000


def _cachegrind(path: Path, requests: int, *, per_request: dict[tuple[str, str], int]) -> None:
    # cachegrind's output format: a fixed part (startup) plus each function's instructions per request.
    lines = ["desc: I1 cache: none", "cmd: python -m narwhal serve", "events: Ir"]
    total = 0
    for (source, function), count in per_request.items():
        ir = 1000 + count * requests
        total += ir
        lines += [f"fl=/tmp/build/Python-3.11.7/{source}", f"fn={function}", f"1 {ir}"]
    lines.append(f"summary: {total}")
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.skipif(shutil.which("cg_annotate") is None, reason="valgrind's cg_annotate is not installed")
def test_cachegrind_compare_gives_instructions_per_request_by_function(tmp_path: Path) -> None:
    before = {("Python/ceval.c", "_PyEval_EvalFrameDefault"): 300, ("Modules/sha256module.c", "sha_transform"): 0}
    after = {("Python/ceval.c", "_PyEval_EvalFrameDefault"): 330, ("Modules/sha256module.c", "sha_transform"): 70}
    for name, requests, counts in (("a1", 10, before), ("a2", 30, before), ("b1", 10, after), ("b2", 30, after)):
        _cachegrind(tmp_path / f"{name}.cg", requests, per_request=counts)
    result = subprocess.run([sys.executable, "bench/cachegrind_compare.py",
                             *(str(tmp_path / f"{n}.cg") for n in ("a1", "a2", "b1", "b2")), "--requests", "20"],
                            cwd=_REPO, capture_output=True, text=True, timeout=60, check=True)
    before_line, after_line, *rows = result.stdout.splitlines()
    assert before_line == "before: 300 instructions per request"
    assert after_line == "after:  400 instructions per request (+33.33%)"
    assert rows[0].split() == ["+70", "0", "->", "70", "Modules/sha256module.c:sha_transform"]
    assert rows[1].split() == ["+30", "300", "->", "330", "Python/ceval.c:_PyEval_EvalFrameDefault"]


def test_trace_work_makes_one_requests_spans_and_times_them() -> None:
    spec = importlib.util.spec_from_file_location("trace_work", _REPO / "bench" / "trace_work.py")
    assert spec is not None and spec.loader is not None
    trace_work = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trace_work)
    handed: list[list[object]] = []
    trace_work.traced(Tracer(TracingConfig(otlp_endpoint="http://127.0.0.1:9"), handed.append), 1)
    # The request core's spans of a plain streamed P/D request, handed over together as the root ends.
    assert [[span.name for span in spans] for spans in handed] == [
        ["narwhal.placement", "narwhal.prefill", "narwhal.decode", "narwhal.request"]]
    result = subprocess.run([sys.executable, "bench/trace_work.py", "--requests", "200"], cwd=_REPO,
                            capture_output=True, text=True, timeout=120, check=True)
    assert "tracing work" in result.stdout and "us per request" in result.stdout


@pytest.mark.skipif(shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2
                    or not (_REPO / ".venv" / "bin" / "python").exists(),
                    reason="pinned.sh needs taskset, two CPUs and the checkout's .venv")
def test_pinned_prints_the_routers_user_and_system_cpu_over_a_window(tmp_path: Path) -> None:
    report = tmp_path / "run.json"
    result = subprocess.run(["bench/pinned.sh", "--concurrency", "16", "--tokens", "64", "--token-delay-s", "0.005",
                             "--duration-s", "4", "--count-tokens", "off", "--quiet", "--json", str(report)],
                            cwd=_REPO, env={**os.environ, "WINDOW": "1 1.5"}, capture_output=True, text=True,
                            timeout=120, check=True)
    [line] = [line for line in result.stdout.splitlines() if line.startswith("router over")]
    shape = re.fullmatch(r"router over 1\.5 s of the load: user ([\d.]+) s, system ([\d.]+) s, ([\d.]+) ms per "
                         r"1,000 tokens at [\d,]+ tokens/s", line)
    assert shape is not None, line
    user, system, per_1k = (float(value) for value in shape.groups())
    assert user + system > 0 and per_1k > 0
    tokens_per_s = json.loads(report.read_text())["run"]["load"]["tokens_per_s"]
    assert per_1k == pytest.approx((user + system) * 1e6 / (tokens_per_s * 1.5), abs=0.1)


def test_the_health_check_count_runs_checks_against_a_mock_and_prints_calls_per_check() -> None:
    result = subprocess.run([sys.executable, "bench/health_check_calls.py", "20"], cwd=_REPO, capture_output=True,
                            text=True, timeout=120, check=True)
    per_check = float(result.stdout.split("Python calls per health check:")[1].split()[0])
    # About 195 a check (docs/benchmarks.md); a check that failed would raise, not count.
    assert 50 < per_check < 1000


def test_the_idle_profile_is_an_idle_routers_calls_with_its_monitor_passes(tmp_path: Path) -> None:
    out = tmp_path / "idle.prof"
    subprocess.run(["bench/idle_prof.sh", ".", str(out), "2"], cwd=_REPO, capture_output=True, text=True,
                   timeout=120, check=True)
    calls = {(Path(file).name, function): row[1]
             for (file, _, function), row in pstats.Stats(str(out)).stats.items()}  # type: ignore[attr-defined]
    # Two seconds idle at one pass a second: the passes ran, and no completion request did.
    assert calls[("monitor.py", "run_pass")] >= 2
    assert calls.get(("request_core.py", "_serve"), 0) == 0
