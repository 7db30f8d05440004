"""``python -m narwhal demo``: a mock fleet (2 prefill, 2 decode) and the router, until Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import tempfile
from pathlib import Path

import trio

from narwhal.config import parse_listen
from narwhal.obs.logs import configure_logging, flush_logs, log_event
from narwhal.tools.admin_cli import DEFAULT_URL
from narwhal.tools.local_fleet import LocalProcess, render_config, start_mock_engine, start_router

__all__ = ["banner", "run_demo", "watch_engine"]


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit status."""
    try:
        host, port = parse_listen(args.listen)
    except ValueError as exc:
        print(f"narwhal demo: --listen: {exc}", file=sys.stderr)
        return 2
    # Before any engine starts: a taken port (8000 is vLLM's default too) is one line, at once.
    problem = _listen_problem(host, port)
    if problem is not None:
        print(f"narwhal demo: cannot listen on {args.listen}: {problem}; "
              f"choose a free address with --listen HOST:PORT (e.g. --listen {host}:0 for any free port)",
              file=sys.stderr)
        return 2
    # The demo's own events (an engine that died) as JSON lines on stderr, beside the router's.
    configure_logging("info")
    try:
        trio.run(_demo, args)
    except (RuntimeError, BaseExceptionGroup) as exc:
        failure = _runtime_error(exc)
        if failure is None:
            raise
        print(f"narwhal demo: {failure}", file=sys.stderr)
        return 1
    return 0


def _listen_problem(host: str, port: int) -> str | None:
    """Why the router could not bind ``host:port`` (as it binds: SO_REUSEADDR), or None when it can."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        return str(exc.strerror or exc)
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            return str(exc.strerror or exc)
    return None


def _runtime_error(exc: BaseException) -> RuntimeError | None:
    """The RuntimeError (a process that did not start) in ``exc``, unwrapping nursery groups."""
    if isinstance(exc, RuntimeError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        matched, rest = exc.split(RuntimeError)
        if rest is not None or matched is None:
            return None
        found: BaseException = matched
        while isinstance(found, BaseExceptionGroup):
            found = found.exceptions[0]
        return found if isinstance(found, RuntimeError) else None
    return None


def banner(url: str, config_path: Path) -> str:
    """What the demo prints once serving: where to send requests, the fleet page, the config, the admin CLI."""
    # `narwhal admin` reaches http://127.0.0.1:8000 by default; any other address needs --url.
    url_option = "" if url == DEFAULT_URL else f" --url {url}"
    return (f"\nNarwhal is serving at {url} (model 'mock-model'); Ctrl-C stops everything.\n"
            f"Fleet page: {url}/admin/ui\n"
            f"Config: {config_path} (removed on exit; edit it, then: narwhal admin reload{url_option})\n"
            f"Try:\n  curl -N {url}/v1/completions -H 'content-type: application/json' "
            f"-d '{{\"model\": \"mock-model\", \"prompt\": \"Hello\", \"max_tokens\": 8, "
            f"\"stream\": true}}'\n  curl {url}/admin/engines\n  narwhal admin engines{url_option}\n")


async def watch_engine(engine: LocalProcess, stopping: trio.Event) -> None:
    """Log ``demo_engine_exited`` when ``engine`` exits before the demo stops it; its requests now fail."""
    code = await engine.process.wait()
    if not stopping.is_set():
        log_event("demo_engine_exited", level=logging.WARNING, name=engine.name, pid=engine.pid, exit_code=code,
                  message=f"mock engine {engine.name} (pid {engine.pid}) exited with code {code}; the router "
                          "ejects it, and the demo goes on with the others until Ctrl-C")
        flush_logs()


async def _demo(args: argparse.Namespace) -> None:
    mock_args = ["--tokens", str(args.tokens), "--token-delay-s", str(args.token_delay_s)]
    with tempfile.TemporaryDirectory(prefix="narwhal-demo-") as workdir, \
            trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            engines: list[LocalProcess] = []
            stopping = trio.Event()
            try:
                for role, count in (("prefill", 2), ("decode", 2)):
                    for i in range(1, count + 1):
                        engine = await start_mock_engine(nursery, role, engine_id=f"{role[0]}{i}", args=mock_args)
                        engines.append(engine)
                        nursery.start_soon(watch_engine, engine, stopping)
                config_path = Path(workdir) / "narwhal.toml"
                config_path.write_text(render_config(
                    [(e.name, e.url, "prefill" if e.name.startswith("p") else "decode") for e in engines],
                    {"serving": {"listen": args.listen},
                     # The mock engines sign attestations with this key by default.
                     "fleet": {"attestation_key": "narwhal-dev-key"},
                     "handoff": {"path": str(Path(workdir) / "handoff.json")}},
                ))
                router = await start_router(nursery, str(config_path), listen=args.listen, echo=sys.stderr)
                url = f"http://{args.listen.rpartition(':')[0]}:{router.port}"
                print(banner(url, config_path), flush=True)
                async for _ in signals:
                    break
                print("\nstopping...", flush=True)
                await router.stop()
            finally:
                stopping.set()
                with trio.CancelScope(shield=True):
                    for engine in engines:
                        await engine.stop()
            nursery.cancel_scope.cancel()
