"""Router overhead in front of real vLLM on CPU: ``python -m narwhal bench --target`` at a Narwhal router in front
of the real-vLLM tier's fleet, with the same load through the engine pair with no router as the baseline.

    python3 bench/real_vllm.py [--decode 1] [BENCH OPTIONS...]     # e.g. --tokens 32 --concurrency 4

It builds or finds the tier's cached venv and model (tests/real_vllm/setup_env.py), takes the machine's real-vLLM
lock, starts 1 prefill + N decode engines (the tier's command line), a router in front of them, then runs
``python -m narwhal bench --target ROUTER --model tiny-llama --baseline pair --pair PREFILL DECODE1 ...`` with
the venv's python and prints its table.  Everything it started is stopped at the end.  With several decode
engines the router spreads the load while the pair baseline uses the first one only: use --decode 1 for a
like-for-like comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    """Outside the venv (standard library only): set up, take the lock, run the rest in the venv."""
    from tests.real_vllm.run import lock, setup

    env = setup()
    if isinstance(env, str):
        print(f"bench/real_vllm.py: cannot build the environment: {env}", file=sys.stderr)
        return 3
    fd = lock(3600.0)
    try:
        return subprocess.run([env["python"], __file__, "--inner", env["model"], *sys.argv[1:]],
                              env={**os.environ, "PYTHONPATH": str(REPO)}).returncode
    finally:
        os.close(fd)


def inner(model: str, argv: list[str]) -> int:
    """In the venv, holding the lock: the fleet, the router, the benchmark."""
    from tests.real_vllm.fleet import MODEL_NAME, running_fleet

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the benchmark this many times in a row (router, pair, router, pair, ...), "
                             "each with --json PREFIX.N.json when --json-prefix is given")
    parser.add_argument("--json-prefix", help="write round N's figures to PREFIX.N.json")
    args, bench_args = parser.parse_known_args(argv)
    python = sys.executable
    with tempfile.TemporaryDirectory(prefix="narwhal-real-vllm-bench-") as tmp, \
            running_fleet(python, model, Path(tmp), prefill=1, decode=args.decode) as fleet:
        config = Path(tmp) / "narwhal.toml"
        config.write_text(fleet.router_config(Path(tmp) / "handoff.json"))
        child_env = {**os.environ, "PYTHONPATH": str(REPO)}
        with (Path(tmp) / "router.log").open("w") as log:
            router = subprocess.Popen([python, "-m", "narwhal", "serve", "--config", str(config), "--listen",
                                       "127.0.0.1:0"], stderr=log, env=child_env, start_new_session=True)
            try:
                url = _router_url(Path(tmp) / "router.log", router)
                status = 0
                for n in range(1, args.rounds + 1):
                    out = ["--json", f"{args.json_prefix}.{n}.json"] if args.json_prefix else []
                    cmd = [python, "-m", "narwhal", "bench", "--target", url, "--target-pid", str(router.pid),
                           "--model", MODEL_NAME, "--baseline", "pair", "--pair", fleet["p1"].url,
                           fleet["d1"].url, *bench_args, *out]
                    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
                    status = status or subprocess.run(cmd, env=child_env, cwd=REPO).returncode
                return status
            finally:
                router.send_signal(signal.SIGTERM)
                try:
                    router.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    router.kill()


def _router_url(log_path: Path, router: subprocess.Popen[bytes], timeout_s: float = 60.0) -> str:
    """The router's URL from its ``router_started`` line, once it serves a completion."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if router.poll() is not None:
            raise RuntimeError(f"the router exited ({router.returncode}): {log_path.read_text()[-2000:]}")
        for line in log_path.read_text().splitlines():
            if '"router_started"' in line:
                url = "http://" + json.loads(line)["listen"]
                with httpx.Client(timeout=5.0) as client:
                    if client.get(f"{url}/ready").status_code == 200:
                        return url
        time.sleep(0.2)
    raise RuntimeError(f"the router did not become ready within {timeout_s:g} s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--inner"]:
        sys.exit(inner(sys.argv[2], sys.argv[3:]))
    sys.exit(main())
