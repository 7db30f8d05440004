"""The lease service with an in-memory backend on trio's MockClock: exact times, no sockets.

It is the shell around the rules: it must open admission only on acquisition,
fence exactly at the deadline when renewals fail (and pause the handoff writer,
even mid-write), yield only when its own readiness fails, request a takeover
after the threshold of holder 503s, and follow only handoffs of the newest epoch.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio
from trio.testing import MockClock

from narwhal.config import Config, EngineSpec, LeaseConfig
from narwhal.fleet import Fleet
from narwhal.fleet.admission import FENCED_REASON, Admission
from narwhal.fleet.model import HoldKind
from narwhal.lease.backend import Acquisition, LeaseBackendError, Renewal
from narwhal.lease.rules import LeaseRecord, Role, TakeoverRequest
from narwhal.lease.service import LeaseClocks, LeaseService, ServingParts
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.stages.persistence import HandoffExtra, PersistenceStage
from narwhal.state import handoff
from narwhal.state.handoff import LeaseOwnership, read_document

TTL_S, RENEW_S, MARGIN_S = 10.0, 3.0, 2.0


class MemoryBackend:
    """The shared record in memory; expiry on trio's clock (which the test controls)."""

    name = "memory"

    def __init__(self, ttl_s: float = TTL_S) -> None:
        self.ttl_s = ttl_s
        self.record: LeaseRecord | None = None
        self.handoff: bytes | None = None
        self.down = False
        self.renewals = 0
        self.terms_over = False
        self.release_delay_s = 0.0
        self.releases: list[tuple[float, int]] = []
        self.stall_acquire = trio.Event()
        self.stall_acquire.set()

    def _check(self) -> None:
        if self.down:
            raise LeaseBackendError("memory unreachable: down")

    async def read(self) -> LeaseRecord | None:
        self._check()
        return self.record

    async def acquire(self, router_id: str, advertise_url: str, *, after_epoch: int = 0,
                      take_missing: bool = True) -> Acquisition:
        self._check()
        await self.stall_acquire.wait()
        now = trio.current_time()
        current = self.record
        if current is not None and not current.free_at(now) or current is None and not take_missing:
            return Acquisition(acquired=False, record=current)
        self.record = LeaseRecord(holder=router_id, epoch=max(current.epoch if current else 0, after_epoch) + 1,
                                  advertise_url=advertise_url, expires_at=now + self.ttl_s)
        return Acquisition(acquired=True, record=self.record)

    async def term_over(self, record: LeaseRecord) -> bool:
        self._check()
        return self.terms_over

    async def renew(self, record: LeaseRecord) -> Renewal:
        self._check()
        self.renewals += 1
        current = self.record
        if current is None or (current.holder, current.epoch) != (record.holder, record.epoch):
            return Renewal(ok=False, lost=True, reason="taken")
        self.record = msgspec.structs.replace(current, expires_at=trio.current_time() + self.ttl_s)
        return Renewal(ok=True, takeover=current.takeover)

    async def release(self, record: LeaseRecord) -> bool:
        self._check()
        await trio.sleep(self.release_delay_s)
        if self.record is None or self.record.epoch != record.epoch or self.record.holder != record.holder:
            return False
        self.record = LeaseRecord(epoch=record.epoch)
        self.releases.append((trio.current_time(), record.epoch))
        return True

    async def request_takeover(self, request: TakeoverRequest) -> bool:
        self._check()
        if self.record is None or self.record.epoch != request.epoch:
            return False
        self.record = msgspec.structs.replace(self.record, takeover=request)
        return True

    async def clear_takeover(self, record: LeaseRecord) -> None:
        self._check()
        if self.record is not None:
            self.record = msgspec.structs.replace(self.record, takeover=None)

    async def read_handoff(self) -> bytes | None:
        self._check()
        return self.handoff

    async def aclose(self) -> None:
        return None


ENGINES = [("p1", "http://127.0.0.1:9001", "prefill"), ("d1", "http://127.0.0.1:9002", "decode")]


class Rig:
    def __init__(self, tmp_path: Path, backend: MemoryBackend, router_id: str = "r1",
                 ready: Any = None, own_readiness: str | None = None) -> None:
        self.config = Config(engines=[EngineSpec(name=n, url=u, role=r) for n, u, r in ENGINES],
                             lease=LeaseConfig(backend="file", path=str(tmp_path / "lease.json"),
                                               router_id=router_id, ttl_s=TTL_S, renew_interval_s=RENEW_S,
                                               fence_margin_s=MARGIN_S, takeover_ready_failures=3))
        self.fleet = Fleet([(n, r) for n, _, r in ENGINES], eject_after=2, liveness_misses=2,
                           failure_quarantine_s=None, probe_interval_s=5.0)
        self.admission = Admission()
        self.own = own_readiness
        self.monotonic_offset = 0.0
        self.last_now = 0.0
        self.stage = PersistenceStage(path=tmp_path / f"{router_id}-handoff.json", router_id=router_id,
                                      fleet=self.fleet, config=self.config,
                                      extra=lambda: HandoffExtra(lease=self.service.ownership()),
                                      lease_valid=lambda: self.service.valid_threadsafe())
        transport = httpx.MockTransport(ready or (lambda request: httpx.Response(200, text="ready\n")))
        self.service = LeaseService(
            config=self.config, router_id=router_id, backend=backend, metrics=RouterMetrics(),
            serving=ServingParts(admission=self.admission, persistence=self.stage, fleet=self.fleet,
                                 own_readiness=lambda: self.own),
            http=httpx.AsyncClient(transport=transport), clocks=LeaseClocks(monotonic=self.monotonic),
            advertise_url=lambda: f"http://{router_id}.test:8000")

    def monotonic(self) -> float:
        """trio's time in async context; in the writer's thread, the last one seen (plus any stall)."""
        try:
            self.last_now = trio.current_time()
        except RuntimeError:
            pass
        return self.last_now + self.monotonic_offset

    def refusal(self) -> str | None:
        return self.admission.refusal(trio.current_time())


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict[str, Any]]:
    found = []
    for record in caplog.records:
        try:
            line = json.loads(record.getMessage())
        except ValueError:
            continue
        if line.get("event") == name:
            found.append(line)
    return found


async def test_a_standby_opens_admission_only_once_it_acquires(autojump_clock: MockClock, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    backend = MemoryBackend()
    backend.record = LeaseRecord(holder="r2", epoch=7, expires_at=5.0)
    rig = Rig(tmp_path, backend)
    # Before its first read a standby does not know who holds the lease: it does not say "nobody".
    assert rig.refusal() == "standby: lease not read yet"
    assert rig.stage.paused
    await rig.service.tick()
    assert rig.refusal() == "standby: lease held by r2"
    await trio.sleep_until(5.0)
    await rig.service.tick()
    assert rig.service.role is Role.ACTIVE
    assert rig.refusal() is None and not rig.stage.paused
    assert rig.admission.lease_deadline == 5.0 + TTL_S - MARGIN_S == rig.service.admission_deadline
    acquired = events(caplog, "lease_acquired")
    assert acquired[0]["epoch"] == 8 and acquired[0]["holder"] == "r1" and acquired[0]["previous_holder"] == "r2"
    await rig.stage.run(1)
    assert read_document(rig.stage.path).lease.epoch == 8


async def test_renewals_failing_fence_exactly_at_the_deadline(autojump_clock: MockClock, tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    backend = MemoryBackend()
    rig = Rig(tmp_path, backend)
    fenced_at: list[float] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.service.run)
        await trio.sleep(0.001)
        assert rig.service.role is Role.ACTIVE
        await trio.sleep_until(3.5)  # the renewal sent at 3.0 succeeded
        assert backend.renewals == 1
        backend.down = True
        await trio.sleep_until(3.0 + TTL_S - MARGIN_S - 0.001)
        assert rig.refusal() is None
        await trio.sleep_until(3.0 + TTL_S - MARGIN_S)
        # Refused from this instant on, whether or not the fence timer has run yet.
        assert (rig.refusal() or "").startswith(FENCED_REASON)
        await trio.sleep(0)
        assert rig.stage.paused and rig.service.role is Role.FENCED
        fenced_at.append(trio.current_time())
        backend.down = False  # etcd comes back: the renewal would succeed, but the term is over
        await trio.sleep(RENEW_S * 2)
        nursery.cancel_scope.cancel()
    fenced = events(caplog, "fenced")
    assert len(fenced) == 1 and fenced[0]["serving_until_mono"] == 3.0 + TTL_S - MARGIN_S
    assert fenced[0]["last_renew_sent_mono"] == 3.0
    assert [line["reason"] for line in events(caplog, "lease_renew_failed")][:1] == ["memory unreachable: down"]
    # A fresh acquisition is the only way back: it released its own record, so it re-acquired epoch 2.
    assert rig.service.holding.epoch == 2 and rig.service.role is Role.ACTIVE


async def test_a_write_that_outlives_the_term_does_not_replace_the_handoff(
        autojump_clock: MockClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(tmp_path, MemoryBackend())
    await rig.service.tick()
    await rig.stage.run(1)
    before = Path(rig.stage.path).read_bytes()
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        real_fsync(fd)
        rig.monotonic_offset += TTL_S  # the disk stalls past the fencing deadline

    monkeypatch.setattr(handoff.os, "fsync", slow_fsync)
    await rig.stage.run(2)
    monkeypatch.undo()
    assert Path(rig.stage.path).read_bytes() == before
    assert rig.stage.last_written_pass == 1


async def test_a_degraded_active_yields_to_a_takeover_request_and_a_healthy_one_refuses(
        autojump_clock: MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    backend = MemoryBackend()
    rig = Rig(tmp_path, backend)
    await rig.service.tick()
    request = TakeoverRequest(requested_by="r2", epoch=1, reason="monitoring degraded: persistence OSError", at=1.0)
    assert await backend.request_takeover(request)
    await rig.service.tick()
    assert rig.service.role is Role.ACTIVE
    assert events(caplog, "takeover_refused")[0]["requested_by"] == "r2"
    assert backend.record.takeover is None

    assert await backend.request_takeover(request)
    rig.own = "monitoring degraded: persistence OSError"
    await rig.service.tick()
    assert rig.service.role is Role.STANDBY
    assert rig.refusal() == "standby: lease held by nobody" and rig.stage.paused
    assert backend.record.holder == "" and backend.record.epoch == 1
    released = events(caplog, "lease_released")
    assert released[0]["reason"].startswith("takeover requested by r2; own readiness: monitoring degraded")
    rig.own = None
    await rig.service.tick()  # its monitor recovered, but it leaves the lease to the requester
    assert rig.service.role is Role.STANDBY and backend.record.holder == ""


async def test_a_standby_requests_takeover_after_the_threshold_of_holder_503s(
        autojump_clock: MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    backend = MemoryBackend()
    backend.record = LeaseRecord(holder="r2", epoch=4, advertise_url="http://r2.test:8000", expires_at=1e9)
    answers = iter([503, 503, 200, 503, 503, 503])
    asked: list[str] = []

    def ready(request: httpx.Request) -> httpx.Response:
        asked.append(str(request.url))
        return httpx.Response(next(answers), text="monitoring degraded: persistence OSError\n")

    rig = Rig(tmp_path, backend, ready=ready)
    for _ in range(5):
        await rig.service.tick()
        assert backend.record.takeover is None
    await rig.service.tick()
    assert asked == ["http://r2.test:8000/ready"] * 6
    assert backend.record.takeover == TakeoverRequest(
        requested_by="r1", epoch=4, reason="monitoring degraded: persistence OSError",
        at=backend.record.takeover.at)
    requested = events(caplog, "takeover_requested")
    assert requested[0]["holder"] == "r2" and requested[0]["failures"] == 3


async def test_a_standby_applies_newer_handoffs_warm_and_ignores_older_epochs(
        autojump_clock: MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    backend = MemoryBackend()
    backend.record = LeaseRecord(holder="r2", epoch=5, expires_at=1e9)
    writer = Rig(tmp_path, MemoryBackend(), router_id="r2")
    writer.fleet.add_hold("d1", HoldKind.OPERATOR_DRAIN, "operator drain", trio.current_time())

    def document(epoch: int, pass_number: int) -> bytes:
        writer.stage.extra = lambda: HandoffExtra(lease=LeaseOwnership(holder="r2", epoch=epoch))
        return handoff.encode_document(writer.stage.document(pass_number))

    rig = Rig(tmp_path, backend)
    backend.handoff = document(5, 1)
    await rig.service.tick()
    assert [view.name for view in rig.fleet.views(trio.current_time()) if not view.eligible] == ["d1"]
    following = events(caplog, "standby_following")
    assert following[0]["holder"] == "r2" and following[0]["epoch"] == 5
    # Documents without the drain from here on: a fenced writer's late one (epoch 4) never
    # rolls the state back; the holder's next one (epoch 5) is applied.
    writer.stage.fleet = Rig(tmp_path, MemoryBackend(), router_id="r3").fleet
    backend.handoff = document(4, 2)
    await rig.service.tick()
    assert rig.service.applied_epoch == 5 and rig.service.applied_pass == 1
    assert [view.name for view in rig.fleet.views(trio.current_time()) if not view.eligible] == ["d1"]
    backend.handoff = document(5, 3)
    await rig.service.tick()
    assert rig.service.applied_pass == 3
    assert all(view.eligible for view in rig.fleet.views(trio.current_time()))


async def test_a_standby_whose_first_read_fails_says_the_lease_was_not_read(autojump_clock: MockClock,
                                                                            tmp_path: Path) -> None:
    backend = MemoryBackend()
    backend.record = LeaseRecord(holder="", epoch=3, expires_at=0.0)
    backend.down = True
    rig = Rig(tmp_path, backend)
    await rig.service.tick()
    assert rig.refusal() == "standby: lease not read yet (memory unreachable: down)"
    backend.record = LeaseRecord(holder="r2", epoch=4, expires_at=1e9)
    backend.down = False
    await rig.service.tick()
    assert rig.refusal() == "standby: lease held by r2"


async def test_an_unreachable_backend_is_said_on_ready_for_a_standby(autojump_clock: MockClock,
                                                                    tmp_path: Path) -> None:
    backend = MemoryBackend()
    backend.record = LeaseRecord(holder="r2", epoch=1, expires_at=1e9)
    rig = Rig(tmp_path, backend)
    await rig.service.tick()
    backend.down = True
    await rig.service.tick()
    assert rig.refusal() == "standby: lease held by r2 (memory unreachable: down)"
    backend.down = False
    await rig.service.tick()
    assert rig.refusal() == "standby: lease held by r2"
    assert math.isinf(rig.service.admission_deadline)


# -- issue 19: hand-over, deleted and reset records, retried releases -------------------------


async def test_a_shutdown_release_lands_before_the_service_returns_even_when_cancelled_at_once(
        autojump_clock: MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    backend = MemoryBackend()
    backend.release_delay_s = 0.5  # slower than the router's own shutdown when idle
    rig = Rig(tmp_path, backend)
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.service.run)
        await trio.sleep(1.0)
        assert rig.service.role is Role.ACTIVE
        rig.service.begin_shutdown()
        # Serving stopped at once; the router's nursery is cancelled as soon as its server drained.
        assert rig.refusal() == "standby: lease held by nobody" and rig.stage.paused
        nursery.cancel_scope.cancel()
    assert backend.record is not None and backend.record.holder == "" and backend.releases == [(1.5, 1)]
    assert events(caplog, "lease_released")[0]["reason"] == "shutdown"


async def test_a_shutdown_release_that_cannot_land_is_bounded(autojump_clock: MockClock, tmp_path: Path) -> None:
    backend = MemoryBackend()
    rig = Rig(tmp_path, backend)
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.service.run)
        await trio.sleep(1.0)
        backend.down = True
        rig.service.begin_shutdown()
        nursery.cancel_scope.cancel()
    # Retried, then given up at the short deadline: exit is not held up by a dead backend.
    assert trio.current_time() <= 1.0 + rig.service.shutdown_release_s
    assert backend.record is not None and backend.record.holder == "r1"


async def test_a_holder_whose_record_was_deleted_fences_at_once_and_no_standby_takes_it_early(
        autojump_clock: MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    backend = MemoryBackend()
    backend.record = LeaseRecord(holder="", epoch=6)
    holder = Rig(tmp_path, backend, router_id="r1")
    standby = Rig(tmp_path, backend, router_id="r2")
    await holder.service.tick()
    assert holder.service.role is Role.ACTIVE and holder.service.holding.epoch == 7
    await standby.service.tick()
    assert standby.service.role is Role.STANDBY
    backend.record = None  # rm lease.json / etcdctl del --prefix / etcd restored empty
    await standby.service.tick()
    # The holder may admit until its own next renewal: the standby does not take the lease yet.
    assert standby.service.role is Role.STANDBY and backend.record is None
    assert events(caplog, "lease_record_missing")[0]["holder"] == "r1"
    await trio.sleep(RENEW_S)
    await holder.service.tick()
    assert holder.service.role is Role.FENCED and (holder.refusal() or "").startswith(FENCED_REASON)
    # Not before the old holder's fencing deadline has surely passed (TTL after the record went missing).
    missing_at = trio.current_time() - RENEW_S
    while trio.current_time() < missing_at + TTL_S - RENEW_S:
        await standby.service.tick()
        assert standby.service.role is Role.STANDBY
        await trio.sleep(RENEW_S)
    await trio.sleep_until(missing_at + TTL_S)
    await standby.service.tick()
    assert standby.service.role is Role.ACTIVE
    # Epochs identify terms: never handed out again after a reset.
    assert standby.service.holding.epoch == 8 and backend.record.epoch == 8


async def test_a_missing_record_whose_term_the_backend_proves_over_is_taken_at_once(
        autojump_clock: MockClock, tmp_path: Path) -> None:
    backend = MemoryBackend()
    backend.record = LeaseRecord(holder="r2", epoch=3, expires_at=1e9)
    rig = Rig(tmp_path, backend)
    await rig.service.tick()
    backend.record = None  # an etcd key gone with its expired lease
    backend.terms_over = True
    await rig.service.tick()
    assert rig.service.role is Role.ACTIVE and rig.service.holding.epoch == 4


async def test_a_fresh_router_takes_a_lease_nobody_was_seen_holding(autojump_clock: MockClock,
                                                                    tmp_path: Path) -> None:
    rig = Rig(tmp_path, MemoryBackend())
    await rig.service.tick()
    assert rig.service.role is Role.ACTIVE and rig.service.holding.epoch == 1


async def test_after_an_epoch_reset_the_standby_follows_the_new_term_and_says_what_it_skips(
        autojump_clock: MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    backend = MemoryBackend()
    backend.record = LeaseRecord(holder="r2", epoch=5, expires_at=1e9)
    writer = Rig(tmp_path, MemoryBackend(), router_id="r2")

    def document(holder: str, epoch: int, pass_number: int, drained: bool) -> bytes:
        fleet = Rig(tmp_path, MemoryBackend(), router_id=f"w{pass_number}").fleet
        if drained:
            fleet.add_hold("d1", HoldKind.OPERATOR_DRAIN, "operator drain", trio.current_time())
        writer.stage.fleet = fleet
        writer.stage.extra = lambda: HandoffExtra(lease=LeaseOwnership(holder=holder, epoch=epoch))
        return handoff.encode_document(writer.stage.document(pass_number))

    rig = Rig(tmp_path, backend)
    backend.handoff = document("r2", 5, 1, drained=False)
    await rig.service.tick()
    assert rig.service.applied_epoch == 5
    # The epoch counter was reset (etcd restored from an old snapshot): r3 now holds epoch 1
    # and drains d1. Its handoff is the one to follow, though its epoch is lower.
    backend.record = LeaseRecord(holder="r3", epoch=1, expires_at=1e9)
    backend.handoff = document("r3", 1, 7, drained=True)
    await rig.service.tick()
    assert (rig.service.applied_epoch, rig.service.applied_pass) == (1, 7)
    assert [view.name for view in rig.fleet.views(trio.current_time()) if not view.eligible] == ["d1"]
    view = rig.service.view()
    assert (view.holder, view.epoch, view.handoff_applied_epoch) == ("r3", 1, 1)
    # A late document of the previous term is not applied, and it is said.
    backend.handoff = document("r2", 5, 2, drained=False)
    await rig.service.tick()
    assert rig.service.applied_pass == 7
    skipped = events(caplog, "handoff_skipped")
    assert skipped and skipped[-1]["holder"] == "r2" and skipped[-1]["epoch"] == 5
    assert "r3 epoch 1" in skipped[-1]["reason"]


async def test_a_fenced_holders_release_is_retried_until_it_lands_before_expiry(
        autojump_clock: MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    backend = MemoryBackend()
    rig = Rig(tmp_path, backend)
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.service.run)
        await trio.sleep(0.5)
        backend.down = True  # renewals at 3 and 6 fail; fenced at 0 + TTL - MARGIN = 8
        await trio.sleep_until(9.2)  # past the first standby tick (9), which fails
        assert rig.service.role is Role.FENCED and backend.releases == []
        backend.down = False
        await trio.sleep_until(TTL_S)
        nursery.cancel_scope.cancel()
    # Handed back before the record would have expired by itself (at TTL), not tried once.
    assert backend.releases and backend.releases[0][1] == 1 and backend.releases[0][0] < TTL_S
    failed = events(caplog, "lease_release_failed")
    assert failed and failed[0]["will_retry"] and failed[0]["reason"] == "memory unreachable: down"


async def test_an_abandoned_acquisition_that_lands_late_is_handed_back(
        autojump_clock: MockClock, tmp_path: Path) -> None:
    backend = MemoryBackend()
    backend.record = LeaseRecord(holder="r2", epoch=2, expires_at=0.0)
    rig = Rig(tmp_path, backend)
    backend.stall_acquire = trio.Event()  # a stalled filesystem
    await rig.service.tick()
    assert rig.service.role is Role.STANDBY and rig.service.backend_problem is not None
    # The write finished later after all: the record names r1, which never served under it.
    backend.record = LeaseRecord(holder="r1", epoch=3, expires_at=trio.current_time() + TTL_S)
    backend.stall_acquire.set()
    await trio.sleep(RENEW_S)
    await rig.service.tick()
    assert backend.releases and backend.releases[0][1] == 3
    await rig.service.tick()
    assert rig.service.role is Role.ACTIVE and rig.service.holding.epoch == 4


async def test_a_degraded_standby_neither_acquires_nor_requests_a_takeover(
        autojump_clock: MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    backend = MemoryBackend()
    rig = Rig(tmp_path, backend, ready=lambda request: httpx.Response(503, text="monitoring degraded\n"))
    rig.admission.close("monitor", "monitoring degraded: persistence OSError")
    await rig.service.tick()
    assert rig.service.role is Role.STANDBY and backend.record is None  # break 2
    backend.record = LeaseRecord(holder="r2", epoch=1, advertise_url="http://r2.test:8000", expires_at=1e9)
    for _ in range(6):
        await rig.service.tick()
    assert backend.record.takeover is None and not events(caplog, "takeover_requested")  # break 1


async def test_a_router_that_yielded_does_not_report_its_own_documents_as_skipped(
        autojump_clock: MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    backend = MemoryBackend()
    rig = Rig(tmp_path, backend)
    await rig.service.tick()
    await rig.stage.run(1)
    backend.handoff = Path(rig.stage.path).read_bytes()  # our own document, epoch 1
    await rig.service.release("takeover requested by r2")
    backend.record = LeaseRecord(holder="r2", epoch=2, expires_at=1e9)
    await rig.service.tick()
    assert rig.service.role is Role.STANDBY and not events(caplog, "handoff_skipped")
    # The same router id after a restart held no term: its old document is another term's.
    restarted = Rig(tmp_path, backend)
    await restarted.service.tick()
    assert events(caplog, "handoff_skipped")[0]["holder"] == "r1"


async def test_a_restarted_router_takes_over_its_predecessors_last_handoff(
        autojump_clock: MockClock, tmp_path: Path) -> None:
    # The same router id, restarted after a crash: its predecessor's record and handoff are
    # another process's term, to be applied when it takes the lease again (a drain survives).
    backend = MemoryBackend()
    writer = Rig(tmp_path, MemoryBackend(), router_id="r1")
    writer.fleet.add_hold("d1", HoldKind.OPERATOR_DRAIN, "operator drain", trio.current_time())
    writer.stage.extra = lambda: HandoffExtra(lease=LeaseOwnership(holder="r1", epoch=3))
    backend.handoff = handoff.encode_document(writer.stage.document(9))
    backend.record = LeaseRecord(holder="r1", epoch=3, expires_at=RENEW_S)
    rig = Rig(tmp_path, backend)
    await rig.service.tick()
    assert rig.service.role is Role.STANDBY
    await trio.sleep_until(RENEW_S)
    await rig.service.tick()
    assert rig.service.role is Role.ACTIVE and rig.service.holding.epoch == 4
    assert (rig.service.applied_epoch, rig.service.applied_pass) == (3, 9)
    assert [view.name for view in rig.fleet.views(trio.current_time()) if not view.eligible] == ["d1"]


async def test_a_new_holder_reads_the_last_handoff_before_it_admits(
        autojump_clock: MockClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The old holder drains d1 and gives the lease up between two of the standby's ticks: the standby has
    # followed every earlier handoff, but only the last one has the drain. It must read that one before it
    # opens admission, or it places requests on the drained engine.
    backend = MemoryBackend()
    old = Rig(tmp_path, backend, router_id="r2")
    await old.service.tick()
    assert old.service.role is Role.ACTIVE
    await old.stage.run(1)
    backend.handoff = Path(old.stage.path).read_bytes()
    new = Rig(tmp_path, backend, router_id="r1")
    await new.service.tick()
    assert new.service.role is Role.STANDBY and new.service.applied_pass == 1

    def drained() -> list[str]:
        return [view.name for view in new.fleet.views(trio.current_time()) if not view.eligible]

    assert drained() == []
    opened: list[list[str]] = []
    real_open = new.admission.open

    def open_admission(gate: str) -> None:
        opened.append(drained())
        real_open(gate)

    monkeypatch.setattr(new.admission, "open", open_admission)
    await trio.sleep(1.0)
    old.fleet.add_hold("d1", HoldKind.OPERATOR_DRAIN, "operator drain", trio.current_time())
    await old.stage.run(2)
    backend.handoff = Path(old.stage.path).read_bytes()
    await old.service.release("shutdown")
    assert backend.record is not None and backend.record.holder == ""
    await new.service.tick()
    assert new.service.role is Role.ACTIVE and new.refusal() is None
    # The drain was in place when admission opened, not applied afterwards.
    assert opened == [["d1"]] and new.service.applied_pass == 2


async def test_a_holder_that_never_saw_the_last_one_still_reads_its_last_handoff(
        autojump_clock: MockClock, tmp_path: Path) -> None:
    # A router started after the old holder released the lease follows nobody (the record names nobody):
    # taking the lease, it must still apply the last handoff of the term before its own, or a drain the
    # old holder wrote just before it gave up is lost.
    backend = MemoryBackend()
    old = Rig(tmp_path, backend, router_id="r2")
    await old.service.tick()
    assert old.service.role is Role.ACTIVE
    old.fleet.add_hold("d1", HoldKind.OPERATOR_DRAIN, "operator drain", trio.current_time())
    await old.stage.run(1)
    backend.handoff = Path(old.stage.path).read_bytes()
    await old.service.release("shutdown")
    assert backend.record is not None and backend.record.holder == ""
    new = Rig(tmp_path, backend, router_id="r1")
    await new.service.tick()
    assert new.service.role is Role.ACTIVE and new.service.applied_pass == 1
    assert [view.name for view in new.fleet.views(trio.current_time()) if not view.eligible] == ["d1"]


async def test_a_new_holder_never_applies_a_handoff_of_a_later_term(autojump_clock: MockClock, tmp_path: Path) -> None:
    # A document that claims a term after the one acquired is not the last term's: it is skipped.
    backend = MemoryBackend()
    old = Rig(tmp_path, backend, router_id="r2")
    await old.service.tick()
    old.fleet.add_hold("d1", HoldKind.OPERATOR_DRAIN, "operator drain", trio.current_time())
    await old.stage.run(1)
    document = json.loads(Path(old.stage.path).read_bytes())
    document["lease"]["epoch"] = 1000
    backend.handoff = json.dumps(document).encode()
    await old.service.release("shutdown")
    new = Rig(tmp_path, backend, router_id="r1")
    await new.service.tick()
    assert new.service.role is Role.ACTIVE and new.service.applied_pass is None
    assert [view.name for view in new.fleet.views(trio.current_time()) if not view.eligible] == []
