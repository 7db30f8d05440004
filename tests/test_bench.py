"""The benchmark: its figures (percentiles, /proc parsing, the table), the load generator
against an in-process mock engine, and the command line end to end.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import msgspec
import pytest
import trio

from narwhal.tools.bench import procstat
from narwhal.tools.bench.cli import build_parser, settings_from_args
from narwhal.tools.bench.fleet import (
    BenchFleet,
    CommandTemplateError,
    command_for,
    external_target,
    start_narwhal,
    wait_until_serving,
)
from narwhal.tools.bench.html_report import render_html
from narwhal.tools.bench.load import LoadSpec, LoadState, _Exchange, completion_body, run_load
from narwhal.tools.bench.progress import progress_line
from narwhal.tools.bench.report import (
    BenchReport,
    FaultReport,
    RunReport,
    distribution,
    format_report,
    percentile,
    process_usage,
    summarize_load,
)
from narwhal.tools.mock.engine import MockSettings, serve_mock
from narwhal.tools.mock.faults import FaultRequest

REPO = Path(__file__).resolve().parent.parent
DECODE_KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p1",
             "remote_block_ids": [1], "remote_host": "127.0.0.1", "remote_port": 9, "tp_size": 1}


# ----- percentiles and summaries --------------------------------------------------------

@pytest.mark.parametrize(("values", "q", "expected"), [
    ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
    ([1.0, 2.0, 3.0, 4.0], 90, 3.7),
    ([1.0, 2.0, 3.0, 4.0], 0, 1.0),
    ([1.0, 2.0, 3.0, 4.0], 100, 4.0),
    ([7.0], 99, 7.0),
    ([float(i) for i in range(1, 101)], 99, 99.01),
])
def test_percentile_interpolates_between_ranks(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_refuses_no_values_and_bad_q() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution_is_in_milliseconds() -> None:
    dist = distribution([0.004, 0.001, 0.002, 0.003])
    assert dist is not None
    assert (dist.count, dist.mean_ms, dist.p50_ms, dist.max_ms) == (4, 2.5, 2.5, 4.0)
    assert distribution([]) is None


def test_summary_counts_errors_by_kind_and_status() -> None:
    summary = summarize_load(
        kinds=["ok", "ok", "status", "status", "refused", "sse_error"],
        statuses=[200, 200, 502, 503, 0, 200],
        ttft_s=[0.01, 0.03], total_s=[0.02, 0.04], gaps_s=[0.0, 0.001], tokens=64, duration_s=2.0)
    assert (summary.requests, summary.ok, summary.errors) == (6, 2, 4)
    assert summary.requests_per_s == 1.0 and summary.tokens_per_s == 32.0
    assert summary.errors_by_kind == {"refused": 1, "sse_error": 1, "status": 2}
    assert summary.errors_by_status == {"200": 1, "502": 1, "503": 1, "none": 1}
    assert summary.ttft is not None and summary.ttft.p50_ms == 20.0


def test_process_usage_per_request_and_per_thousand_tokens() -> None:
    usage = process_usage(pids=[1], cpu_s=1.5, wall_s=3.0, requests=3000, tokens=96000, peak_rss_kb=51200)
    assert usage.cpu_ms_per_request == 0.5
    assert usage.cpu_ms_per_1k_tokens == pytest.approx(15.625, abs=1e-3)
    assert (usage.cpu_utilization, usage.peak_rss_mb) == (0.5, 50.0)
    assert process_usage(pids=[], cpu_s=0.0, wall_s=0.0, requests=0, tokens=0,
                         peak_rss_kb=0).cpu_ms_per_request is None


# ----- /proc ----------------------------------------------------------------------------

def test_parse_stat_counts_fields_after_the_last_parenthesis() -> None:
    # A command name may hold spaces and parentheses.
    line = "4242 (my (odd) proc) S 17 4242 4242 0 -1 4194560 900 0 0 0 123 45 6 7 20 0 1 0 100 0 0"
    stat = procstat.parse_stat(line)
    assert (stat.pid, stat.comm, stat.state, stat.ppid) == (4242, "my (odd) proc", "S", 17)
    assert (stat.utime, stat.stime, stat.cpu_ticks) == (123, 45, 168)


def test_parse_vm_hwm() -> None:
    text = "Name:\tpython\nVmPeak:\t  200000 kB\nVmHWM:\t   51234 kB\nVmRSS:\t   50000 kB\n"
    assert procstat.parse_vm_hwm_kb(text) == 51234
    assert procstat.parse_vm_hwm_kb("Name:\tkthreadd\n") is None


def test_cpu_between_samples_counts_new_processes_from_zero() -> None:
    before = procstat.TreeSample(ticks={10: 100, 11: 50}, peak_rss_kb=0)
    after = procstat.TreeSample(ticks={10: 300, 12: 100}, peak_rss_kb=0)
    assert procstat.cpu_seconds_between(before, after) == 300 / procstat.CLOCK_TICKS_PER_S


def test_sample_tree_sees_a_child_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        sample = procstat.sample_tree(os.getpid())
        assert os.getpid() in sample.ticks and child.pid in sample.ticks
        assert child.pid in procstat.descendants(os.getpid())
        assert sample.peak_rss_kb > 0
    finally:
        child.kill()
        child.wait()


def test_listening_pid_finds_this_process() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert procstat.listening_pid(sock.getsockname()[1]) == os.getpid()


# ----- the response watcher ---------------------------------------------------------------

def _chunked(*pieces: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
    return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n"


def _feed_bytewise(response: bytes) -> _Exchange:
    exchange = _Exchange(stream=True)
    for i in range(len(response)):
        exchange.now = float(i)
        exchange.parser.feed_data(response[i:i + 1])
    return exchange


def test_events_split_across_reads_are_counted_once() -> None:
    exchange = _feed_bytewise(_chunked(b'data: {"t":1}\n\ndata: {"t":2}\n\n', b"data: [DONE]\n\n"))
    assert exchange.complete and exchange.keep_alive and exchange.done
    assert sum(n for _, n in exchange.arrivals) == 2 and exchange.error_events == 0


def test_an_sse_error_event_is_seen() -> None:
    exchange = _feed_bytewise(_chunked(b'data: {"t":1}\n\n', b'data: {"error":{"message":"gone"}}\n\n'))
    assert exchange.error_events == 1 and not exchange.done
    assert sum(n for _, n in exchange.arrivals) == 1


# ----- the load generator against an in-process mock ---------------------------------------

@pytest.fixture
async def decode_mock(nursery):
    service = await nursery.start(serve_mock, MockSettings(role="decode", engine_id="d1", tokens=8))
    yield service
    service.stop(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spec(port: int, **changes: object) -> LoadSpec:
    body = completion_body(prompt_words=4, max_tokens=8, stream=True, kv_transfer_params=DECODE_KV)
    spec = LoadSpec(host="127.0.0.1", port=port, body=body, concurrency=4, requests=20, duration_s=None,
                    timeout_s=5.0)
    return msgspec.structs.replace(spec, **changes)


async def test_load_counts_requests_tokens_and_reuses_connections(decode_mock) -> None:
    state = LoadState()
    result = await run_load(_spec(decode_mock.engine.port), state=state)
    summary = result.summary()
    assert (summary.requests, summary.ok, summary.errors, summary.tokens) == (20, 20, 0, 160)
    assert summary.ttft is not None and summary.ttft.count == 20
    assert summary.inter_token is not None and summary.inter_token.count == 20 * 7
    assert result.connections_opened == 4
    assert (state.done, state.errors, state.tokens) == (20, 0, 160)
    assert decode_mock.engine.stats.decode == 20


async def test_pair_mode_prefills_then_decodes_with_the_prefills_handoff(nursery, decode_mock) -> None:
    # bench --baseline pair: each request is vLLM's P/D flow by hand, with no router in between.
    prefill = await nursery.start(serve_mock, MockSettings(role="prefill", engine_id="p1", tokens=8))
    try:
        prefill_body = completion_body(prompt_words=4, max_tokens=1, stream=False,
                                       kv_transfer_params={"do_remote_decode": True})
        spec = _spec(decode_mock.engine.port, body=completion_body(prompt_words=4, max_tokens=8, stream=True),
                     prefill_host="127.0.0.1", prefill_port=prefill.engine.port, prefill_body=prefill_body)
        summary = (await run_load(spec)).summary()
        assert (summary.requests, summary.ok, summary.tokens) == (20, 20, 160)
        assert prefill.engine.stats.prefill == 20 and decode_mock.engine.stats.decode == 20
        # The decode leg carried the prefill's own handoff, which names the prefill engine.
        last = json.loads(decode_mock.engine.stats.last_decode_body)
        assert last["kv_transfer_params"]["remote_port"] == prefill.engine.port
        # A prefill that fails is the request's error; nothing reaches decode.
        refused = await run_load(msgspec.structs.replace(spec, prefill_port=_free_port(), requests=3))
        assert [r.kind for r in refused.records] == ["refused"] * 3 and decode_mock.engine.stats.decode == 20
    finally:
        prefill.stop(0)


async def test_new_connection_per_request(decode_mock) -> None:
    result = await run_load(_spec(decode_mock.engine.port, keep_alive=False, requests=10))
    assert result.ok == 10 and result.connections_opened == 10


async def test_non_streamed_responses_count_usage_tokens(decode_mock) -> None:
    body = completion_body(prompt_words=4, max_tokens=5, stream=False, kv_transfer_params=DECODE_KV)
    result = await run_load(_spec(decode_mock.engine.port, body=body, stream=False, requests=6))
    assert result.ok == 6 and result.tokens == 30


async def test_errors_are_classified_by_kind_and_status(decode_mock) -> None:
    engine = decode_mock.engine
    engine.add_fault(FaultRequest(mode="no_done", count=3))
    no_done = (await run_load(_spec(engine.port, concurrency=1, requests=5))).summary()
    assert no_done.errors_by_kind == {"no_done": 3} and no_done.errors_by_status == {"200": 3}
    assert no_done.ok == 2 and no_done.tokens == 16
    engine.add_fault(FaultRequest(mode="status_5xx", status=503, count=2))
    status = (await run_load(_spec(engine.port, concurrency=1, requests=5))).summary()
    assert status.errors_by_kind == {"status": 2} and status.errors_by_status == {"503": 2}
    assert status.ok == 3


_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
_TOKEN = b'data: {"t":1}\n\n'


@pytest.mark.parametrize(argnames=("response", "kind"), ids=["sse_error", "truncated", "reset"], argvalues=[
    # The stream ends with an SSE error event, properly terminated.
    (_HEAD + b"%x\r\n%s\r\n0\r\n\r\n" % (len(_TOKEN + b'data: {"error":{}}\n\n'),
                                            _TOKEN + b'data: {"error":{}}\n\n'), "sse_error"),
    # The connection closes mid-body.
    (_HEAD + b"%x\r\n%s\r\n" % (len(_TOKEN), _TOKEN), "truncated"),
    # The connection closes before a response head.
    (b"", "reset"),
])
async def test_broken_streams_are_classified(nursery, response: bytes, kind: str) -> None:
    async def answer_then_close(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        if response:
            await stream.send_all(response)
        await stream.aclose()

    listeners = await nursery.start(functools.partial(trio.serve_tcp, answer_then_close, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    result = await run_load(_spec(port, requests=2, concurrency=1))
    assert [r.kind for r in result.records] == [kind, kind]
    assert result.summary().ok == 0


async def test_refused_connections_are_counted() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = await run_load(_spec(port, requests=3, concurrency=1))
    assert [r.kind for r in result.records] == ["refused"] * 3


async def test_duration_bounds_the_load(decode_mock) -> None:
    result = await run_load(_spec(decode_mock.engine.port, requests=None, duration_s=0.3, concurrency=2))
    assert result.ok > 0 and result.duration_s < 2.0


def _arrivals_before(rate: float, seconds: float, seed: int = 0) -> list[float]:
    """The arrivals of the seeded Poisson process before ``seconds`` (what an open loop issues)."""
    draws, at, arrivals = random.Random(seed), 0.0, []
    while (at := at + draws.expovariate(rate)) < seconds:
        arrivals.append(at)
    return arrivals


async def test_an_open_loop_issues_its_arrivals_whatever_the_answers_take(decode_mock) -> None:
    # The arrivals are seeded: the count in a window is known before the run, however fast the engine answers.
    spec = _spec(decode_mock.engine.port, rate=400.0, requests=None, duration_s=0.25, concurrency=8)
    result = await run_load(spec)
    summary = result.summary()
    arrivals = _arrivals_before(400.0, 0.25)
    assert summary.requests == summary.ok == len(arrivals) > 50
    assert summary.offered_rate == 400.0
    # Each record starts when its arrival was due, not when a client got to it.
    assert sorted(record.started_at for record in result.records) == pytest.approx(arrivals, abs=1e-6)


async def test_an_open_loop_counts_late_starts_and_times_them_from_when_they_were_due(decode_mock) -> None:
    # Five arrivals within microseconds, one client: each after the first waits for the one before it.
    spec = _spec(decode_mock.engine.port, rate=1e7, requests=5, concurrency=1, late_after_s=0.0)
    result = await run_load(spec)
    summary = result.summary()
    # The last four waited for the one before them (the first may be a few microseconds late itself).
    assert summary.ok == 5 and summary.late_starts >= 4
    by_due = sorted(result.records, key=lambda record: record.started_at)
    # Counted from their due times (all but equal), each latency holds the exchanges before it.
    totals = [record.total_s for record in by_due]
    assert totals == sorted(totals) and len(set(totals)) == 5
    # The last was taken when the fourth had ended: at least the fourth's latency after it was due.
    assert summary.late_max_ms / 1000 >= totals[3] - 1e-5
    closed = (await run_load(_spec(decode_mock.engine.port, requests=5, concurrency=1))).summary()
    assert (closed.offered_rate, closed.late_starts, closed.late_max_ms) == (None, 0, 0.0)


def test_a_rate_must_be_positive() -> None:
    with pytest.raises(ValueError, match="rate must be positive"):
        LoadSpec(host="127.0.0.1", port=1, body=b"{}", rate=0.0)


def test_load_spec_needs_a_bound() -> None:
    with pytest.raises(ValueError):
        LoadSpec(host="127.0.0.1", port=1, body=b"{}", requests=None, duration_s=None)


# ----- table, progress, options ----------------------------------------------------------------

def _run_report(label: str) -> RunReport:
    load = summarize_load(kinds=["ok", "sse_error"], statuses=[200, 200], ttft_s=[0.01], total_s=[0.02],
                          gaps_s=[0.0], tokens=32, duration_s=1.0)
    return RunReport(label=label, target="http://x", load=load,
                     router=process_usage(pids=[1], cpu_s=0.5, wall_s=1.0, requests=1, tokens=32,
                                          peak_rss_kb=1024))


def test_format_report_lays_runs_side_by_side_with_faults() -> None:
    faults = FaultReport(
        killed_engine="d1", failing_engine="d2", failing_status=500, timeline=[], goodput=0.99,
        requests_lost=2, lost_by_kind={"sse_error": 2}, streams_cut=2, cut_with_error_event=2, cut_silently=0,
        attempts_on_dead_engine=3, dead_engine_last_attempt_s=0.01, dead_engine_ineligible_s=0.02,
        restarted_engine_eligible_s=None, restarted_engine_first_served_s=1.5,
        failing_engine_requests_during_fault=4, failing_engine_last_request_s=0.1,
        failing_engine_ineligible_s=0.1)
    report = BenchReport(settings={}, run=_run_report("narwhal"), baseline=_run_report("direct"),
                         router_vs_direct={"requests_per_s": 0.5}, faults=faults)
    text = format_report(report)
    assert "narwhal" in text and "direct" in text and "router CPU ms / request" in text
    assert "errors by kind" in text and "sse_error 1" in text
    assert "router / direct: requests_per_s 0.50" in text
    assert "2 with an SSE error event, 0 silently" in text and "not seen" in text
    json.loads(msgspec.json.encode(report))


def test_format_report_puts_each_model_beside_the_totals() -> None:
    one = format_report(BenchReport(settings={}, run=_run_report("narwhal")))
    assert "model " not in one
    a = summarize_load(kinds=["ok", "ok"], statuses=[200, 200], ttft_s=[0.01, 0.03], total_s=[0.02, 0.04],
                       gaps_s=(), tokens=64, duration_s=1.0)
    b = summarize_load(kinds=["ok", "status"], statuses=[200, 503], ttft_s=[0.05], total_s=[0.06],
                       gaps_s=(), tokens=32, duration_s=1.0)
    run = msgspec.structs.replace(_run_report("narwhal"), models={"a": a, "b": b})
    text = format_report(BenchReport(settings={}, run=run))
    header, *rows = text.splitlines()
    assert header.split()[-4:] == ["model", "a", "model", "b"]
    row = {line.split("  ")[0]: line for line in rows}
    # The totals' column first, then a, then b.
    assert row["requests (ok / errors)"].split()[-9:] == ["1", "/", "1", "2", "/", "0", "1", "/", "1"]
    assert row["TTFT ms p50 / p90 / p99"].endswith("20.00 / 28.00 / 29.80  50.00 / 50.00 / 50.00")
    assert row["errors by kind"].split()[-3:] == ["none", "status", "1"]
    # The run's own figures (router CPU) are the totals' only.
    assert row["router CPU ms / request"].rstrip().endswith("500.000")
    assert json.loads(msgspec.json.encode(BenchReport(settings={}, run=run)))["run"]["models"]["b"]["errors"] == 1


def test_progress_line() -> None:
    state = LoadState()
    state.done, state.tokens, state.errors, state.errors_by_kind = 100, 3200, 2, {"refused": 2}
    line = progress_line(state, label="narwhal", elapsed_s=2.0, total=2000)
    assert "done 100/2000" in line and "50.0 req/s" in line and "errors 2 (refused 2)" in line


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    build_parser(parser)
    return parser.parse_args(list(argv))


def test_defaults_and_fault_defaults() -> None:
    settings = settings_from_args(_args())
    assert (settings.prefill, settings.decode, settings.tokens, settings.concurrency) == (1, 1, 32, 16)
    assert (settings.requests, settings.duration_s, settings.token_delay_s) == (2000, 20.0, 0.0)
    only_time = settings_from_args(_args("--duration-s", "5"))
    assert (only_time.requests, only_time.duration_s) == (None, 5.0)
    faults = settings_from_args(_args("--scenario", "faults"))
    assert (faults.decode, faults.requests, faults.duration_s, faults.token_delay_s) == (3, None, 20.0, 0.01)
    open_loop = settings_from_args(_args("--rate", "1500", "--duration-s", "10"))
    assert (open_loop.rate, open_loop.concurrency, open_loop.requests) == (1500.0, 256, None)
    assert settings_from_args(_args("--rate", "100", "--concurrency", "4")).concurrency == 4
    assert settings.rate is None
    overrides = settings_from_args(_args("--set", "recovery.eject_after=2", "--set", "serving.policy=bounded"))
    assert overrides.overrides == {"recovery": {"eject_after": 2}, "serving": {"policy": "bounded"}}


@pytest.mark.parametrize("argv", [
    ("--scenario", "faults", "--decode", "1"),
    ("--target", "http://127.0.0.1:1", "--baseline", "direct"),
    ("--target", "http://127.0.0.1:1", "--baseline", "pair"),
    ("--target", "http://127.0.0.1:1", "--pair", "http://127.0.0.1:2", "http://127.0.0.1:3"),
    ("--baseline", "pair", "--pair", "https://127.0.0.1:2", "http://127.0.0.1:3"),
    ("--target", "http://127.0.0.1:1", "--router-cmd", "x"),
    ("--tls", "--target", "https://127.0.0.1:1"),
    ("--tls", "--router-cmd", "vllm-router --port {port}"),
    ("--set", "nodot=1"),
    ("--concurrency", "0"),
    ("--models", "0"),
    ("--models", "2", "--target", "http://127.0.0.1:1"),
    ("--models", "2", "--scenario", "faults"),
    ("--models", "2", "--router-cmd", "vllm-router --port {port}"),
    ("--rate", "0"),
    ("--rate", "-5"),
    ("--rate", "100", "--scenario", "prefix"),
    ("--rate", "100", "--scenario", "priority"),
])
def test_bad_option_combinations(argv: tuple[str, ...]) -> None:
    with pytest.raises(ValueError):
        settings_from_args(_args(*argv))


def test_a_faults_run_shorter_than_its_timeline_is_refused_up_front() -> None:
    with pytest.raises(ValueError) as info:
        settings_from_args(_args("--scenario", "faults", "--duration-s", "5"))
    assert str(info.value).startswith("--scenario faults: --duration-s 5 ends before the fault timeline does")
    assert "at least 11 s" in str(info.value)
    assert settings_from_args(_args("--scenario", "faults", "--duration-s", "12")).duration_s == 12.0


def test_a_set_key_the_router_would_refuse_is_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError) as info:
        settings_from_args(_args("--set", "serving.workrs=2"))
    assert str(info.value) == "--set: serving.workrs: unknown key (did you mean 'workers'?)"
    with pytest.raises(ValueError, match="serving: max_connections must be > 0"):
        settings_from_args(_args("--set", "serving.max_connections=0"))


async def test_a_router_that_exits_at_start_is_reported_as_exited(nursery, tmp_path: Path) -> None:
    class Engine:
        def __init__(self, port: int) -> None:
            self.url = f"http://127.0.0.1:{port}"

    fleet = BenchFleet({"p1": Engine(9), "d1": Engine(9)},  # type: ignore[dict-item]
                       {"p1": "prefill", "d1": "decode"}, [])
    with pytest.raises(RuntimeError) as info:
        await start_narwhal(nursery, fleet, tmp_path, {"serving": {"workrs": 2}}, timeout_s=60.0)
    assert str(info.value).startswith("the router exited with status 2 before it started")
    assert "did you mean 'workers'" in str(info.value)


async def test_a_target_where_nothing_listens_fails_at_once(autojump_clock) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        target = external_target(f"http://127.0.0.1:{port}", pid=None)
        async with httpx.AsyncClient(timeout=10.0) as client:
            with pytest.raises(RuntimeError) as info:
                await wait_until_serving(client, target, probe_body=b"{}", timeout_s=10.0)
    assert str(info.value).startswith(f"nothing answers at http://127.0.0.1:{port}")


def test_router_command_template() -> None:
    class Engine:
        def __init__(self, port: int) -> None:
            self.url = f"http://127.0.0.1:{port}"

    fleet = BenchFleet({"p1": Engine(1), "d1": Engine(2), "d2": Engine(3)},  # type: ignore[dict-item]
                       {"p1": "prefill", "d1": "decode", "d2": "decode"}, [])
    argv = command_for("r --pd {prefill_flags_bootstrap} {decode_flags} --port {port} --m {metrics_port} "
                       "--one {decode[1]}", fleet, port=9, metrics_port=10)
    assert argv == ["r", "--pd", "--prefill", "http://127.0.0.1:1", "8998", "--decode", "http://127.0.0.1:2",
                    "--decode", "http://127.0.0.1:3", "--port", "9", "--m", "10", "--one", "http://127.0.0.1:3"]
    with pytest.raises(CommandTemplateError):
        command_for("r {nope}", fleet, port=1, metrics_port=2)


# ----- the command line ----------------------------------------------------------------------------

def test_bench_help() -> None:
    done = subprocess.run([sys.executable, "-m", "narwhal", "bench", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0
    for option in ("--concurrency", "--baseline", "--target", "--scenario", "--json", "--router-cmd"):
        assert option in done.stdout


@pytest.mark.e2e
def test_bench_end_to_end_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    requests = 200
    done = subprocess.run([sys.executable, "-m", "narwhal", "bench", "--requests", str(requests), "--concurrency",
                           "4", "--json", str(out), "--quiet"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "router CPU ms / request" in done.stdout
    report = json.loads(out.read_text())
    load = report["run"]["load"]
    assert (load["requests"], load["ok"], load["errors"]) == (requests, requests, 0)
    assert load["tokens"] == requests * 32 and load["requests_per_s"] > 0
    for figure in ("ttft", "inter_token", "total"):
        assert set(load[figure]) >= {"p50_ms", "p90_ms", "p99_ms"}
    router = report["run"]["router"]
    # The router's CPU was measured: relaying 200 streams costs some (clock ticks are 10 ms), no more
    # than every core for the whole run, and the per-request and per-token figures are derived from it.
    assert router["cpu_s"] > 0
    assert router["cpu_utilization"] <= (os.cpu_count() or 1) + 0.05
    assert router["cpu_ms_per_request"] == pytest.approx(router["cpu_s"] * 1000 / requests, abs=5e-3)
    assert router["cpu_ms_per_1k_tokens"] == pytest.approx(router["cpu_s"] * 1e6 / (requests * 32), abs=0.1)
    assert router["peak_rss_mb"] > 0 and router["pids"]
    assert {e["name"] for e in report["run"]["engines"]} == {"p1", "d1"}
    assert report["settings"]["router_command"][1:4] == ["-m", "narwhal", "serve"]


@pytest.mark.e2e
def test_bench_over_tls_keeps_engine_connections_alive(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, "-m", "narwhal", "bench", "--tls", "--requests", "60", "--concurrency",
                           "4", "--baseline", "direct", "--json", str(out), "--quiet"], cwd=REPO,
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["settings"]["tls"] is True
    assert report["run"]["label"] == "narwhal (tls)"
    assert (report["run"]["load"]["ok"], report["baseline"]["load"]["ok"]) == (60, 60)
    # Client -> router -> engines all over TLS, and the router's engine connections are pooled:
    # a handful of handshakes for 60 requests, not one each.
    for engine in report["run"]["engines"]:
        assert engine["connections_per_request"] is not None and engine["connections_per_request"] < 0.2, engine


async def test_a_load_over_several_models_takes_them_in_turn(decode_mock) -> None:
    # The mock serves mock-model only: every request naming "other" gets its 404, and each model's summary
    # holds its own requests.
    bodies = tuple(completion_body(prompt_words=4, max_tokens=8, stream=True, model=model,
                                   kv_transfer_params=DECODE_KV) for model in ("mock-model", "other"))
    result = await run_load(_spec(decode_mock.engine.port, model_bodies=bodies, requests=21))
    assert [r.model_index for r in sorted(result.records, key=lambda r: r.started_at)].count(1) == 10
    ours, other = result.summary(0), result.summary(1)
    assert (ours.requests, ours.ok, ours.tokens, other.requests, other.ok) == (11, 11, 88, 10, 0)
    assert other.errors_by_status == {"404": 10} and ours.ttft is not None and ours.ttft.count == 11
    assert result.summary().requests == 21 and ours.inter_token is None


@pytest.mark.e2e
def test_bench_with_two_models_reports_each_beside_the_totals(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, "-m", "narwhal", "bench", "--models", "2", "--requests", "100",
                           "--concurrency", "4", "--json", str(out), "--quiet"], cwd=REPO, capture_output=True,
                          text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    assert "model mock-model " in done.stdout and "model mock-model-2" in done.stdout
    report = json.loads(out.read_text())
    assert report["settings"]["models"] == 2
    assert report["run"]["load"]["ok"] == 100
    models = report["run"]["models"]
    assert list(models) == ["mock-model", "mock-model-2"]
    for load in models.values():
        assert (load["requests"], load["ok"], load["errors"], load["tokens"]) == (50, 50, 0, 50 * 32)
        assert load["ttft"]["p99_ms"] >= load["ttft"]["p50_ms"] > 0 and load["requests_per_s"] > 0
    # Each model's requests went to its own engines: 50 decodes on each model's decode engine.
    decoded = {e["name"]: e["requests"] for e in report["run"]["engines"] if e["role"] == "decode"}
    assert decoded == {"m1-d1": 50, "m2-d1": 50}


async def test_load_over_tls(nursery, tmp_path: Path) -> None:
    from narwhal.tools.bench.tls import BenchTLS

    tls = BenchTLS(tmp_path)
    service = await nursery.start(serve_mock, MockSettings(role="decode", tokens=8, tls_cert_file=str(tls.cert_file),
                                                           tls_key_file=str(tls.key_file)))
    result = await run_load(_spec(service.engine.port), ssl_context=tls.client_context())
    assert result.ok == 20 and result.connections_opened == 4
    # Plain HTTP against the same port gets no answer: every request fails.
    plain = await run_load(_spec(service.engine.port, requests=4))
    assert plain.ok == 0
    service.stop(0)


# ----- the HTML report (--report) ---------------------------------------------------------------

def _timeline(states_d1: list[str | None]) -> dict[str, object]:
    n = len(states_d1)
    return {"bucket_s": 1, "window_s": 900, "now": 110.5, "now_unix": 1010.5, "start": 100.0, "start_unix": 1000.0,
            "engines": ["p1", "d1"], "requests": [5] * n, "errors": {"stream": [0] * (n - 1) + [2]},
            "recovered": {"connection": [0, 3] + [0] * (n - 2)},
            "ttft_p50_ms": [1.0] * n, "ttft_p99_ms": [None] + [4.0] * (n - 1),
            "in_flight": {"p1": [1] * n, "d1": [1] * n}, "state": {"p1": ["eligible"] * n, "d1": states_d1}}


def test_the_html_report_draws_the_timeline_with_the_faults_marked() -> None:
    faults = FaultReport(
        killed_engine="d1", failing_engine="d2", failing_status=500,
        timeline=[{"at_s": 2.0, "event": "d1 killed (SIGKILL)"}, {"at_s": 6.0, "event": "d1 restarted on port 1"}],
        goodput=1.0, requests_lost=0, lost_by_kind={}, streams_cut=0, cut_with_error_event=0, cut_silently=0,
        attempts_on_dead_engine=1, dead_engine_last_attempt_s=0.01, dead_engine_ineligible_s=0.02,
        restarted_engine_eligible_s=1.0, restarted_engine_first_served_s=1.5,
        failing_engine_requests_during_fault=4, failing_engine_last_request_s=0.1, failing_engine_ineligible_s=0.1)
    states = ["eligible"] * 3 + ["ejected"] * 4 + ["eligible"] * 3
    report = BenchReport(settings={"scenario": "faults"}, run=_run_report("narwhal <x>"), faults=faults,
                         timeline=_timeline(states), load_started_unix=1001.0)
    page = render_html(report)
    # Self-contained: no script, nothing fetched; names escaped.
    assert "<script" not in page and "src=" not in page and "href=" not in page
    assert "narwhal &lt;x&gt;" in page and "narwhal <x>" not in page
    assert "router CPU ms / request" in page  # the figures table
    assert page.count('class="fault-mark"') == 2 * 4  # two faults on each of the four charts
    assert 'data-series="requests"' in page and 'data-series="recovered connection"' in page
    assert 'data-engine="d1" data-state="ejected"' in page
    assert "d1 killed (SIGKILL)" in page
    # Without a timeline (another router) the table is still there and the page says why there is no chart.
    plain = render_html(BenchReport(settings={}, run=_run_report("other")))
    assert "No timeline" in plain and "<svg" not in plain


def test_report_option_is_parsed() -> None:
    assert _args("--report", "out.html").report == "out.html"


# ----- the prefix scenario ------------------------------------------------------------------


def test_prefix_scenario_defaults_and_checks() -> None:
    settings = settings_from_args(_args("--scenario", "prefix"))
    assert (settings.prefill, settings.decode, settings.tokens, settings.requests) == (4, 2, 8, 800)
    # About 3 prefixes' worth of cache per prefill mock: 3 x ceil((512 + 32) / 16) blocks.
    assert (settings.mock_cache_blocks, settings.prefill_s_per_token) == (102, 0.0002)
    assert "--prefix-cache-blocks" in settings.mock_args
    assert "--prefix-cache-blocks" not in settings_from_args(_args()).mock_args
    for argv in (("--prefix-skew", "1"), ("--prefixes", "0"), ("--chat-turns", "-1"),
                 ("--target", "http://127.0.0.1:1")):
        with pytest.raises(ValueError):
            settings_from_args(_args("--scenario", "prefix", *argv))


def test_prefix_workload_shares_prefixes_and_never_a_suffix() -> None:
    from narwhal.tools.bench.prefix import PrefixWorkload

    workload = PrefixWorkload(prefixes=8, prefix_words=20, suffix_words=4, skew=0.5, chat_turns=0,
                              max_tokens=2, stream=True)
    prompts = [json.loads(workload())["prompt"] for _ in range(2000)]
    heads = [" ".join(p.split()[:20]) for p in prompts]
    tails = [" ".join(p.split()[20:]) for p in prompts]
    assert len(set(heads)) == 8 and len(set(tails)) == 2000
    hot = heads.count(heads[0] if heads[0].startswith("g0") else next(h for h in heads if h.startswith("g0")))
    assert 0.45 < hot / 2000 < 0.55
    chat = PrefixWorkload(prefixes=2, prefix_words=5, suffix_words=3, skew=0.0, chat_turns=3, max_tokens=2,
                          stream=False)
    assert chat.path == "/v1/chat/completions"
    conversations = [json.loads(chat())["messages"] for _ in range(200)]
    assert all(messages[0]["role"] == "system" for messages in conversations)
    # Conversations grow turn by turn (user, assistant, user, ...) up to 3 user turns, then start again.
    lengths = {len(messages) for messages in conversations}
    assert lengths == {2, 4, 6}
    assert all([m["role"] for m in messages[1:]] == ["user", "assistant"] * ((len(messages) - 2) // 2) + ["user"]
               for messages in conversations)


async def test_a_load_with_a_body_per_request(nursery) -> None:
    service = await nursery.start(serve_mock, MockSettings(role="prefill", engine_id="p1", tokens=2,
                                                           prefix_cache_blocks=50))
    bodies = iter(completion_body(prompt_words=32 + i, max_tokens=1, stream=False) for i in range(10))
    spec = LoadSpec(host="127.0.0.1", port=service.engine.port, body=b"", concurrency=1, requests=10,
                    duration_s=None, stream=False, timeout_s=5.0)
    result = await run_load(spec, bodies=lambda: next(bodies))
    assert result.ok == 10
    cache = service.engine.prefix_cache.describe()
    # Every prompt shares the first 32 words with the one before: all but the first hit.
    assert cache["queries"] == 10 and cache["hits"] == 9
    service.stop(0)
