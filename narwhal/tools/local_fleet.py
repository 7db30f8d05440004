"""Start mock engines and routers as local processes: for ``demo``, ``bench`` and e2e tests.

Each process is started on port 0 and announces its bound port with one JSON
line (``mock_engine_ready`` on stdout, ``router_started`` on stderr), so
nothing here guesses free ports. ``LocalProcess.stop`` sends SIGTERM, waits,
and kills only if the process outstays its grace.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import trio

__all__ = ["LocalProcess", "render_config", "start_mock_engine", "start_mock_fleet", "start_process",
           "start_router"]

_decode_json = msgspec.json.Decoder()


class LocalProcess:
    """A child process with the port it announced and the lines it has logged."""

    def __init__(self, process: trio.Process, port: int, name: str) -> None:
        self.process = process
        self.port = port
        self.name = name
        self.lines: list[dict[str, Any]] = []
        # From the ready line's ``tls`` field: the process serves HTTPS.
        self.tls = False

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    async def stop(self, grace_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after ``grace_s``; returns the exit code."""
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            with trio.move_on_after(grace_s):
                await self.process.wait()
            if self.process.returncode is None:
                self.process.kill()
        return await self.process.wait()

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()

    def events(self, name: str, **match: Any) -> list[dict[str, Any]]:
        """The JSON lines logged so far with ``event == name`` and the given field values."""
        return [line for line in self.lines
                if line.get("event") == name and all(line.get(k) == v for k, v in match.items())]

    async def wait_event(self, name: str, *, timeout_s: float = 5.0, **match: Any) -> list[dict[str, Any]]:
        """Wait until a matching line has been logged (lines are batched for up to ~100 ms)."""
        with trio.move_on_after(timeout_s):
            while not (found := self.events(name, **match)):
                await trio.sleep(0.02)
            return found
        return []


async def _read_lines(stream: trio.abc.ReceiveStream, sink: list[dict[str, Any]],
                      ready: str, found: trio.Event, found_line: list[dict[str, Any]],
                      echo: Any = None) -> None:
    """Collect JSON lines from ``stream`` until EOF; flag the first ``ready`` event."""
    buffer = b""
    async for data in stream:
        buffer += data
        *complete, buffer = buffer.split(b"\n")
        for raw in complete:
            if echo is not None:
                echo.write(raw.decode(errors="replace") + "\n")
                echo.flush()
            try:
                line = _decode_json.decode(raw)
            except msgspec.DecodeError:
                continue
            if not isinstance(line, dict):
                continue
            sink.append(line)
            if not found.is_set() and line.get("event") == ready:
                found_line.append(line)
                found.set()
    found.set()


async def _start(nursery: trio.Nursery, argv: Sequence[str], *, ready: str, from_stderr: bool,
                 name: str, timeout_s: float, env: Mapping[str, str] | None,
                 echo: Any = None) -> LocalProcess:
    child_env = dict(os.environ)
    child_env.update(env or {})
    process = await trio.lowlevel.open_process(
        list(argv),
        stdout=subprocess.PIPE if not from_stderr else subprocess.DEVNULL,
        stderr=subprocess.PIPE if from_stderr else None,
        env=child_env,
        start_new_session=True,
    )
    stream = process.stderr if from_stderr else process.stdout
    if stream is None:
        raise RuntimeError(f"{name}: no pipe to read its events from")
    found = trio.Event()
    found_line: list[dict[str, Any]] = []
    local = LocalProcess(process, 0, name)
    nursery.start_soon(_read_lines, stream, local.lines, ready, found, found_line, echo)
    with trio.move_on_after(timeout_s):
        await found.wait()
    if not found_line:
        process.kill()
        await process.wait()
        raise RuntimeError(f"{name} did not report {ready!r} within {timeout_s} s "
                           f"(exit code {process.returncode})")
    line = found_line[0]
    local.tls = bool(line.get("tls", False))
    if "port" in line:
        local.port = int(line["port"])
    elif "listen" in line:
        local.port = int(str(line["listen"]).rpartition(":")[2])
    return local


async def start_process(nursery: trio.Nursery, argv: Sequence[str], *, ready: str, name: str,
                        env: Mapping[str, str] | None = None, timeout_s: float = 20.0) -> LocalProcess:
    """Start any process that prints a JSON ``ready`` event with its ``port`` on stdout; wait for it."""
    return await _start(nursery, argv, ready=ready, from_stderr=False, name=name, timeout_s=timeout_s, env=env)


async def start_mock_engine(nursery: trio.Nursery, role: str, *, engine_id: str | None = None,
                            args: Sequence[str] = (), port: int = 0, timeout_s: float = 20.0) -> LocalProcess:
    """Start ``python -m narwhal mock-engine`` and wait for its ready line."""
    argv = [sys.executable, "-m", "narwhal", "mock-engine", "--port", str(port), "--role", role]
    if engine_id:
        argv += ["--engine-id", engine_id]
    argv += list(args)
    return await _start(nursery, argv, ready="mock_engine_ready", from_stderr=False,
                        name=engine_id or f"mock-{role}", timeout_s=timeout_s, env=None)


async def start_mock_fleet(nursery: trio.Nursery, prefill: int, decode: int, *, args: Sequence[str] = (),
                           timeout_s: float = 60.0) -> tuple[LocalProcess, list[tuple[str, str, str]]]:
    """Start one mock-engine process serving ``prefill`` + ``decode`` engines (``--engines``).

    Returns the process and its engines as (engine_id, url, role), prefill first, as ``render_config`` takes them.
    """
    total = prefill + decode
    argv = [sys.executable, "-m", "narwhal", "mock-engine", "--port", "0", "--engines", str(total),
            "--prefill-engines", str(prefill), *args]
    process = await _start(nursery, argv, ready="mock_fleet_ready" if total > 1 else "mock_engine_ready",
                           from_stderr=False, name=f"mock-fleet-{total}", timeout_s=timeout_s, env=None)
    engines = [(str(line["engine_id"]), f"{'https' if line.get('tls') else 'http'}://127.0.0.1:{line['port']}",
                str(line["role"])) for line in process.events("mock_engine_ready")]
    if len(engines) != total:
        process.kill()
        raise RuntimeError(f"mock fleet reported {len(engines)} engines of {total}")
    return process, engines


async def start_router(nursery: trio.Nursery, config_path: str, *, args: Sequence[str] = (),
                       listen: str = "127.0.0.1:0", timeout_s: float = 20.0,
                       env: Mapping[str, str] | None = None, echo: Any = None) -> LocalProcess:
    """Start ``python -m narwhal serve`` and wait for its ``router_started`` event."""
    argv = [sys.executable, "-m", "narwhal", "serve", "--config", config_path, "--listen", listen, *args]
    return await _start(nursery, argv, ready="router_started", from_stderr=True, name="router",
                        timeout_s=timeout_s, env=env, echo=echo)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("TOML has no place for a non-finite number here")
        return repr(value)
    if isinstance(value, str):
        return msgspec.json.encode(value).decode()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def render_config(engines: Sequence[tuple[str, str, str] | tuple[str, str, str, str]
                                   | tuple[str, str, str, str, Mapping[str, Any]]],
                  sections: Mapping[str, Mapping[str, Any]] | None = None,
                  models: Sequence[Mapping[str, Any]] = ()) -> str:
    """A config file for ``engines`` as (name, url, role), (name, url, role, model) or (name, url, role, model,
    other keys), with extra ``sections`` and ``[[fleet.models]]`` entries (``models``, after the sections)."""
    lines: list[str] = []
    for section, values in (sections or {}).items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in values.items() if value is not None)
        lines.append("")
    for model in models:
        lines.append("[[fleet.models]]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in model.items() if value is not None)
        lines.append("")
    for engine in engines:
        name, url, role = engine[0], engine[1], engine[2]
        lines += ["[[engines]]", f"name = {_toml_value(name)}", f"url = {_toml_value(url)}",
                  f"role = {_toml_value(role)}"]
        if len(engine) > 3:
            lines.append(f"model = {_toml_value(engine[3])}")
        if len(engine) > 4:
            extra: Mapping[str, Any] = engine[4]
            lines.extend(f"{key} = {_toml_value(value)}" for key, value in extra.items() if value is not None)
        lines.append("")
    return "\n".join(lines)
