"""One mock-engine process serving many engines (``--engines``): each on its own port, with its own identity."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal.tools.cli_args import OneLineParser
from narwhal.tools.mock.engine import _fleet_from_args, build_parser, main

PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}


def fleet(*argv: str) -> list[Any]:
    return _fleet_from_args(build_parser(OneLineParser(prog="mock")).parse_args(list(argv)))


def test_one_engine_is_what_it_always_was() -> None:
    [only] = fleet("--role", "prefill", "--port", "8100", "--engine-id", "p1")
    assert (only.role, only.port, only.engine_id) == ("prefill", 8100, "p1")


def test_engines_get_their_roles_ports_and_ids() -> None:
    engines = fleet("--engines", "4", "--prefill-engines", "1", "--port", "9000", "--engine-id", "m",
                    "--tokens", "7")
    assert [(e.role, e.port, e.engine_id, e.tokens) for e in engines] == [
        ("prefill", 9000, "m-0", 7), ("decode", 9001, "m-1", 7), ("decode", 9002, "m-2", 7),
        ("decode", 9003, "m-3", 7)]
    # Port 0: each binds its own; no --engine-id: each is named ROLE-PORT once bound.
    engines = fleet("--engines", "3", "--role", "decode")
    assert [(e.role, e.port, e.engine_id) for e in engines] == [("decode", 0, None)] * 3


@pytest.mark.parametrize(("argv", "named"), [
    ([], "--role"),
    (["--engines", "0", "--role", "decode"], "--engines must be >= 1"),
    (["--engines", "2", "--prefill-engines", "3"], "--prefill-engines must be between 0 and --engines (2)"),
    (["--engines", "2", "--prefill-engines", "1", "--role", "decode"], "exclude each other"),
    (["--engines", "10", "--role", "decode", "--port", "65530"], "runs past port 65535"),
])
def test_bad_fleet_flags_are_refused_before_binding(argv: list[str], named: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2 and named in capsys.readouterr().err


def test_one_process_serves_n_engines_each_with_its_own_identity(tmp_path: Path) -> None:
    listed = tmp_path / "engines.json"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    command = [sys.executable, "-m", "narwhal", "mock-engine", "--port", "0", "--engines", "5",
               "--prefill-engines", "2", "--engines-file", str(listed), "--tokens", "3"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True) as process:
        assert process.stdout is not None and process.stderr is not None
        try:
            lines = [json.loads(process.stdout.readline()) for _ in range(6)]
            *ready, done = lines
            assert [line["event"] for line in ready] == ["mock_engine_ready"] * 5
            assert done == {"event": "mock_fleet_ready", "engines": 5}
            assert [line["role"] for line in ready] == ["prefill"] * 2 + ["decode"] * 3
            ports = [line["port"] for line in ready]
            assert len(set(ports)) == 5
            # The file is written before the fleet's line, and lists the same engines.
            written = json.loads(listed.read_text())["engines"]
            assert [(e["engine_id"], e["role"], e["port"]) for e in written] == \
                [(line["engine_id"], line["role"], line["port"]) for line in ready]
            for line in ready:
                base = f"http://127.0.0.1:{line['port']}"
                assert line["engine_id"] == f"{line['role']}-{line['port']}"
                with httpx.Client(base_url=base, timeout=5) as client:
                    assert client.get("/health").status_code == 200
                    identity = client.get("/narwhal/identity").json()
                    assert identity["engine_id"] == line["engine_id"]
                    assert identity["kv_roles"] == (["producer"] if line["role"] == "prefill" else ["consumer"])
                    answer = client.post("/v1/completions", json={
                        "model": "mock-model", "prompt": "hello there", "kv_transfer_params": PREFILL_KV}
                        if line["role"] == "prefill" else {"model": "mock-model", "prompt": "hello there"})
                    assert answer.status_code == 200
                    if line["role"] == "prefill":
                        kv = answer.json()["kv_transfer_params"]
                        assert (kv["remote_engine_id"], kv["remote_port"]) == (line["engine_id"], line["port"])
                    else:
                        assert answer.json()["usage"]["completion_tokens"] == 3
                    # Each engine counts only what it saw itself.
                    assert client.get("/mock/stats").json()["requests"] == {
                        "/health": 1, "/narwhal/identity": 1, "/v1/completions": 1}
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=10) == 0
        finally:
            if process.poll() is None:
                process.kill()
        assert "Traceback" not in process.stderr.read()
