"""What the benchmark loads: a mock fleet of local processes and the router in front of it.

The router is one of three targets: Narwhal started here with a generated
config, any other router started here from a command template (``--router-cmd``,
for vllm-router and sglang-router), or a router already running (``--target``).
Everything started here is stopped here: SIGTERM to its process group, then
SIGKILL after a grace period.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio

from narwhal.errors import NarwhalError
from narwhal.tools.bench.procstat import listening_pid
from narwhal.tools.local_fleet import LocalProcess, render_config, start_mock_engine, start_mock_fleet

__all__ = [
    "ATTESTATION_KEY",
    "BenchFleet",
    "CommandTemplateError",
    "Target",
    "command_for",
    "external_target",
    "free_port",
    "make_workdir",
    "narwhal_sections",
    "probe_completion",
    "start_command_router",
    "start_fleet",
    "start_narwhal",
    "start_shared_fleet",
    "wait_until_serving",
]

_decode_json = msgspec.json.Decoder().decode

# The mock engine's default attestation key: the router needs it to readmit engines.
ATTESTATION_KEY = "narwhal-dev-key"


class BenchFleet:
    """The mock engines, by name (``p1``, ``d1``, ...), with the arguments to restart them alike."""

    def __init__(self, engines: dict[str, LocalProcess], roles: dict[str, str], mock_args: Sequence[str],
                 models: dict[str, str] | None = None) -> None:
        self.engines = engines
        self.roles = roles
        self.mock_args = list(mock_args)
        # Several models (bench --models): each engine's model, by name; empty: every engine serves the one
        # model, named by neither the mock's arguments nor the router's config (as before).
        self.models: dict[str, str] = models if models is not None else {}
        # Killed processes, reaped at stop.
        self.retired: list[LocalProcess] = []

    def names(self, role: str) -> list[str]:
        return [name for name, r in self.roles.items() if r == role]

    def urls(self, role: str) -> list[str]:
        return [self.engines[name].url for name in self.names(role)]

    def described(self) -> list[tuple[str, str, str] | tuple[str, str, str, str]]:
        """(name, url, role), or (name, url, role, model) with several models, per engine: ``render_config``'s."""
        return [(name, self.engines[name].url, role, self.models[name]) if name in self.models
                else (name, self.engines[name].url, role) for name, role in self.roles.items()]

    def engine_args(self, name: str) -> list[str]:
        """The mock's arguments for engine ``name``: the fleet's, plus its model when it names one."""
        model = self.models.get(name)
        return [*self.mock_args, "--model", model] if model is not None else self.mock_args

    async def restart(self, nursery: trio.Nursery, name: str) -> LocalProcess:
        """Start ``name`` again on its old port (after it was killed), as a new process."""
        old = self.engines[name]
        self.retired.append(old)
        engine = await start_mock_engine(nursery, self.roles[name], engine_id=name, args=self.engine_args(name),
                                         port=old.port)
        self.engines[name] = engine
        return engine

    async def stop(self) -> None:
        for engine in [*self.engines.values(), *self.retired]:
            await engine.stop(grace_s=5.0)


async def start_fleet(nursery: trio.Nursery, *, prefill: int, decode: int,
                      mock_args: Sequence[str], models: Sequence[str] = ()) -> BenchFleet:
    """Start ``prefill`` + ``decode`` mock engines; each announces its own port.

    ``models`` (two or more): that many prefill + decode engines per model, ``m1-p1``, ``m1-d1``, ``m2-p1``...
    """
    engines: dict[str, LocalProcess] = {}
    roles: dict[str, str] = {}
    fleet = BenchFleet(engines, roles, mock_args)
    several = len(models) > 1
    try:
        for index, model in enumerate(models if several else [""], start=1):
            for role, count in (("prefill", prefill), ("decode", decode)):
                for i in range(1, count + 1):
                    name = f"m{index}-{role[0]}{i}" if several else f"{role[0]}{i}"
                    if several:
                        fleet.models[name] = model
                    engines[name] = await start_mock_engine(nursery, role, engine_id=name,
                                                            args=fleet.engine_args(name))
                    roles[name] = role
    except BaseException:
        with trio.CancelScope(shield=True):
            await fleet.stop()
        raise
    return fleet


async def start_shared_fleet(nursery: trio.Nursery, *, prefill: int, decode: int,
                             mock_args: Sequence[str]) -> BenchFleet:
    """Start ``prefill`` + ``decode`` mock engines in one process (``--engines``); named by their engine ids.

    Every engine's LocalProcess is that one process, so stopping any stops all (it cannot ``restart``).
    """
    process, described = await start_mock_fleet(nursery, prefill, decode, args=mock_args)
    engines: dict[str, LocalProcess] = {}
    roles: dict[str, str] = {}
    for name, url, role in described:
        engine = LocalProcess(process.process, int(url.rpartition(":")[2]), name)
        engine.tls = url.startswith("https:")
        engines[name], roles[name] = engine, role
    return BenchFleet(engines, roles, mock_args)


class Target:
    """A router to load: its URL, the pid whose CPU is measured, and how to stop it."""

    def __init__(self, *, kind: str, url: str, pid: int | None, process: trio.Process | None = None,
                 command: list[str] | None = None, log_path: Path | None = None) -> None:
        self.kind = kind
        self.set_url(url)
        self.pid = pid
        self.process = process
        self.command = command
        self.log_path = log_path

    def set_url(self, url: str) -> None:
        self.url = url.rstrip("/")
        parsed = httpx.URL(self.url)
        self.host = parsed.host
        self.port = parsed.port or (443 if parsed.scheme == "https" else 80)

    @property
    def is_narwhal(self) -> bool:
        return self.kind == "narwhal"

    @property
    def log_lines(self) -> list[dict[str, Any]]:
        """The JSON lines a Narwhal router started here has logged so far (read from its log file)."""
        if not self.is_narwhal or self.log_path is None or not self.log_path.exists():
            return []
        lines = []
        for raw in self.log_path.read_bytes().splitlines():
            try:
                line = _decode_json(raw)
            except msgspec.DecodeError:
                continue
            if isinstance(line, dict):
                lines.append(line)
        return lines

    async def stop(self) -> None:
        if self.process is not None:
            await _stop_group(self.process, grace_s=10.0)


async def _stop_group(process: trio.Process, grace_s: float) -> None:
    """SIGTERM the process group this benchmark started, then SIGKILL it if it outstays ``grace_s``."""
    if process.returncode is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        with trio.move_on_after(grace_s):
            await process.wait()
        if process.returncode is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    await process.wait()


def narwhal_sections(workdir: Path, *, count_tokens: bool,
                     overrides: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """The config sections of a benchmarked Narwhal router; ``overrides`` (from ``--set``) win."""
    sections: dict[str, dict[str, Any]] = {
        "serving": {"count_tokens": count_tokens, "shutdown_grace_s": 2.0},
        "fleet": {"attestation_key": ATTESTATION_KEY},
        "handoff": {"path": str(workdir / "handoff.json")},
    }
    for section, values in (overrides or {}).items():
        sections.setdefault(section, {}).update(values)
    return sections


async def start_narwhal(nursery: trio.Nursery, fleet: BenchFleet, workdir: Path,
                        sections: Mapping[str, Mapping[str, Any]], *, timeout_s: float = 30.0,
                        scheme: str = "http") -> Target:
    """Write a config for ``fleet`` and start ``python -m narwhal serve`` on a free port.

    Its logs go to ``router.log`` in ``workdir``, not to a pipe: a pipe read by
    this process would cost the load generator CPU, and a full one would stall
    the router's event loop on its own log writes.
    """
    config_path = workdir / "narwhal.toml"
    config_path.write_text(render_config(fleet.described(), sections))
    log_path = workdir / "router.log"
    argv = [sys.executable, "-m", "narwhal", "serve", "--config", str(config_path), "--listen", "127.0.0.1:0"]
    with open(log_path, "wb") as log:
        process = await trio.lowlevel.open_process(argv, stdout=subprocess.DEVNULL, stderr=log,
                                                   stdin=subprocess.DEVNULL, start_new_session=True)
    target = Target(kind="narwhal", url="http://127.0.0.1:0", pid=process.pid, process=process,
                    command=argv, log_path=log_path)
    with trio.move_on_after(timeout_s):
        while process.returncode is None:
            started = next((line for line in target.log_lines if line.get("event") == "router_started"), None)
            if started is not None:
                target.set_url(f"{scheme}://" + str(started["listen"]))
                return target
            await trio.sleep(0.05)
    if process.returncode is not None:
        raise RuntimeError(f"the router exited with status {process.returncode} before it started"
                           f"{_log_tail(target)}")
    await _stop_group(process, grace_s=2.0)
    raise RuntimeError(f"the router did not start within {timeout_s:g} s (exit status {process.returncode})"
                       f"{_log_tail(target)}")


def check_overrides(overrides: Mapping[str, Mapping[str, Any]]) -> None:
    """Refuse ``--set`` values the router would refuse (ConfigError), before anything starts."""
    from narwhal.config import ConfigError, parse_config

    engines = [("p1", "http://127.0.0.1:1", "prefill"), ("d1", "http://127.0.0.1:2", "decode")]
    try:
        text = render_config(engines, narwhal_sections(Path("."), count_tokens=True, overrides=overrides))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"--set: {exc}") from None
    parse_config(text, "--set")


def free_port() -> int:
    """A port that was free a moment ago, for routers that cannot bind port 0 and report it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class CommandTemplateError(NarwhalError, ValueError):
    """A ``--router-cmd`` template names a placeholder the benchmark does not fill."""


def command_for(template: str, fleet: BenchFleet, *, port: int, metrics_port: int,
                keys_file: Path | None = None) -> list[str]:
    """Fill a ``--router-cmd`` template and split it into argv.

    Placeholders: ``{port}``, ``{metrics_port}``, ``{prefill_flags}`` (``--prefill URL``
    per prefill engine), ``{prefill_flags_bootstrap}`` (``--prefill URL 8998``, for
    sglang-router), ``{decode_flags}``, ``{prefill_urls}``, ``{decode_urls}``, and
    ``{prefill[0]}``/``{decode[0]}`` for single engines; with ``bench --auth``, ``{keys_file}`` (the
    keys file of the key the clients send).
    """
    prefill, decode = fleet.urls("prefill"), fleet.urls("decode")
    values = {
        "port": port, "metrics_port": metrics_port, "prefill": prefill, "decode": decode,
        "prefill_urls": " ".join(prefill), "decode_urls": " ".join(decode),
        "prefill_flags": " ".join(f"--prefill {url}" for url in prefill),
        "prefill_flags_bootstrap": " ".join(f"--prefill {url} 8998" for url in prefill),
        "decode_flags": " ".join(f"--decode {url}" for url in decode),
    }
    if keys_file is not None:
        values["keys_file"] = str(keys_file)
    try:
        return shlex.split(template.format(**values))
    except (KeyError, IndexError) as exc:
        raise CommandTemplateError(f"--router-cmd: unknown placeholder {exc}") from None


async def start_command_router(nursery: trio.Nursery, template: str, fleet: BenchFleet, workdir: Path,
                               keys_file: Path | None = None) -> Target:
    """Start another router from a command template; its output goes to ``router.log`` in ``workdir``."""
    port, metrics_port = free_port(), free_port()
    argv = command_for(template, fleet, port=port, metrics_port=metrics_port, keys_file=keys_file)
    log_path = workdir / "router.log"
    with open(log_path, "wb") as log:
        process = await trio.lowlevel.open_process(argv, stdout=log, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL, start_new_session=True)
    return Target(kind="command", url=f"http://127.0.0.1:{port}", pid=process.pid, process=process,
                  command=argv, log_path=log_path)


def external_target(url: str, pid: int | None) -> Target:
    """A router already running at ``url``; its CPU is measured when its pid is given or found by port."""
    target = Target(kind="external", url=url, pid=None)
    if pid is None and target.host in ("127.0.0.1", "localhost"):
        pid = listening_pid(target.port)
    target.pid = pid
    return target


async def probe_completion(client: httpx.AsyncClient, url: str, *, body: bytes,
                           headers: Mapping[str, str] | None = None) -> bool:
    """One streamed completion through ``url`` (with ``headers`` too); True when it ended with ``data: [DONE]``."""
    try:
        async with client.stream("POST", url + "/v1/completions", content=body,
                                 headers={"content-type": "application/json", **(headers or {})}) as response:
            if response.status_code != 200:
                await response.aread()
                return False
            text = b"".join([chunk async for chunk in response.aiter_bytes()])
    except httpx.HTTPError:
        return False
    return text.rstrip().endswith(b"data: [DONE]")


async def wait_until_serving(client: httpx.AsyncClient, target: Target, *, probe_body: bytes,
                             timeout_s: float = 60.0, headers: Mapping[str, str] | None = None) -> None:
    """Wait until ``target`` serves: ``/ready`` 200 for Narwhal, then a streamed completion for any router."""
    if target.kind == "external":
        # A router that is already running answers at once; a refused connection will not change in 10 s.
        try:
            await client.get(target.url + "/health")
        except httpx.ConnectError as exc:
            raise RuntimeError(f"nothing answers at {target.url}: {exc or 'connection refused'}") from None
        except httpx.HTTPError:
            pass
    with trio.move_on_after(timeout_s) as scope:
        if target.is_narwhal:
            while True:
                try:
                    if (await client.get(target.url + "/ready")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await trio.sleep(0.1)
        while not await probe_completion(client, target.url, body=probe_body, headers=headers):
            if target.process is not None and target.process.returncode is not None:
                raise RuntimeError(f"the router exited with status {target.process.returncode} before serving"
                                   f"{_log_tail(target)}")
            await trio.sleep(0.2)
    if scope.cancelled_caught:
        raise RuntimeError(f"the router at {target.url} did not serve a completion within {timeout_s:g} s"
                           f"{_log_tail(target)}")


def _log_tail(target: Target, max_chars: int = 3000) -> str:
    """The end of a router's log, for an error message (the log's directory is about to go)."""
    if target.log_path is None or not target.log_path.exists():
        return ""
    return "; the end of its log:\n" + target.log_path.read_text(errors="replace")[-max_chars:]


def make_workdir() -> tempfile.TemporaryDirectory[str]:
    """A scratch directory for the config, the handoff and router logs."""
    return tempfile.TemporaryDirectory(prefix="narwhal-bench-")
