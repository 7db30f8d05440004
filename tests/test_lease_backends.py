"""The lease backends against their real stores: a lock-guarded file, and a real etcd.

Both must give the lease to exactly one contender, count epochs up, refuse a
renewal or a release from a holder that lost the record, and (etcd) refuse a
handoff write from a writer whose lease is gone.
"""

from __future__ import annotations

import base64
import fcntl
import os
import threading
import time
from pathlib import Path

import httpx
import pytest
import trio

from narwhal.lease.backend import LeaseBackendError
from narwhal.lease.etcd_backend import EtcdLeaseBackend
from narwhal.lease.file_backend import FileLeaseBackend
from narwhal.lease.rules import TakeoverRequest
from narwhal.state import handoff
from tests.etcd_server import start_etcd


class WallClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["file", "etcd"])
async def make_backend(request, tmp_path: Path):
    made = []
    etcd = await start_etcd(tmp_path / "etcd") if request.param == "etcd" else None
    wall = WallClock()

    def make():
        if etcd is None:
            backend = FileLeaseBackend(path=tmp_path / "lease.json", handoff_path=tmp_path / "handoff.json",
                                       ttl_s=2.0, wall_clock=wall)
        else:
            backend = EtcdLeaseBackend(endpoints=[etcd.url], key="/t/lease", ttl_s=2.0, timeout_s=2.0)
        made.append(backend)
        return backend

    make.kind = request.param
    make.wall = wall
    make.etcd = etcd
    yield make
    for backend in made:
        await backend.aclose()
    if etcd is not None:
        await etcd.stop()


async def expire(make) -> None:
    """Let the first holder's lease run out: wall time for the file, real time for etcd."""
    if make.kind == "file":
        make.wall.now += 2.0
    else:
        await trio.sleep(3.5)


async def test_exactly_one_contender_acquires_and_epochs_count_up(make_backend) -> None:
    backends = [make_backend() for _ in range(4)]
    results = {}

    async def contend(i: int) -> None:
        results[i] = await backends[i].acquire(f"r{i}", f"http://127.0.0.1:{9000 + i}")

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(contend, i)
    winners = [i for i, result in results.items() if result.acquired]
    assert len(winners) == 1
    winner = winners[0]
    assert results[winner].record.epoch == 1
    for i, result in results.items():
        if i != winner:
            assert result.record is not None and result.record.holder == f"r{winner}"
    seen = await backends[(winner + 1) % 4].read()
    assert (seen.holder, seen.epoch, seen.advertise_url) == (f"r{winner}", 1, f"http://127.0.0.1:{9000 + winner}")

    renewal = await backends[winner].renew(results[winner].record)
    assert renewal.ok and renewal.takeover is None

    await expire(make_backend)
    loser = (winner + 1) % 4
    taken = await backends[loser].acquire(f"r{loser}", "http://127.0.0.1:1")
    assert taken.acquired and taken.record.epoch == 2
    # The old holder's renewal and release now fail: the record is no longer its own.
    late = await backends[winner].renew(results[winner].record)
    assert not late.ok and late.lost
    assert not await backends[winner].release(results[winner].record)
    assert (await backends[winner].read()).holder == f"r{loser}"


async def test_release_frees_the_lease_for_the_next_epoch_and_takeover_requests_reach_the_holder(
        make_backend) -> None:
    holder, standby = make_backend(), make_backend()
    first = await holder.acquire("ra", "http://127.0.0.1:1")
    assert first.acquired
    assert not (await standby.acquire("rb", "http://127.0.0.1:2")).acquired
    request = TakeoverRequest(requested_by="rb", epoch=first.record.epoch, reason="monitoring degraded", at=1.0)
    assert await standby.request_takeover(request)
    assert not await standby.request_takeover(TakeoverRequest(requested_by="rb", epoch=99, reason="x", at=1.0))
    renewal = await holder.renew(first.record)
    assert renewal.ok and renewal.takeover == request
    await holder.clear_takeover(first.record)
    assert (await holder.renew(first.record)).takeover is None
    assert await holder.release(first.record)
    second = await standby.acquire("rb", "http://127.0.0.1:2")
    assert second.acquired and second.record.epoch == 2 and second.record.takeover is None


async def test_etcd_handoff_write_is_guarded_by_the_writers_lease(tmp_path: Path) -> None:
    etcd = await start_etcd(tmp_path / "etcd")
    old = EtcdLeaseBackend(endpoints=[etcd.url], key="/t/lease", ttl_s=2.0, timeout_s=2.0)
    new = EtcdLeaseBackend(endpoints=[etcd.url], key="/t/lease", ttl_s=2.0, timeout_s=2.0)
    try:
        first = await old.acquire("ra", "http://127.0.0.1:1")
        assert await old.write_handoff(b'{"by": "ra"}', first.record)
        assert await new.read_handoff() == b'{"by": "ra"}'
        await trio.sleep(3.5)  # ra's lease expires in etcd
        second = await new.acquire("rb", "http://127.0.0.1:2")
        assert second.acquired and second.record.epoch == 2
        assert await new.write_handoff(b'{"by": "rb"}', second.record)
        # The fenced writer wakes and writes: the txn refuses it, the successor's document stands.
        assert not await old.write_handoff(b'{"by": "ra", "late": true}', first.record)
        assert await old.read_handoff() == b'{"by": "rb"}'
    finally:
        await old.aclose()
        await new.aclose()
        await etcd.stop()


async def test_etcd_tries_each_endpoint_in_turn_and_says_when_none_answers(tmp_path: Path) -> None:
    etcd = await start_etcd(tmp_path / "etcd")
    # A closed port first: the backend moves on to the live member.
    backend = EtcdLeaseBackend(endpoints=["http://127.0.0.1:9", etcd.url], key="/t/lease", ttl_s=2.0,
                               timeout_s=1.0)
    try:
        assert (await backend.acquire("ra", "http://127.0.0.1:1")).acquired
        await etcd.stop()
        started = time.monotonic()
        with pytest.raises(LeaseBackendError, match=r"etcd unreachable: .*http://127\.0\.0\.1:9: ConnectError"):
            await backend.read()
        assert time.monotonic() - started < 3.0
    finally:
        await backend.aclose()
        await etcd.stop()


async def test_file_backend_gives_up_on_a_lock_held_too_long(tmp_path: Path) -> None:

    backend = FileLeaseBackend(path=tmp_path / "lease.json", handoff_path=tmp_path / "h.json", ttl_s=2.0,
                               lock_timeout_s=0.2)
    fd = os.open(tmp_path / "lease.json.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(LeaseBackendError, match="cannot lock"):
            await backend.acquire("ra", "http://127.0.0.1:1")
    finally:
        os.close(fd)
    assert (await backend.acquire("ra", "http://127.0.0.1:1")).acquired


async def _etcd_post(url: str, path: str, body: dict) -> dict:
    async with httpx.AsyncClient(timeout=5.0) as client:
        response = await client.post(f"{url}{path}", json=body)
        assert response.status_code == 200, response.text
        return response.json()


def _b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


async def delete_everything(make, backend) -> None:
    """rm lease.json, or etcdctl del --prefix (an etcd restored empty looks the same)."""
    if make.kind == "file":
        backend.path.unlink()
    else:
        await _etcd_post(make.etcd.url, "/v3/kv/deleterange",
                         {"key": _b64("/t/lease"), "range_end": _b64("/t/leasf")})


async def test_a_deleted_record_is_taken_only_when_asked_and_never_with_an_old_epoch(make_backend) -> None:
    holder, standby = make_backend(), make_backend()
    first = await holder.acquire("ra", "http://127.0.0.1:1", after_epoch=4)
    assert first.acquired and first.record.epoch == 5
    await delete_everything(make_backend, holder)
    assert await standby.read() is None
    # A standby that saw ra's record does not take a missing one before ra surely fenced.
    refused = await standby.acquire("rb", "http://127.0.0.1:2", after_epoch=5, take_missing=False)
    assert not refused.acquired and refused.record is None
    # ra finds its record gone at its next renewal: lost, so it fences at once.
    renewal = await holder.renew(first.record)
    assert renewal.lost
    taken = await standby.acquire("rb", "http://127.0.0.1:2", after_epoch=5)
    assert taken.acquired and taken.record.epoch == 6


async def test_etcd_proves_a_term_over_only_when_its_lease_is_gone_and_the_counter_intact(tmp_path: Path) -> None:
    etcd = await start_etcd(tmp_path / "etcd")
    holder = EtcdLeaseBackend(endpoints=[etcd.url], key="/t/lease", ttl_s=2.0, timeout_s=2.0)
    standby = EtcdLeaseBackend(endpoints=[etcd.url], key="/t/lease", ttl_s=2.0, timeout_s=2.0)
    try:
        first = (await holder.acquire("ra", "http://127.0.0.1:1")).record
        seen = await standby.read()
        assert seen is not None and seen.lease_id == first.lease_id != 0
        assert not await standby.term_over(seen)  # still held
        # etcdctl del of the key alone: the holder's lease lives on, so it may still be serving.
        await _etcd_post(etcd.url, "/v3/kv/deleterange", {"key": _b64("/t/lease")})
        assert not await standby.term_over(seen)
        assert await holder.release(first)  # the holder fenced and handed its lease back
        assert await standby.term_over(seen)
        # A counter deleted with everything else proves nothing: the lease may have gone with it.
        second = (await holder.acquire("ra", "http://127.0.0.1:1", after_epoch=1)).record
        seen = await standby.read()
        await _etcd_post(etcd.url, "/v3/kv/deleterange", {"key": _b64("/t/lease"), "range_end": _b64("/t/leasf")})
        await _etcd_post(etcd.url, "/v3/lease/revoke", {"ID": str(second.lease_id)})
        assert not await standby.term_over(seen)
    finally:
        await holder.aclose()
        await standby.aclose()
        await etcd.stop()


async def test_an_etcd_record_put_by_hand_without_a_lease_expires_after_ttl(tmp_path: Path) -> None:
    etcd = await start_etcd(tmp_path / "etcd")
    now = [100.0]
    backend = EtcdLeaseBackend(endpoints=[etcd.url], key="/t/lease", ttl_s=2.0, timeout_s=2.0,
                               monotonic=lambda: now[0])
    try:
        record = b'{"holder":"rx","epoch":3,"advertise_url":"http://127.0.0.1:1"}'
        await _etcd_post(etcd.url, "/v3/kv/put", {"key": _b64("/t/lease"), "value": _b64(record)})
        held = await backend.acquire("rb", "http://127.0.0.1:2")
        assert not held.acquired and held.record.holder == "rx" and held.record.lease_id == 0
        now[0] += 1.9
        assert not (await backend.acquire("rb", "http://127.0.0.1:2")).acquired
        now[0] += 0.1
        taken = await backend.acquire("rb", "http://127.0.0.1:2")
        assert taken.acquired and taken.record.epoch == 4
        current = await backend.read()
        assert current.holder == "rb" and current.lease_id != 0
        assert (await backend.renew(taken.record)).ok
    finally:
        await backend.aclose()
        await etcd.stop()


async def test_an_abandoned_lease_file_write_never_lands_later(tmp_path: Path, monkeypatch) -> None:


    backend = FileLeaseBackend(path=tmp_path / "lease.json", handoff_path=tmp_path / "h.json", ttl_s=2.0)
    stalled, resume = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def stalled_fsync(fd: int) -> None:
        stalled.set()
        resume.wait(10.0)  # the filesystem hangs
        real_fsync(fd)

    monkeypatch.setattr(handoff.os, "fsync", stalled_fsync)
    with trio.move_on_after(0.2) as gave_up:
        await backend.acquire("rb", "http://127.0.0.1:2")
    assert gave_up.cancelled_caught and stalled.is_set()
    resume.set()
    # The thread finishes its write only after the caller gave up: it must not take effect.
    deadline = time.monotonic() + 5.0
    while any(path.name.endswith(".tmp") for path in tmp_path.iterdir()) and time.monotonic() < deadline:
        await trio.sleep(0.01)
    monkeypatch.undo()
    await trio.to_thread.run_sync(backend._locked, lambda: None)  # the thread let go of the lock
    assert await backend.read() is None
    assert not [path.name for path in tmp_path.iterdir() if path.name.endswith(".tmp")]


async def test_a_holder_stalled_in_its_write_holds_no_lock_and_the_lease_passes_on(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    # A holder frozen while it writes (SIGSTOP, a hung disk) must not keep the others from an expired lease:
    # the lock covers only the check and the rename, never the write and its fsync.
    now = [0.0]
    ra, rb = (FileLeaseBackend(path=tmp_path / "lease.json", handoff_path=tmp_path / "h.json", ttl_s=2.0,
                               wall_clock=lambda: now[0]) for _ in range(2))
    held = (await ra.acquire("ra", "http://127.0.0.1:1")).record
    assert held is not None
    stalled, resume = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def stall_once(fd: int) -> None:
        if not stalled.is_set():
            stalled.set()
            resume.wait(10.0)
        real_fsync(fd)

    monkeypatch.setattr(handoff.os, "fsync", stall_once)
    renewal = []
    async with trio.open_nursery() as nursery:
        async def renew() -> None:
            renewal.append(await ra.renew(held))

        nursery.start_soon(renew)
        await trio.to_thread.run_sync(stalled.wait, 5.0)
        now[0] = 3.0  # past ra's expiry
        with trio.fail_after(5):
            taken = await rb.acquire("rb", "http://127.0.0.1:2")
        assert taken.acquired and taken.record is not None and taken.record.epoch == 2
        resume.set()
    # ra's renewal found the record changed under it and starts over: the lease is rb's now.
    assert renewal[0].lost and not renewal[0].ok
    record = await rb.read()
    assert record is not None and record.holder == "rb"
    assert not [path.name for path in tmp_path.iterdir() if path.name.endswith(".tmp")]


# -- the files are read bounded, regular files only, never blocking --------------------------------

def _write_if_read(path: Path, data: bytes) -> None:
    """Give a reader blocked on the FIFO at ``path`` its content; nothing when nobody reads it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return  # no reader (ENXIO): nothing blocked on it
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


async def _ticking_while(call, ticks: list[int]):
    """``call()``'s outcome, with a ticker counting the loop's turns meanwhile; fails after 5 s."""

    async def ticker() -> None:
        while True:
            ticks[0] += 1
            await trio.sleep(0)

    failure: BaseException | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        try:
            with trio.fail_after(5):
                result = await call()
        except (LeaseBackendError, trio.TooSlowError) as exc:
            failure = exc  # raised outside the nursery, not in an exception group
        nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return result


@pytest.mark.parametrize("which", ["lease", "handoff"])
async def test_a_fifo_at_a_lease_file_path_is_unreadable_at_once(tmp_path: Path, which: str) -> None:
    backend = FileLeaseBackend(path=tmp_path / "lease.json", handoff_path=tmp_path / "h.json", ttl_s=2.0)
    fifo = backend.path if which == "lease" else backend.handoff_path
    os.mkfifo(fifo)
    # A reader blocked on the FIFO would wait until a writer came: one comes after 10 s.
    unblock = threading.Timer(10.0, _write_if_read, (fifo, b"{}"))
    unblock.start()
    ticks = [0]
    try:
        call = backend.read if which == "lease" else backend.read_handoff
        with pytest.raises(LeaseBackendError, match=r"not a regular file \(a FIFO\)"):
            await _ticking_while(call, ticks)
        if which == "lease":
            # Unreadable is never free: the lease is not taken over a record nobody could read.
            with pytest.raises(LeaseBackendError, match="FIFO"):
                await _ticking_while(lambda: backend.acquire("ra", "http://127.0.0.1:1"), ticks)
    finally:
        unblock.cancel()
    assert ticks[0] > 0


async def test_an_oversize_lease_or_handoff_file_is_unreadable_not_read(tmp_path: Path, monkeypatch) -> None:
    from narwhal.lease import file_backend

    backend = FileLeaseBackend(path=tmp_path / "lease.json", handoff_path=tmp_path / "h.json", ttl_s=2.0)
    backend.path.write_bytes(b" " * (file_backend.MAX_LEASE_RECORD_BYTES + 1))
    with pytest.raises(LeaseBackendError, match=f"over the {file_backend.MAX_LEASE_RECORD_BYTES} byte bound"):
        await backend.read()
    with pytest.raises(LeaseBackendError, match="byte bound"):
        await backend.acquire("ra", "http://127.0.0.1:1", take_missing=True)
    monkeypatch.setattr(file_backend, "MAX_DOCUMENT_BYTES", 1024)
    backend.handoff_path.write_bytes(b" " * 1025)
    with pytest.raises(LeaseBackendError, match="over the 1024 byte bound"):
        await backend.read_handoff()
