"""Run test files in a process where only the Python twins of the compiled modules run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def pass_with_only_python(files: list[str], check: str, *, timeout_s: float) -> None:
    """``check`` (Python source asserting the twins run) and then ``files`` pass with NARWHAL_NO_EXTENSIONS set."""
    env = {**os.environ, "NARWHAL_NO_EXTENSIONS": "1"}
    subprocess.run([sys.executable, "-c", check], env=env, cwd=REPO, check=True)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *files],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
