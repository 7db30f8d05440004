"""One TLS reload path: every part reloads, and ``tls_reloaded`` is logged only when every part did.

The router swaps its own contexts and asks its data plane to; with worker
processes each worker reads the files itself and answers ``TLSReloaded``.
A worker that fails, exits or does not answer makes the reload a failure
that names it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import pytest
import trio
import trustme

from narwhal.config import ConfigError, parse_config
from narwhal.router import Router
from narwhal.serving.data_plane import DataPoolUsage
from narwhal.tls import MAX_PEM_BYTES, TLSContexts
from narwhal.tools.admin_cli import format_reload
from narwhal.workers.link import LinkClosed
from narwhal.workers.process import WorkerSet
from narwhal.workers.protocol import ReloadTLS, TLSReloaded, Welcome
from narwhal.workers.worker import Worker
from tests.test_tls import config_text


@pytest.fixture
def tls_config_text(tmp_path: Path) -> str:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    (tmp_path / "cert.pem").write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    trustme.CA().issue_cert("127.0.0.1").private_key_pem.write_to_path(str(tmp_path / "other-key.pem"))
    return config_text(f'tls_cert_file = "{tmp_path / "cert.pem"}"\ntls_key_file = "{tmp_path / "key.pem"}"')


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict]:
    lines = [json.loads(record.getMessage()) for record in caplog.records if record.name == "narwhal.events"]
    return [line for line in lines if line["event"] == name]


class _Link:
    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, message: object) -> None:
        self.sent.append(message)


def test_a_worker_answers_a_reload_with_its_outcome_and_keeps_its_contexts_on_a_bad_file(
        tls_config_text: str, tmp_path: Path) -> None:
    config = parse_config(tls_config_text)
    link = _Link()
    worker = Worker(0, Welcome(worker=0, config=config, config_dir=None, via_token="narwhal-test"), link)
    before = worker.plane.server.ssl_context
    assert before is not None

    worker.on_message(ReloadTLS(id=7))
    assert link.sent == [TLSReloaded(id=7)]
    assert worker.plane.server.ssl_context is not before  # the new context serves new connections

    current = worker.plane.server.ssl_context
    (tmp_path / "key.pem").write_bytes((tmp_path / "other-key.pem").read_bytes())
    worker.on_message(ReloadTLS(id=8))
    [answer] = link.sent[1:]
    assert isinstance(answer, TLSReloaded) and answer.id == 8
    assert answer.error is not None and "serving.tls_key_file" in answer.error
    assert worker.plane.server.ssl_context is current


class _WorkerLink:
    """A control link whose worker answers a ``ReloadTLS`` later, as told, or not at all."""

    def __init__(self, workers: WorkerSet, index: int, nursery: trio.Nursery, answer: str | None | bool) -> None:
        self._workers, self._index, self._nursery, self._answer = workers, index, nursery, answer

    def send(self, message: object) -> None:
        if self._answer == "closed":
            raise LinkClosed("gone")
        assert isinstance(message, ReloadTLS)
        if self._answer is False:
            return  # never answers

        async def answer_later() -> None:
            await trio.sleep(0.5 + self._index)
            error = None if self._answer is True else str(self._answer)
            self._workers._tls_answer(self._index, TLSReloaded(id=message.id, error=error))

        self._nursery.start_soon(answer_later)


def worker_set(count: int) -> WorkerSet:
    config = parse_config(config_text(f"workers = {count}"))
    return WorkerSet(count=count, config=config, config_dir=None, hub=None, app=None,
                     via_token="narwhal-test")


async def test_the_worker_set_names_each_worker_that_did_not_reload(autojump_clock) -> None:
    workers = worker_set(4)
    async with trio.open_nursery() as nursery:
        answers: list[str | None | bool] = [True, "serving.tls_key_file: no usable key", False, "closed"]
        workers._links = {i: _WorkerLink(workers, i, nursery, a) for i, a in enumerate(answers)}
        failures = await workers.reload_tls(timeout_s=10.0)
    assert failures == {1: "serving.tls_key_file: no usable key", 2: "no answer within 10 s",
                        3: "its control link is closed"}
    # The silent worker held the reload until the deadline, not longer.
    assert trio.current_time() == pytest.approx(10.0)


async def test_the_worker_set_returns_as_soon_as_every_worker_reloaded(autojump_clock) -> None:
    workers = worker_set(2)
    async with trio.open_nursery() as nursery:
        workers._links = {i: _WorkerLink(workers, i, nursery, True) for i in range(2)}
        assert await workers.reload_tls(timeout_s=10.0) == {}
    assert trio.current_time() == pytest.approx(1.5)  # the later answer, not the deadline


async def test_a_late_answer_to_an_earlier_reload_does_not_count_for_the_next(autojump_clock) -> None:
    workers = worker_set(1)
    async with trio.open_nursery() as nursery:
        workers._links = {0: _WorkerLink(workers, 0, nursery, False)}
        assert await workers.reload_tls(timeout_s=1.0) == {0: "no answer within 1 s"}

        async def stale_answer() -> None:
            # Arrives during the second round (id 2): it answers the first one, so it does not count.
            await trio.sleep(0.1)
            workers._tls_answer(0, TLSReloaded(id=1))

        nursery.start_soon(stale_answer)
        assert await workers.reload_tls(timeout_s=1.0) == {0: "no answer within 1 s"}


class _FakePlane:
    def __init__(self, failures: dict[str, str]) -> None:
        self.failures = failures
        self.reloaded_with: list[object] = []

    async def reload_tls(self, tls: object) -> dict[str, str]:
        self.reloaded_with.append(tls)
        return self.failures

    def pool_usage(self) -> DataPoolUsage:
        return DataPoolUsage(in_use=0, waiting=0, capacity=1)


async def test_tls_reloaded_is_logged_only_when_every_part_reloaded(
        tls_config_text: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    router = Router(parse_config(tls_config_text))
    try:
        router.data_plane = _FakePlane({"worker 1": "serving.tls_key_file: no usable key"})
        assert await router.reload_tls() is False
        assert events(caplog, "tls_reloaded") == []
        [failed] = events(caplog, "tls_reload_failed")
        assert failed["parts"] == ["worker 1"]
        assert failed["message"] == "worker 1: serving.tls_key_file: no usable key"

        router.data_plane = _FakePlane({})
        assert await router.reload_tls() is True
        [reloaded] = events(caplog, "tls_reloaded")
        assert reloaded["server"] is True and reloaded["workers"] == 1
        assert router.data_plane.reloaded_with == [router.tls]
    finally:
        await router.control_pool.aclose()


async def test_in_one_process_the_reload_reaches_the_server_and_the_data_pool(
        tls_config_text: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    router = Router(parse_config(tls_config_text))
    plane = router.data_plane
    before = plane.server.ssl_context
    try:
        assert await router.reload_tls() is True
        assert plane.server.ssl_context is router.tls.server is not before
        assert len(events(caplog, "tls_reloaded")) == 1
    finally:
        await router.control_pool.aclose()
        await plane.data_pool.aclose()


# -- the files are read off the loop: regular files only, at most MAX_PEM_BYTES each ----------------

def _write_if_read(path: Path, data: bytes) -> None:
    """Give a reader blocked on the FIFO at ``path`` its content; nothing when nobody reads it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return  # no reader (ENXIO): the reload did not block on it
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _fifo_in_place_of(path: Path) -> threading.Timer:
    """Replace ``path`` by a FIFO; the timer (started) feeds a reader that blocked on it after 10 s."""
    data = path.read_bytes()
    path.unlink()
    os.mkfifo(path)
    unblock = threading.Timer(10.0, _write_if_read, (path, data))
    unblock.start()
    return unblock


async def test_a_fifo_at_a_certificate_path_fails_the_reload_without_blocking_the_loop(
        tls_config_text: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    router = Router(parse_config(tls_config_text))
    plane = router.data_plane
    before = router.tls.server
    unblock = _fifo_in_place_of(tmp_path / "cert.pem")
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.sleep(0)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            with trio.fail_after(5):
                outcome = await router.reload()
            nursery.cancel_scope.cancel()
    finally:
        unblock.cancel()
        await router.control_pool.aclose()
        await plane.data_pool.aclose()
    assert ticks > 0
    assert outcome.tls == "failed" and outcome.tls_error is not None
    assert outcome.tls_error.startswith("serving.tls_cert_file: ")
    assert "not a regular file (a FIFO)" in outcome.tls_error
    assert router.tls.server is before  # the old certificates keep serving
    [failed] = events(caplog, "tls_reload_failed")
    assert failed["message"] == outcome.tls_error
    assert f"TLS files: failed: {outcome.tls_error}" in format_reload(msgspec.to_builtins(outcome))


async def test_a_pem_file_over_the_bound_fails_the_reload_unread(
        tls_config_text: str, tmp_path: Path) -> None:
    router = Router(parse_config(tls_config_text))
    plane = router.data_plane
    before = router.tls.server
    key = tmp_path / "key.pem"
    key.write_bytes(key.read_bytes() + b"\n" * MAX_PEM_BYTES)
    try:
        outcome = await router.reload()
    finally:
        await router.control_pool.aclose()
        await plane.data_pool.aclose()
    assert outcome.tls == "failed" and outcome.tls_error is not None
    assert outcome.tls_error.startswith("serving.tls_key_file: ")
    assert f"over the {MAX_PEM_BYTES} byte bound" in outcome.tls_error
    assert router.tls.server is before


def test_a_worker_refuses_a_fifo_at_a_certificate_path_at_once(tls_config_text: str, tmp_path: Path) -> None:
    link = _Link()
    worker = Worker(0, Welcome(worker=0, config=parse_config(tls_config_text), config_dir=None,
                               via_token="narwhal-test"), link)
    before = worker.plane.server.ssl_context
    unblock = _fifo_in_place_of(tmp_path / "key.pem")
    try:
        worker.on_message(ReloadTLS(id=3))
    finally:
        unblock.cancel()
    [answer] = link.sent
    assert isinstance(answer, TLSReloaded) and answer.error is not None
    assert answer.error.startswith("serving.tls_key_file: ") and "not a regular file (a FIFO)" in answer.error
    assert worker.plane.server.ssl_context is before


def test_at_startup_a_fifo_or_an_oversize_pem_file_is_one_error_naming_the_key(
        tls_config_text: str, tmp_path: Path) -> None:
    config = parse_config(tls_config_text)
    cert = tmp_path / "cert.pem"
    pem = cert.read_bytes()
    cert.write_bytes(pem + b"\n" * MAX_PEM_BYTES)
    with pytest.raises(ConfigError, match=rf"^serving.tls_cert_file: .* over the {MAX_PEM_BYTES} byte bound$"):
        TLSContexts(config)
    cert.write_bytes(pem)
    unblock = _fifo_in_place_of(tmp_path / "key.pem")
    try:
        with pytest.raises(ConfigError, match=r"^serving.tls_key_file: .*not a regular file \(a FIFO\)$"):
            TLSContexts(config)
    finally:
        unblock.cancel()


def test_serve_exits_2_naming_the_key_when_a_certificate_path_is_a_fifo(
        tls_config_text: str, tmp_path: Path) -> None:
    config_path = tmp_path / "narwhal.toml"
    config_path.write_text(tls_config_text)
    unblock = _fifo_in_place_of(tmp_path / "cert.pem")
    try:
        result = subprocess.run([sys.executable, "-m", "narwhal", "serve", "--config", str(config_path)],
                                capture_output=True, text=True, timeout=30)
    finally:
        unblock.cancel()
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].count("serving.tls_cert_file") == 1 and "a FIFO" in lines[0], lines
