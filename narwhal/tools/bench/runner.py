"""One benchmark run from start to report: fleet, router, warm-up, load (or faults), baseline, stop.

``run_bench`` owns one nursery: the mock engines, the router and their log
readers live in it, and everything started is stopped (shielded from
cancellation) before it returns, whatever happened.
"""

from __future__ import annotations

import shutil
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio

from narwhal.tools.bench.auth import BENCH_TENANT, auth_sections, write_keys_file
from narwhal.tools.bench.collector import CountingCollector
from narwhal.tools.bench.fleet import (
    BenchFleet,
    Target,
    external_target,
    make_workdir,
    narwhal_sections,
    start_command_router,
    start_fleet,
    start_narwhal,
    wait_until_serving,
)
from narwhal.tools.bench.load import LoadSpec, bearer_header, completion_body, run_load
from narwhal.tools.bench.measure import EngineRef, measured_load
from narwhal.tools.bench.prefix import PrefixWorkload, collect_prefix_report
from narwhal.tools.bench.report import BenchReport, FaultReport, RunReport
from narwhal.tools.bench.scenario import FaultScenario
from narwhal.tools.bench.tls import BenchTLS
from narwhal.wire import PREFILL_KV_REQUEST

__all__ = ["BenchSettings", "run_bench"]

# What a decode engine needs to stream without a prefill: a readable (fake) KV handoff.
_DIRECT_KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "bench",
              "remote_block_ids": [1], "remote_host": "127.0.0.1", "remote_port": 1, "tp_size": 1}


class BenchSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Every choice of one run, resolved from the command line (and written to the JSON)."""

    prefill: int = 1
    decode: int = 1
    tokens: int = 32
    token_delay_s: float = 0.0
    mock_writes: str = "batched"
    prompt_words: int = 16
    concurrency: int = 16
    requests: int | None = 2000
    duration_s: float | None = 20.0
    # Open loop (bench --rate): requests per second arriving; None: closed loop.
    rate: float | None = None
    stream: bool = True
    keep_alive: bool = True
    warmup: int = 32
    timeout_s: float = 60.0
    count_tokens: bool = True
    overrides: dict[str, dict[str, Any]] = {}
    router_cmd: str | None = None
    target: str | None = None
    target_pid: int | None = None
    profile_router: str | None = None
    baseline: str | None = None
    scenario: str = "load"
    fault_downtime_s: float = 4.0
    fault_5xx_s: float = 4.0
    fault_status: int = 500
    label: str | None = None
    progress: bool = True
    # Every hop over TLS (bench --tls).
    tls: bool = False
    model: str = "mock-model"
    # Models served by the mock fleet (bench --models): each has --prefill + --decode engines of its own,
    # and requests name them in turn.
    models: int = 1
    # --baseline pair: (prefill URL, decode URL).
    pair: tuple[str, str] | None = None
    # The prefix scenario (bench --scenario prefix).
    prefixes: int = 8
    prefix_words: int = 512
    suffix_words: int = 32
    prefix_skew: float = 0.0
    chat_turns: int = 0
    mock_cache_blocks: int = 0
    prefill_s_per_token: float = 0.0
    # Placement passes (narwhal.tools.bench.placement): precise then approximate on one fleet, and the
    # Narwhal routers in front of it (each its own process); either makes the prefill mocks publish KV events.
    compare_kv_events: bool = False
    routers: int = 1
    # --routers N >= 2: the routers form one cluster ([lease] mode = "replicas") on this etcd, else on one
    # started for the run; independent_routers: each alone with no lease (issue 37's setup).
    etcd: str | None = None
    independent_routers: bool = False
    # --compare-routers: a lone router's pass (no lease) before the N-router pass, for each kv_events mode.
    compare_routers: bool = False
    # The fleet scenario (bench --scenario fleet): the fleet sizes, and the idle window at each.
    fleet_sizes: tuple[int, ...] = (4, 64, 256)
    fleet_idle_s: float = 10.0
    # Client keys (issue 39). auth: the router reads a keys file of one key (normal priority, no limits) and
    # every request sends it; compare_auth: auth_rounds rounds of a pass with auth off then one with it on.
    auth: bool = False
    compare_auth: bool = False
    auth_rounds: int = 2
    # The priority scenario (bench --scenario priority): the router's data pool, its high-priority reserve,
    # and the concurrency of each tenant but normal-b (which has ten times it).
    priority_max_connections: int = 8
    priority_reserve_high: float = 0.125
    priority_concurrency: int = 4
    # Traces (issue 40): the router started here exports to a counting collector (run here) at this sample
    # ratio; None: tracing off.
    tracing_ratio: float | None = None

    @property
    def mock_args(self) -> list[str]:
        args = ["--tokens", str(self.tokens), "--token-delay-s", repr(self.token_delay_s),
                "--sse-writes", self.mock_writes]
        if self.mock_cache_blocks or self.prefill_s_per_token:
            args += ["--prefix-cache-blocks", str(self.mock_cache_blocks),
                     "--prefill-s-per-token", repr(self.prefill_s_per_token)]
        if self.placement_passes:
            args += ["--kv-events", "0", "--kv-events-replay", "0"]
        return args

    @property
    def placement_passes(self) -> bool:
        """Whether the run is placement passes: ``--compare-kv-events``, ``--compare-routers``, ``--routers`` >= 2."""
        return self.scenario == "prefix" and (self.compare_kv_events or self.compare_routers or self.routers > 1)

    @property
    def cluster(self) -> bool:
        """Whether the N-router passes run the routers as one cluster on etcd."""
        return self.routers > 1 and not self.independent_routers

    @property
    def model_names(self) -> list[str]:
        """The served models: ``model`` alone, or ``model``, ``model-2``, ... with ``models`` >= 2."""
        return [self.model, *(f"{self.model}-{i}" for i in range(2, self.models + 1))]

    def prefix_workload(self) -> PrefixWorkload | None:
        """The prefix scenario's request bodies, or None for the other scenarios."""
        if self.scenario != "prefix":
            return None
        return PrefixWorkload(prefixes=self.prefixes, prefix_words=self.prefix_words,
                              suffix_words=self.suffix_words, skew=self.prefix_skew, chat_turns=self.chat_turns,
                              max_tokens=self.tokens, stream=self.stream, model=self.model)


def _spec(settings: BenchSettings, host: str, port: int, body: bytes, *, requests: int | None,
          duration_s: float | None, path: str = "/v1/completions",
          model_bodies: tuple[bytes, ...] = (), headers: bytes = b"") -> LoadSpec:
    return LoadSpec(host=host, port=port, body=body, concurrency=settings.concurrency, requests=requests,
                    duration_s=duration_s, rate=settings.rate, keep_alive=settings.keep_alive, stream=settings.stream,
                    timeout_s=settings.timeout_s, path=path, model_bodies=model_bodies, headers=headers,
                    # Our mocks always send max_tokens: the fault scenario checks every join's arithmetic.
                    expect_tokens=settings.tokens if settings.scenario == "faults" and settings.target is None
                    else None)


def _model_bodies(settings: BenchSettings) -> tuple[bytes, ...]:
    """With several models, one request body per model, sent in turn; with one, none (every request sends one)."""
    if settings.models < 2:
        return ()
    return tuple(completion_body(prompt_words=settings.prompt_words, max_tokens=settings.tokens,
                                 stream=settings.stream, model=name) for name in settings.model_names)


def _engine_refs(fleet: BenchFleet | None) -> list[EngineRef]:
    if fleet is None:
        return []
    return [(name, role, fleet.engines[name].url, fleet.engines[name].pid) for name, role in fleet.roles.items()]


def _label(settings: BenchSettings, target: Target, auth: bool | None = None) -> str:
    if settings.label:
        return settings.label
    if target.kind == "command" and target.command:
        return Path(target.command[0]).name
    if target.is_narwhal:
        auth = settings.auth if auth is None else auth
        notes = [name for name, on in (("tls", settings.tls), ("auth", auth)) if on]
        if settings.tracing_ratio is not None:
            notes.append(f"tracing {settings.tracing_ratio:g}")
        return f"narwhal ({', '.join(notes)})" if notes else "narwhal"
    return "target"


_PROFILE_FORMATS = {".svg": "flamegraph", ".txt": "raw"}


async def _start_profiler(pid: int, out: str) -> trio.Process:
    """py-spy on the router: ``.svg`` a flame graph, ``.txt`` collapsed stacks, anything else speedscope."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        raise RuntimeError("--profile-router needs py-spy on PATH (pip install py-spy)")
    profile_format = _PROFILE_FORMATS.get(Path(out).suffix, "speedscope")
    return await trio.lowlevel.open_process(
        [py_spy, "record", "--pid", str(pid), "--nonblocking", "--rate", "250", "--format", profile_format,
         "--output", out], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def _stop_profiler(process: trio.Process) -> None:
    # py-spy writes its output when interrupted.
    process.send_signal(signal.SIGINT)
    with trio.move_on_after(30):
        await process.wait()
    if process.returncode is None:
        process.kill()
        await process.wait()


def _ratios(run: RunReport, direct: RunReport) -> dict[str, float | None]:
    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    routed, base = run.load, direct.load
    return {
        "requests_per_s": ratio(routed.requests_per_s, base.requests_per_s),
        "tokens_per_s": ratio(routed.tokens_per_s, base.tokens_per_s),
        "ttft_p50": ratio(routed.ttft.p50_ms if routed.ttft else None, base.ttft.p50_ms if base.ttft else None),
        "ttft_p99": ratio(routed.ttft.p99_ms if routed.ttft else None, base.ttft.p99_ms if base.ttft else None),
        "total_p50": ratio(routed.total.p50_ms if routed.total else None,
                           base.total.p50_ms if base.total else None),
    }


async def _start_target(nursery: trio.Nursery, settings: BenchSettings, fleet: BenchFleet | None,
                        workdir: Path, tls: BenchTLS | None = None,
                        extra: dict[str, dict[str, Any]] | None = None) -> Target:
    """The router to load; ``extra`` sections (client auth) go under the ``--set`` overrides."""
    if settings.target:
        return external_target(settings.target, settings.target_pid)
    assert fleet is not None
    if settings.router_cmd:
        keys_file = (extra or {}).get("auth", {}).get("keys_file")
        return await start_command_router(nursery, settings.router_cmd, fleet, workdir,
                                          Path(keys_file) if keys_file else None)
    overrides = dict(settings.overrides)
    for section, values in (extra or {}).items():
        overrides[section] = {**values, **overrides.get(section, {})}
    if settings.scenario == "faults":
        # Retrying on another engine is what lets a router lose only the streams cut by a death.
        overrides = {**overrides, "serving": {"policy": "bounded", **overrides.get("serving", {})}}
    if tls is not None:
        # The TLS keys first, so that a --set can still override any of them.
        merged = tls.sections()
        for section, values in overrides.items():
            merged[section] = {**merged.get(section, {}), **values}
        overrides = merged
    sections = narwhal_sections(workdir, count_tokens=settings.count_tokens, overrides=overrides)
    return await start_narwhal(nursery, fleet, workdir, sections, scheme="https" if tls is not None else "http")


async def _measure(nursery: trio.Nursery, settings: BenchSettings, fleet: BenchFleet | None, target: Target,
                   client: httpx.AsyncClient, body: bytes, ssl_context: ssl.SSLContext | None = None,
                   workload: PrefixWorkload | None = None, headers: bytes = b"",
                   label: str | None = None) -> tuple[RunReport, FaultReport | None]:
    label = label or _label(settings, target)
    spec = _spec(settings, target.host, target.port, body, requests=settings.requests,
                 duration_s=settings.duration_s, path=workload.path if workload else "/v1/completions",
                 model_bodies=_model_bodies(settings), headers=headers)
    scenario = None
    if settings.scenario == "faults":
        assert fleet is not None
        probe_interval_s = float(settings.overrides.get("recovery", {}).get("probe_interval_s", 5.0))
        scenario = FaultScenario(nursery=nursery, fleet=fleet, target=target, client=client,
                                 downtime_s=settings.fault_downtime_s, fault_5xx_s=settings.fault_5xx_s,
                                 status=settings.fault_status, load_duration_s=settings.duration_s,
                                 probe_interval_s=probe_interval_s)
    profiler = None
    if settings.profile_router and target.pid:
        profiler = await _start_profiler(target.pid, settings.profile_router)
        await trio.sleep(0.5)
    try:
        run, result = await measured_load(spec, label=label, target=target.url, client=client,
                                          router_pid=target.pid, engines=_engine_refs(fleet),
                                          progress=settings.progress,
                                          alongside=scenario.run if scenario else None,
                                          ssl_context=ssl_context, bodies=workload,
                                          models=settings.model_names if settings.models > 1 else ())
    finally:
        if profiler is not None:
            with trio.CancelScope(shield=True):
                await _stop_profiler(profiler)
    return run, (scenario.report(result) if scenario else None)


async def _direct_baseline(settings: BenchSettings, fleet: BenchFleet, client: httpx.AsyncClient,
                           ssl_context: ssl.SSLContext | None = None) -> RunReport:
    """The same load straight at the first decode mock, with a decode-shaped body: the machine's limit."""
    name = fleet.names("decode")[0]
    engine = fleet.engines[name]
    body = completion_body(prompt_words=settings.prompt_words, max_tokens=settings.tokens,
                           stream=settings.stream, kv_transfer_params=_DIRECT_KV)
    spec = _spec(settings, "127.0.0.1", engine.port, body, requests=settings.requests,
                 duration_s=settings.duration_s)
    if settings.warmup:
        await run_load(msgspec.structs.replace(spec, requests=settings.warmup, duration_s=None),
                       ssl_context=ssl_context)
    run, _ = await measured_load(spec, label=f"direct ({name})", target=engine.url, client=client,
                                 router_pid=None, engines=[(name, "decode", engine.url, engine.pid)],
                                 progress=settings.progress, ssl_context=ssl_context)
    return run


async def _timeline(client: httpx.AsyncClient, target: Target) -> dict[str, Any] | None:
    """A Narwhal router's ``/admin/timeline`` (for ``--report``); None from another router or on any error."""
    if not target.is_narwhal:
        return None
    try:
        response = await client.get(f"{target.url}/admin/timeline")
        body = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return body if isinstance(body, dict) else None


async def _pair_baseline(settings: BenchSettings, client: httpx.AsyncClient) -> RunReport:
    """The same load through a prefill/decode pair with no router: prefill, then decode with its handoff."""
    assert settings.pair is not None
    prefill, decode = (httpx.URL(url) for url in settings.pair)
    body = completion_body(prompt_words=settings.prompt_words, max_tokens=settings.tokens, stream=settings.stream,
                           model=settings.model)
    prefill_body = completion_body(prompt_words=settings.prompt_words, max_tokens=1, stream=False,
                                   model=settings.model, kv_transfer_params=PREFILL_KV_REQUEST)
    spec = msgspec.structs.replace(
        _spec(settings, decode.host, decode.port or 80, body, requests=settings.requests,
              duration_s=settings.duration_s),
        prefill_host=prefill.host, prefill_port=prefill.port or 80, prefill_body=prefill_body)
    if settings.warmup:
        await run_load(msgspec.structs.replace(spec, requests=settings.warmup, duration_s=None))
    run, _ = await measured_load(spec, label="pair (no router)", target=str(decode), client=client,
                                 router_pid=None, progress=settings.progress)
    return run


def _settings_record(settings: BenchSettings, target: Target) -> dict[str, Any]:
    record: dict[str, Any] = msgspec.structs.asdict(settings)
    record["router_command"] = target.command
    record["mock_args"] = settings.mock_args
    record["python"] = sys.version.split()[0]
    return record


async def run_bench(settings: BenchSettings) -> BenchReport:
    """Run the benchmark ``settings`` describe and return its report."""
    body = completion_body(prompt_words=settings.prompt_words, max_tokens=settings.tokens, stream=settings.stream,
                           model=settings.model)
    # Each model is probed: /ready answers 200 once any one model can serve.
    probe_bodies = [completion_body(prompt_words=4, max_tokens=2, stream=True, model=name)
                    for name in settings.model_names]
    workload = settings.prefix_workload()
    prefix = None
    with make_workdir() as workdir_name:
        workdir = Path(workdir_name)
        tls = BenchTLS(workdir) if settings.tls else None
        context = tls.client_context() if tls is not None else None
        mock_args = settings.mock_args + (tls.mock_args if tls is not None else [])
        verify: ssl.SSLContext | bool = context if context is not None else True
        async with httpx.AsyncClient(timeout=10.0, verify=verify) as client, trio.open_nursery() as nursery:
            fleet: BenchFleet | None = None
            target: Target | None = None
            collector: CountingCollector | None = None
            try:
                if not settings.target:
                    fleet = await start_fleet(nursery, prefill=settings.prefill, decode=settings.decode,
                                              mock_args=mock_args,
                                              models=settings.model_names if settings.models > 1 else ())
                extra, headers, probe_headers = None, b"", None
                if settings.auth:
                    # One key, normal priority, no limits: what the check itself costs, nothing refused.
                    key = write_keys_file(workdir / "keys.toml", [(BENCH_TENANT, "normal")])[BENCH_TENANT]
                    extra = auth_sections(workdir / "keys.toml")
                    headers, probe_headers = bearer_header(key), {"authorization": f"Bearer {key}"}
                if settings.tracing_ratio is not None:
                    collector = CountingCollector()
                    await nursery.start(collector.serve)
                    extra = {**(extra or {}), "tracing": {"otlp_endpoint": collector.url,
                                                          "sample_ratio": settings.tracing_ratio}}
                target = await _start_target(nursery, settings, fleet, workdir, tls, extra)
                # A router started here may take a while to come up; one already running should answer now.
                for probe_body in probe_bodies:
                    await wait_until_serving(client, target, probe_body=probe_body,
                                             timeout_s=10.0 if target.kind == "external" else 60.0,
                                             headers=probe_headers)
                if settings.warmup:
                    await run_load(_spec(settings, target.host, target.port, body, requests=settings.warmup,
                                         duration_s=None, path=workload.path if workload else "/v1/completions",
                                         model_bodies=_model_bodies(settings), headers=headers),
                                   ssl_context=context, bodies=workload)
                load_started_unix = time.time()
                run, faults = await _measure(nursery, settings, fleet, target, client, body, context, workload,
                                             headers)
                timeline = await _timeline(client, target)
                if workload is not None and fleet is not None:
                    prefix = await collect_prefix_report(
                        client, [(name, fleet.engines[name].url) for name in fleet.names("prefill")], workload,
                        narwhal_url=target.url if target.is_narwhal and not settings.tls else None)
                baseline = None
                if settings.baseline == "direct":
                    assert fleet is not None
                    baseline = await _direct_baseline(settings, fleet, client, context)
                elif settings.baseline == "pair":
                    baseline = await _pair_baseline(settings, client)
            finally:
                with trio.CancelScope(shield=True):
                    if target is not None:
                        await target.stop()
                    if fleet is not None:
                        await fleet.stop()
                nursery.cancel_scope.cancel()
            record = _settings_record(settings, target)
            if collector is not None:
                # What the router exported while the bench ran (its last batch may come after the end).
                record["trace_collector"] = collector.report()
            return BenchReport(settings=record, run=run, baseline=baseline,
                               router_vs_direct=_ratios(run, baseline) if baseline else None, faults=faults,
                               timeline=timeline, load_started_unix=load_started_unix, prefix=prefix)
