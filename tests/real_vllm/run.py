"""Run the real-vLLM tier in one command: build or find its cached venv and model, take the machine's real-vLLM
lock, and run pytest in that venv.  Standard library only, so any python3 can start it::

    python3 tests/real_vllm/run.py [PYTEST ARGS...]      # e.g. -k token_ids, -x

If the environment cannot be built here (no python3.11, a package the registry does not have), the tier is
SKIPPED, loudly, with the reason, and the exit status is 0; set NARWHAL_REAL_VLLM_REQUIRED=1 to make that a
failure (exit 3) instead.  Only one real-vLLM fleet may run on a machine at a time: the run holds
``/tmp/narwhal-vllm.lock`` (flock) for its whole duration, waiting at most $NARWHAL_REAL_VLLM_LOCK_WAIT_S
(default 3600 s) for it.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
LOCK_PATH = os.environ.get("NARWHAL_REAL_VLLM_LOCK", "/tmp/narwhal-vllm.lock")
EXIT_UNAVAILABLE = 3


def banner(text: str) -> None:
    line = "!" * 78
    print(f"\n{line}\n{text}\n{line}\n", file=sys.stderr, flush=True)


def setup() -> dict[str, str] | str:
    """The environment (python, model) from setup_env.py, or the reason it cannot be had."""
    done = subprocess.run([sys.executable, str(HERE / "setup_env.py"), "--json"], capture_output=True,
                          text=True)
    sys.stderr.write(done.stderr)
    if done.returncode != 0:
        reasons = [line for line in done.stderr.splitlines() if "UNAVAILABLE" in line]
        return reasons[-1] if reasons else f"setup_env.py exited {done.returncode}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def lock(deadline_s: float) -> int:
    """Take the machine-wide real-vLLM lock, waiting at most ``deadline_s``; the open descriptor."""
    fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o666)
    give_up = time.monotonic() + deadline_s
    told = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > give_up:
                os.close(fd)
                raise TimeoutError(f"{LOCK_PATH} still held by another real-vLLM run after {deadline_s:g} s") from None
            if not told:
                print(f"[real-vllm] waiting for {LOCK_PATH} (another real-vLLM fleet is running)", file=sys.stderr,
                      flush=True)
                told = True
            time.sleep(1.0)


def main(argv: list[str]) -> int:
    started = time.monotonic()
    env = setup()
    if isinstance(env, str):
        banner(f"REAL-VLLM TIER SKIPPED: its environment cannot be built on this machine.\n{env}")
        return EXIT_UNAVAILABLE if os.environ.get("NARWHAL_REAL_VLLM_REQUIRED") == "1" else 0
    setup_s = time.monotonic() - started
    print(f"[real-vllm] setup {setup_s:.1f} s; python {env['python']}; model {env['model']}", file=sys.stderr,
          flush=True)
    fd = lock(float(os.environ.get("NARWHAL_REAL_VLLM_LOCK_WAIT_S", "3600")))
    try:
        child_env = dict(os.environ)
        child_env["NARWHAL_REAL_VLLM_MODEL"] = env["model"]
        child_env["PYTHONPATH"] = str(REPO)
        # The run's files (engine logs, router configs) stay until the next run, out of the shared pytest
        # temp root whose rotation other test runs on the machine would soon delete them in.
        basetemp = Path(env["model"]).parent / "last-run"
        cmd = [env["python"], "-m", "pytest", "-m", "real_vllm", "-p", "no:cacheprovider", "-v",
               f"--basetemp={basetemp}", str(HERE.relative_to(REPO)), *argv]
        print(f"[real-vllm] engine logs and router configs: {basetemp}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        code = subprocess.run(cmd, cwd=REPO, env=child_env).returncode
        print(f"[real-vllm] tier {time.monotonic() - t0:.1f} s (setup {setup_s:.1f} s)", file=sys.stderr,
              flush=True)
        return code
    finally:
        os.close(fd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
