"""Several processes writing one handoff, and writers killed mid-write (spec: "Concurrent
writers therefore leave one complete final document")."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from narwhal.state.handoff import HandoffDocument, HandoffUnreadable, read_document

REPO = Path(__file__).resolve().parent.parent
ENGINES_PER_DOCUMENT = 200  # ~40 KB: a torn or interleaved write would be visible

# Writes `count` documents (forever when negative) to `path` as writer `name`; prints
# "ready" after the first. Every engine record carries "<name>:<pass>", so a document
# mixed from two writes cannot pass `check`.
WRITER = f"""
import os, sys
from narwhal.fleet import EngineRecord
from narwhal.state.handoff import HANDOFF_SCHEMA, EngineSetEntry, HandoffDocument, encode_document, write_atomic

path, name, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
engine_set = [EngineSetEntry(name=f"e{{i}}", url=f"http://127.0.0.1:{{9000 + i}}", role="prefill")
              for i in range({ENGINES_PER_DOCUMENT})]
number = 0
while count < 0 or number < count:
    stamp = f"{{name}}:{{number}}"
    document = HandoffDocument(
        schema=HANDOFF_SCHEMA, router_id=name, pid=os.getpid(), pass_number=number, written_at=float(number),
        engine_set=engine_set,
        engines=[EngineRecord(name=f"e{{i}}", role="prefill", ejected=True, ejected_reason=stamp)
                 for i in range({ENGINES_PER_DOCUMENT})])
    write_atomic(path, encode_document(document))
    if number == 0:
        print("ready", flush=True)
    number += 1
"""


def start_writer(path: Path, name: str, count: int) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-c", WRITER, str(path), name, str(count)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)


def check(document: HandoffDocument) -> None:
    """One writer's complete document: every record stamped with the same writer and pass."""
    stamp = f"{document.router_id}:{document.pass_number}"
    assert len(document.engines) == ENGINES_PER_DOCUMENT
    assert {record.ejected_reason for record in document.engines} == {stamp}


def temporaries(directory: Path) -> list[str]:
    return [name for name in os.listdir(directory) if name.endswith(".tmp")]


def test_concurrent_writers_leave_one_complete_document(tmp_path: Path) -> None:
    path = tmp_path / "handoff.json"
    writes_each = 300
    writers = {f"w{i}": start_writer(path, f"w{i}", writes_each) for i in range(4)}
    reads = 0
    deadline = time.monotonic() + 20
    try:
        # Each writer says "ready" once its first document is in place: block on that, not on a spin.
        for proc in writers.values():
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        while any(proc.poll() is None for proc in writers.values()):
            assert time.monotonic() < deadline, "writers did not finish"
            check(read_document(path))  # never torn, never a mix of two writers
            reads += 1
            # Read often, but leave the CPU to the four writers between reads (2 cores).
            time.sleep(0.002)
    finally:
        for proc in writers.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()
    assert [proc.returncode for proc in writers.values()] == [0] * 4
    assert reads > 10
    final = read_document(path)
    check(final)
    # The last rename wins: it is some writer's own last document.
    assert final.router_id in writers and final.pass_number == writes_each - 1
    assert temporaries(tmp_path) == []


def test_writer_killed_mid_write_leaves_a_complete_document(tmp_path: Path) -> None:
    path = tmp_path / "handoff.json"
    rng = random.Random(6)
    seen: set[str] = set()
    for round_number in range(6):
        writer = start_writer(path, f"k{round_number}", -1)
        try:
            assert writer.stdout.readline() == "ready\n"
            # Poll while it writes, then kill it at a random point of its loop.
            stop = time.monotonic() + rng.uniform(0.01, 0.15)
            while time.monotonic() < stop:
                check(read_document(path))
            writer.send_signal(signal.SIGKILL)
        finally:
            writer.kill()
            writer.wait()
            writer.stdout.close()
        assert writer.returncode == -signal.SIGKILL
        try:
            document = read_document(path)
        except HandoffUnreadable as exc:  # pragma: no cover - the failure being tested for
            raise AssertionError(f"round {round_number}: partial document in place: {exc}") from None
        check(document)
        assert document.router_id == f"k{round_number}"
        seen.add(document.router_id)
        # A killed writer may leave its own temporary file behind, never anything else.
        for name in temporaries(tmp_path):
            assert name.startswith(f".handoff.json.{writer.pid}."), name
            (tmp_path / name).unlink()
    assert len(seen) == 6
