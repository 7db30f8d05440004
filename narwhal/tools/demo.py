"""``python -m narwhal demo``: a mock fleet (2 prefill, 2 decode) and the router, until Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
from pathlib import Path

import trio

from narwhal.config import parse_listen
from narwhal.tools.local_fleet import LocalProcess, render_config, start_mock_engine, start_router

__all__ = ["run_demo"]


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit status."""
    try:
        parse_listen(args.listen)
    except ValueError as exc:
        print(f"narwhal demo: --listen: {exc}", file=sys.stderr)
        return 2
    try:
        trio.run(_demo, args)
    except RuntimeError as exc:
        print(f"narwhal demo: {exc}", file=sys.stderr)
        return 1
    return 0


async def _demo(args: argparse.Namespace) -> None:
    mock_args = ["--tokens", str(args.tokens), "--token-delay-s", str(args.token_delay_s)]
    with tempfile.TemporaryDirectory(prefix="narwhal-demo-") as workdir, \
            trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            engines: list[LocalProcess] = []
            try:
                for role, count in (("prefill", 2), ("decode", 2)):
                    for i in range(1, count + 1):
                        engines.append(await start_mock_engine(nursery, role, engine_id=f"{role[0]}{i}",
                                                               args=mock_args))
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
                print(f"\nNarwhal is serving at {url} (model 'mock-model'); Ctrl-C stops everything.\n"
                      f"Try:\n  curl -N {url}/v1/completions -H 'content-type: application/json' "
                      f"-d '{{\"model\": \"mock-model\", \"prompt\": \"Hello\", \"max_tokens\": 8, "
                      f"\"stream\": true}}'\n  curl {url}/admin/engines\n", flush=True)
                async for _ in signals:
                    break
                print("\nstopping...", flush=True)
                await router.stop()
            finally:
                with trio.CancelScope(shield=True):
                    for engine in engines:
                        await engine.stop()
            nursery.cancel_scope.cancel()
