"""Command line: ``python -m narwhal serve|mock-engine|demo|bench|admin|engine-check|register|keys``.

Every command exits non-zero with one plain line on stderr when its input is
wrong (a bad config names the key and the problem; no traceback).
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from narwhal import __version__
from narwhal.tools.cli_args import OneLineParser, listen_address

# Only the standard library above: main() takes SIGHUP over before trio, msgspec and the router are
# imported (about a second), so a `systemctl reload` right after a start does not kill the process.
if TYPE_CHECKING:
    from narwhal.errors import StartupError

__all__ = ["main", "serve_main"]


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the router", description="Run the Narwhal router.")
    p.add_argument("--config", required=True, metavar="FILE", help="TOML config file")
    p.add_argument("--listen", metavar="HOST:PORT", type=listen_address, help="override serving.listen")
    p.add_argument("--resume", action="store_true",
                   help="apply the saved handoff when its schema and engine set match the config")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="the least severe log events written to stderr (default info)")


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run 2 prefill + 2 decode mock engines and the router",
                       description="Start a local mock fleet and the router in front of it; Ctrl-C stops all.")
    p.add_argument("--listen", default="127.0.0.1:8000", metavar="HOST:PORT", type=listen_address,
                   help="the router's address (default 127.0.0.1:8000; port 0 picks a free one)")
    p.add_argument("--tokens", type=int, default=16, help="tokens each mock decode produces (default 16)")
    p.add_argument("--token-delay-s", type=float, default=0.02,
                   help="seconds each mock decode waits before each token (default 0.02)")


# Commands with parsers of their own: listed here for `narwhal --help`, parsed by their module.
_DELEGATED = {
    "mock-engine": "run a mock inference engine with fault injection (see: mock-engine --help)",
    "bench": "benchmark the router against a mock fleet (see: bench --help)",
}


def _build_parser() -> argparse.ArgumentParser:
    from narwhal.discovery.register import add_parser as add_register_parser
    from narwhal.tools.admin_cli import add_parser as add_admin_parser
    from narwhal.tools.engine_check import add_parser as add_engine_check_parser
    from narwhal.tools.keys_cli import add_parser as add_keys_parser

    parser = OneLineParser(prog="narwhal", description="Narwhal: a router for disaggregated LLM serving.")
    parser.add_argument("--version", action="version", version=f"narwhal {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_demo(sub)
    for name, help_text in _DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    add_admin_parser(sub)
    add_engine_check_parser(sub)
    add_register_parser(sub)
    add_keys_parser(sub)
    return parser


def _run_delegated(command: str, argv: list[str]) -> int:
    if command == "mock-engine":
        from narwhal.tools.mock.engine import main as mock_main

        return mock_main(argv)
    from narwhal.tools.bench.cli import build_parser, run_from_args

    parser = OneLineParser(prog="narwhal bench",
                           description="Measure router overhead and fault handling against a mock fleet.")
    build_parser(parser)
    return run_from_args(parser.parse_args(argv))


def _run_worker(argv: list[str]) -> int:
    # Internal: started by the controller with serving.workers > 1, never by hand.
    parser = argparse.ArgumentParser(prog="narwhal worker", description="A data-plane worker (internal).")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--listen-fd", type=int, action="append", required=True)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    import trio

    from narwhal.gc_tuning import tune_for_serving
    from narwhal.obs.logs import configure_logging
    from narwhal.workers.worker import run_worker

    configure_logging(args.log_level)
    tune_for_serving()
    trio.run(run_worker, args.index, args.control_fd, args.listen_fd)
    return 0


class _EarlySighup:
    """SIGHUP before the router's own handler: noted, and applied as one reload once the router has started."""

    arrived = False

    @classmethod
    def note(cls, signum: int, frame: object) -> None:
        cls.arrived = True


def _take_sighup(argv: list[str]) -> None:
    """From the first line of ``serve`` (and a worker) on, SIGHUP no longer has its default action (exit)."""
    command = argv[0] if argv else ""
    if command == "serve":
        # A handler, not a blocked mask or SIG_IGN: the engines and workers started later do not inherit it.
        signal.signal(signal.SIGHUP, _EarlySighup.note)
    elif command == "worker":
        # The controller reloads and tells the workers; a SIGHUP to the process group is not theirs.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _take_sighup(argv)
    try:
        return _dispatch(argv)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if not missing or missing == "narwhal":
            raise
        print(f"narwhal: missing dependency {missing!r}: install narwhal with its dependencies "
              "(pip install narwhal, not --no-deps)", file=sys.stderr)
        return 2


def _dispatch(argv: list[str]) -> int:
    if argv and argv[0] == "worker":
        return _run_worker(argv[1:])
    if argv and argv[0] in _DELEGATED:
        return _run_delegated(argv[0], argv[1:])
    args = _build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "demo":
        from narwhal.tools.demo import run_demo

        return run_demo(args)
    result: int = args.run(args)
    return result


def serve_main(argv: Sequence[str] | None = None) -> int:
    """The ``narwhal-serve`` console script: ``python -m narwhal serve``."""
    return main(["serve", *(sys.argv[1:] if argv is None else argv)])


def _serve(args: argparse.Namespace) -> int:
    import logging

    import trio

    from narwhal.config import ConfigError, load_config
    from narwhal.errors import StartupError
    from narwhal.gc_tuning import tune_for_serving
    from narwhal.obs.logs import configure_logging, flush_logs, log_event

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"narwhal: config error: {exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_level)
    from narwhal.router import Router

    try:
        router = Router(config, listen=args.listen, resume=args.resume, config_path=Path(args.config))
    except ConfigError as exc:
        # The usual place for certificate problems: load_config checks only that the TLS keys pair up,
        # the Router reads the files (missing, unreadable, a key that does not match, an expired
        # certificate). test_tls.py and test_tls_server.py check the one line and exit 2.
        print(f"narwhal: config error: {args.config}: {exc}", file=sys.stderr)
        return 2
    tune_for_serving()
    try:
        trio.run(run_until_signal, router, lambda: _EarlySighup.arrived)
    except (StartupError, BaseExceptionGroup) as exc:
        startup = _startup_error(exc)
        if startup is None:
            raise
        failed: dict[str, Any] = {"class": "StartupError", "message": str(startup)}
        log_event("router_failed", level=logging.ERROR, **failed)
        flush_logs()
        print(f"narwhal: cannot start: {startup}", file=sys.stderr)
        return 2
    except OSError as exc:
        failure: dict[str, Any] = {"class": type(exc).__name__, "message": str(exc)}
        log_event("router_failed", level=logging.ERROR, **failure)
        flush_logs()
        print(f"narwhal: {exc}", file=sys.stderr)
        return 1
    return 0


def _startup_error(exc: BaseException) -> StartupError | None:
    """The StartupError in ``exc``, unwrapping the exception groups nurseries add around it."""
    from narwhal.errors import StartupError

    if isinstance(exc, StartupError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        matched, _ = exc.split(StartupError)
        found: BaseException | None = matched
        while isinstance(found, BaseExceptionGroup):
            found = found.exceptions[0]
        return found if isinstance(found, StartupError) else None
    return None


async def run_until_signal(router: Any, early_sighup: Callable[[], bool] = lambda: False) -> None:
    """Run ``router``; the first SIGTERM/SIGINT drains it, a second one stops at once; SIGHUP reloads.

    SIGHUP reads the config file again (``Router.reload``) and then the TLS files, once the router has
    started; SIGHUPs before that (``early_sighup()`` says one came before this handler) make one reload then.
    """
    import trio

    from narwhal.obs.logs import log_event

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async with trio.open_nursery() as nursery:
            # Capacity 1: SIGHUPs while a reload is pending or running make one more reload, not a queue.
            wanted, reloads = trio.open_memory_channel[None](1)

            def want_reload() -> None:
                try:
                    wanted.send_nowait(None)
                except trio.WouldBlock:
                    pass

            if early_sighup():
                log_event("signal", signal="SIGHUP", during_startup=True)
                want_reload()

            async def watch() -> None:
                count = 0
                async for signum in signals:
                    log_event("signal", signal=signal.Signals(signum).name)
                    if signum == signal.SIGHUP:
                        want_reload()
                        continue
                    count += 1
                    if count == 1:
                        router.shutdown()
                    else:
                        nursery.cancel_scope.cancel()

            async def serve(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                await router.run(task_status=task_status)
                nursery.cancel_scope.cancel()

            async def reload_when_asked() -> None:
                async for _ in reloads:
                    await router.reload()

            nursery.start_soon(watch)
            await nursery.start(serve)
            nursery.start_soon(reload_when_asked)
