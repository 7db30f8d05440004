"""The tracing work of one request, alone: the calls the request core makes for a traced streamed P/D request.

Usage (from the tree to measure; issue 40's cost goal):

    python bench/trace_work.py                 # microseconds per request, traced and not (best of 5 passes)
    python bench/trace_work.py --valgrind      # instructions per request (cachegrind; needs valgrind)
    NARWHAL_NO_EXTENSIONS=1 python bench/trace_work.py [--valgrind]   # the same with the Python twins of the
                                               # C encoder and RequestTrace

One request is what `RequestCore` does for a plain streamed request at `sample_ratio = 1.0`: the trace begun,
placement (both choices), the prefill leg (with its KV handoff size), the decode leg (its usage), the request
span ended, the request's spans queued, and the export task's encoding of them (a batch of 512 requests, the
POST left out). The "untraced" figure makes the same exchange and legs without a trace; the difference is the
tracing work. Time in a loop is far below what the
same work costs inside a loaded router (its caches are cold there); instructions move with the code only.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.getcwd())

import msgspec  # noqa: E402

from narwhal.config import EngineSpec, TracingConfig  # noqa: E402
from narwhal.fleet.placement.policy import Choice  # noqa: E402
from narwhal.serving import request_spans  # noqa: E402
from narwhal.serving.exchange import Exchange  # noqa: E402
from narwhal.tracing.exporter import SpanExporter  # noqa: E402
from narwhal.tracing.otlp import encode_encoded, encode_request  # noqa: E402
from narwhal.tracing.tracer import Tracer  # noqa: E402

ROUTE = "/v1/completions"
PREFILL = EngineSpec(name="p1", url="http://127.0.0.1:8100", role="prefill")
DECODE = EngineSpec(name="d1", url="http://127.0.0.1:8200", role="decode")
# What a vLLM prefill answers in kv_transfer_params (NixlConnector), block ids of a short prompt.
KV = {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "5b1f3c2e-prefill",
      "remote_block_ids": [1, 2, 3], "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1}
_encode_json = msgspec.json.Encoder()


class _Model:
    name = "facebook/opt-125m"


def _exporter() -> SpanExporter:
    # Never sends (not run): the queue is emptied between passes.
    return SpanExporter(endpoint="http://127.0.0.1:9", headers={}, service_name="narwhal",
                        max_queue=1 << 30, batch=1 << 30)


def traced(tracer: Tracer, n: int) -> None:
    """One traced request's tracing calls, in the request core's order."""
    now = time.time_ns
    ex = Exchange(ROUTE, f"req-{n}", None, 0.0)  # type: ignore[arg-type]
    ex.model = _Model  # type: ignore[assignment]
    trace, _, lines = tracer.begin(None, None)
    assert trace is not None
    ex.trace, ex.trace_kw = trace, {"trace": lines}
    # No engine call during placement (no KV event feeds): its span needs no traceparent of its own.
    placing = trace.child("narwhal.placement", now())
    request_spans.placed(placing, "prefill", Choice(PREFILL.name, "least_outstanding", None), 2)
    request_spans.placed(placing, "decode", Choice(DECODE.name, "least_outstanding", None), 2)
    ex.trace_kw = trace.root_kw
    trace.finish(placing, now())
    prefill, decode = ex.attempt(PREFILL, DECODE, ROUTE, {})
    prefill.span = span = request_spans.open_leg(trace, ex, prefill, now())
    span.attributes["narwhal.kv_handoff.bytes"] = len(_encode_json.encode(KV))
    request_spans.end_leg(trace, ex, prefill, now())
    decode.span = request_spans.open_leg(trace, ex, decode, now())
    ex.tokens, ex.status = 32, 200
    request_spans.end_leg(trace, ex, decode, now())
    request_spans.end_request(trace, ex, now())


def untraced(_: Any, n: int) -> None:
    """The same exchange and legs, no trace."""
    ex = Exchange(ROUTE, f"req-{n}", None, 0.0)  # type: ignore[arg-type]
    ex.model = _Model  # type: ignore[assignment]
    ex.attempt(PREFILL, DECODE, ROUTE, {})
    ex.tokens, ex.status = 32, 200


def _encode_queued(exporter: SpanExporter) -> None:
    """What the export task does with the queued requests' spans (less the POST), then an empty queue."""
    encode_encoded([encode_request(spans) for spans, _ in exporter._queue], service_name="narwhal",
                   scope_version="0")
    exporter._queue.clear()


def _run(mode: str, count: int) -> None:
    exporter = _exporter()
    tracer = Tracer(TracingConfig(otlp_endpoint="http://127.0.0.1:9"), exporter.submit_all)
    one = traced if mode == "traced" else untraced
    for n in range(count):
        one(tracer, n)
        if n % 512 == 511:
            _encode_queued(exporter)
    _encode_queued(exporter)


def _timed(requests: int) -> None:
    exporter = _exporter()
    tracer = Tracer(TracingConfig(otlp_endpoint="http://127.0.0.1:9"), exporter.submit_all)
    best: dict[str, float] = {}
    for _ in range(5):
        for name, one in (("untraced", untraced), ("traced", traced)):
            exporter._queue.clear()
            started = time.perf_counter_ns()
            for n in range(requests):
                one(tracer, n)
                if n % 512 == 511:
                    _encode_queued(exporter)
            _encode_queued(exporter)
            per = (time.perf_counter_ns() - started) / requests / 1000
            best[name] = min(best.get(name, per), per)
    print(f"traced {best['traced']:.2f} us, untraced {best['untraced']:.2f} us: "
          f"tracing work {best['traced'] - best['untraced']:.2f} us per request")


def _instructions(mode: str, count: int) -> int:
    out = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
                          sys.executable, __file__, "--run", mode, str(count)],
                         capture_output=True, text=True, check=True).stderr
    match = re.search(r"I\s+refs:\s+([\d,]+)", out)
    assert match, out
    return int(match.group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--valgrind", action="store_true", help="instructions per request under cachegrind")
    parser.add_argument("--requests", type=int, default=20000, help="requests per timed pass (default 20000)")
    parser.add_argument("--run", nargs=2, metavar=("MODE", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        _run(args.run[0], int(args.run[1]))
        return
    if not args.valgrind:
        _timed(args.requests)
        return
    # Startup cancels out: (3,000 - 1,000 requests) / 2,000, traced less untraced.
    traced_ir = _instructions("traced", 3000) - _instructions("traced", 1000)
    untraced_ir = _instructions("untraced", 3000) - _instructions("untraced", 1000)
    print(f"tracing work: {(traced_ir - untraced_ir) / 2000:,.0f} instructions per request "
          f"(traced {traced_ir / 2000:,.0f}, untraced {untraced_ir / 2000:,.0f})")


if __name__ == "__main__":
    main()
