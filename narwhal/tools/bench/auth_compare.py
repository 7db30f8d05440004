"""``bench --compare-auth``: what client auth costs the router, in CPU per request.

One mock fleet; for each of ``auth_rounds`` rounds a router with no keys file and one with a keys file
of one key (normal priority, no limits) whose clients send it, each started afresh, warmed up and loaded
alike, in the order off-on, on-off, off-on, ...: the machine's drift and any cost of going second fall on
both modes; each mode's CPU per request is its passes' router CPU over their requests.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import trio

from narwhal.tools.bench.auth import BENCH_TENANT, auth_sections, write_keys_file
from narwhal.tools.bench.fleet import BenchFleet, Target, make_workdir, start_fleet, wait_until_serving
from narwhal.tools.bench.load import bearer_header, completion_body, run_load
from narwhal.tools.bench.report import AuthComparison, BenchReport, RunReport
from narwhal.tools.bench.runner import BenchSettings, _measure, _settings_record, _spec, _start_target

__all__ = ["auth_comparison", "run_auth_comparison"]


def auth_comparison(passes: list[RunReport], auth_on: list[bool]) -> AuthComparison:
    """Each mode's router CPU per request over all its passes, and on over off."""
    def per_request(on: bool) -> float | None:
        runs = [run for run, mode in zip(passes, auth_on, strict=True) if mode == on and run.router is not None]
        requests = sum(run.load.ok for run in runs)
        cpu_s = sum(run.router.cpu_s for run in runs if run.router is not None)
        return round(cpu_s * 1000 / requests, 4) if requests else None

    off, on = per_request(False), per_request(True)
    ratio = round(on / off, 4) if on is not None and off else None
    return AuthComparison(passes=passes, auth_on=auth_on, cpu_ms_per_request_off=off, cpu_ms_per_request_on=on,
                          ratio=ratio)


async def _one_pass(nursery: trio.Nursery, settings: BenchSettings, fleet: BenchFleet, workdir: Path,
                    client: httpx.AsyncClient, *, auth: bool, label: str) -> tuple[RunReport, Target]:
    body = completion_body(prompt_words=settings.prompt_words, max_tokens=settings.tokens, stream=settings.stream,
                           model=settings.model)
    extra, headers, probe_headers = None, b"", None
    if auth:
        key = write_keys_file(workdir / "keys.toml", [(BENCH_TENANT, "normal")])[BENCH_TENANT]
        extra = auth_sections(workdir / "keys.toml")
        headers, probe_headers = bearer_header(key), {"authorization": f"Bearer {key}"}
    target = await _start_target(nursery, settings, fleet, workdir, None, extra)
    try:
        await wait_until_serving(client, target, probe_body=completion_body(
            prompt_words=4, max_tokens=2, stream=True, model=settings.model), headers=probe_headers)
        if settings.warmup:
            await run_load(_spec(settings, target.host, target.port, body, requests=settings.warmup,
                                 duration_s=None, headers=headers))
        run, _ = await _measure(nursery, settings, fleet, target, client, body, headers=headers, label=label)
    finally:
        with trio.CancelScope(shield=True):
            await target.stop()
    return run, target


async def run_auth_comparison(settings: BenchSettings) -> BenchReport:
    """``auth_rounds`` rounds of an auth-off and an auth-on pass, on one fleet; ``run`` is the last pass."""
    passes: list[RunReport] = []
    modes: list[bool] = []
    with make_workdir() as workdir_name:
        workdir = Path(workdir_name)
        async with httpx.AsyncClient(timeout=10.0) as client, trio.open_nursery() as nursery:
            fleet: BenchFleet | None = None
            try:
                fleet = await start_fleet(nursery, prefill=settings.prefill, decode=settings.decode,
                                          mock_args=settings.mock_args)
                load_started_unix = time.time()
                target = None
                for round_index in range(1, settings.auth_rounds + 1):
                    # Odd rounds off then on, even rounds on then off: a drift or a cost of being second
                    # (a fleet warmer by one pass) falls on both modes alike.
                    for auth in ((False, True) if round_index % 2 else (True, False)):
                        label = f"auth {'on' if auth else 'off'} #{round_index}"
                        run, target = await _one_pass(nursery, settings, fleet, workdir, client, auth=auth,
                                                      label=label)
                        passes.append(run)
                        modes.append(auth)
            finally:
                with trio.CancelScope(shield=True):
                    if fleet is not None:
                        await fleet.stop()
                nursery.cancel_scope.cancel()
    assert target is not None
    return BenchReport(settings=_settings_record(settings, target), run=passes[-1],
                       load_started_unix=load_started_unix, auth_comparison=auth_comparison(passes, modes))
