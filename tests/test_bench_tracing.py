"""``narwhal bench --tracing-ratio``: the router started here traces at that ratio and exports to a collector."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from narwhal.tools.bench.cli import build_parser, settings_from_args

REPO = Path(__file__).resolve().parents[1]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    build_parser(parser)
    return parser.parse_args(list(argv))


def test_the_ratio_is_a_setting() -> None:
    assert settings_from_args(_args()).tracing_ratio is None
    assert settings_from_args(_args("--tracing-ratio", "0.01")).tracing_ratio == 0.01


@pytest.mark.parametrize("argv", [
    ("--tracing-ratio", "1.5"),
    ("--tracing-ratio", "-0.1"),
    ("--tracing-ratio", "1", "--target", "http://127.0.0.1:1"),
    ("--tracing-ratio", "1", "--router-cmd", "vllm-router --port {port}"),
    ("--tracing-ratio", "1", "--scenario", "fleet"),
])
def test_bad_combinations(argv: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="--tracing-ratio"):
        settings_from_args(_args(*argv))


@pytest.mark.e2e
def test_a_load_with_tracing_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, "-m", "narwhal", "bench", "--tracing-ratio", "1.0", "--requests", "100",
                           "--concurrency", "4", "--json", str(out), "--quiet"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "narwhal (tracing 1)" in done.stdout.splitlines()[0]
    report = json.loads(out.read_text())
    assert (report["run"]["load"]["ok"], report["run"]["load"]["errors"]) == (100, 0)
    assert report["settings"]["tracing_ratio"] == 1.0
    assert report["settings"]["trace_collector"]["exports"] >= 1
