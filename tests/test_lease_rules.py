"""The lease's pure rules: the fencing deadline, late renewals, takeover counting, config timing.

Times are exact: the holding reads trio's MockClock (autojump), or a plain fake clock.
"""

from __future__ import annotations

import math
import re

import pytest
import trio
from trio.testing import MockClock

from narwhal.config import ConfigError, parse_config
from narwhal.fleet.admission import FENCED_REASON, Admission
from narwhal.lease.rules import LeaseHolding, LeaseRecord, Role, TakeoverCounter, standby_reason, timing_problem

ENGINES = ('[[engines]]\nname = "p1"\nurl = "http://127.0.0.1:9001"\nrole = "prefill"\n'
           '[[engines]]\nname = "d1"\nurl = "http://127.0.0.1:9002"\nrole = "decode"\n')


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def holding(clock, ttl_s: float = 10.0, fence_margin_s: float = 2.0) -> LeaseHolding:
    return LeaseHolding(router_id="r1", ttl_s=ttl_s, fence_margin_s=fence_margin_s, clock=clock)


# -- fencing at exactly last_renew_sent + ttl_s - fence_margin_s -------------------------


async def test_fencing_deadline_is_last_renewal_sent_plus_ttl_minus_margin(autojump_clock: MockClock) -> None:
    lease = holding(trio.current_time)
    lease.acquired(epoch=1, sent_at=trio.current_time())
    assert lease.admission_deadline == 8.0
    await trio.sleep(3.0)
    sent = trio.current_time()
    await trio.sleep(0.5)  # the answer takes half a second: the deadline counts from the send
    assert lease.renewal_succeeded(sent)
    assert lease.admission_deadline == 3.0 + 10.0 - 2.0
    await trio.sleep_until(11.0 - 1e-9)
    assert lease.valid() and not lease.deadline_passed()
    await trio.sleep_until(11.0)
    assert not lease.valid()
    assert lease.deadline_passed()
    assert lease.role is Role.FENCED
    assert lease.admission_deadline == -math.inf


async def test_admission_refuses_from_the_deadline_on_without_any_task_closing_it(
        autojump_clock: MockClock) -> None:
    admission = Admission()
    lease = holding(trio.current_time)
    lease.acquired(epoch=4, sent_at=0.0)
    admission.lease_deadline = lease.admission_deadline
    assert admission.refusal(7.999) is None
    assert admission.refusal(8.0) == FENCED_REASON
    # With the request path's clock, reason() (what the request core asks) compares it too.
    clocked = Admission(clock=trio.current_time)
    clocked.lease_deadline = lease.admission_deadline
    await trio.sleep_until(8.0 - 1e-9)
    assert clocked.reason() is None
    await trio.sleep_until(8.0)
    assert clocked.reason() == FENCED_REASON
    # Shutdown and a lease closure say their own reason; the monitor's comes after the lease.
    admission.close("monitor", "monitoring degraded: health TimeoutError")
    assert admission.refusal(9.0) == FENCED_REASON
    admission.close("shutdown", "shutting down")
    assert admission.refusal(9.0) == "shutting down"


def test_an_older_renewal_answering_late_does_not_move_the_deadline_back() -> None:
    clock = FakeClock(0.0)
    lease = holding(clock)
    lease.acquired(epoch=1, sent_at=0.0)
    clock.now = 2.0
    assert lease.renewal_succeeded(2.0)
    clock.now = 2.5
    assert lease.renewal_succeeded(1.0)  # sent before the last one: no effect on the deadline
    assert lease.admission_deadline == 10.0


# -- a renewal succeeding after the deadline does not unfence -----------------------------


def test_a_renewal_that_succeeds_after_the_deadline_fences_and_stays_fenced() -> None:
    clock = FakeClock(0.0)
    lease = holding(clock)
    lease.acquired(epoch=3, sent_at=0.0)
    clock.now = 7.9
    sent = clock.now
    clock.now = 8.1  # the answer arrives past the deadline (0 + 10 - 2)
    assert not lease.renewal_succeeded(sent)
    assert lease.role is Role.FENCED
    assert not lease.valid()
    clock.now = 8.2
    assert not lease.renewal_succeeded(8.15)  # nor does any later one
    assert lease.role is Role.FENCED and lease.admission_deadline == -math.inf
    lease.acquired(epoch=4, sent_at=8.2)  # only a fresh acquisition, with a new epoch
    assert lease.valid() and lease.epoch == 4 and lease.admission_deadline == pytest.approx(16.2)


def test_a_fenced_router_becomes_a_standby_only_when_another_holds_the_lease() -> None:
    clock = FakeClock(0.0)
    lease = holding(clock)
    lease.acquired(epoch=3, sent_at=0.0)
    clock.now = 9.0
    assert lease.deadline_passed()
    lease.observed(LeaseRecord(holder="r1", epoch=3))
    assert lease.role is Role.FENCED
    lease.observed(LeaseRecord(holder="r2", epoch=4))
    assert lease.role is Role.STANDBY and lease.holder == "r2" and lease.epoch == 4


def test_released_is_a_standby_that_never_admits() -> None:
    clock = FakeClock(0.0)
    lease = holding(clock)
    lease.acquired(epoch=1, sent_at=0.0)
    lease.released()
    assert lease.role is Role.STANDBY and not lease.valid() and lease.admission_deadline == -math.inf
    assert standby_reason("r2") == "standby: lease held by r2"


# -- takeover counting ---------------------------------------------------------------------


def test_takeover_counts_consecutive_503s_of_one_holder_epoch() -> None:
    counter = TakeoverCounter(3)
    assert not counter.observe(5, 503, "monitoring degraded: persistence OSError")
    assert not counter.observe(5, 503, "monitoring degraded: persistence OSError")
    assert counter.observe(5, 503, "monitoring degraded: persistence OSError")
    # The threshold restarts the count: another request needs three more.
    assert counter.failures == 0
    assert [counter.observe(5, 503) for _ in range(3)] == [False, False, True]


def test_a_ready_or_unreachable_holder_or_a_new_epoch_resets_the_count() -> None:
    counter = TakeoverCounter(2)
    assert not counter.observe(1, 503)
    assert not counter.observe(1, 200)
    assert not counter.observe(1, 503)
    assert not counter.observe(1, None)  # unreachable: left to the lease's expiry
    assert not counter.observe(1, 503)
    assert not counter.observe(2, 503)  # a new holder starts from zero
    assert counter.observe(2, 503)


def test_file_record_is_free_when_released_or_past_its_expiry() -> None:
    assert LeaseRecord().free_at(0.0)
    held = LeaseRecord(holder="r1", epoch=2, expires_at=50.0)
    assert not held.free_at(49.99)
    assert held.free_at(50.0)


# -- config validation -------------------------------------------------------------------


@pytest.mark.parametrize(("ttl", "renew", "margin", "ok"), [
    (10.0, 3.0, 2.0, True), (8.0, 3.0, 2.0, False), (8.01, 3.0, 2.0, True), (2.0, 0.4, 0.6, True),
])
def test_ttl_must_exceed_margin_plus_two_renewals(ttl: float, renew: float, margin: float, ok: bool) -> None:
    assert (timing_problem(ttl, renew, margin) is None) is ok
    text = f"[lease]\nttl_s = {ttl}\nrenew_interval_s = {renew}\nfence_margin_s = {margin}\n" + ENGINES
    if ok:
        assert parse_config(text).lease.ttl_s == ttl
        return
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    message = str(caught.value)
    assert "\n" not in message
    assert message == (f"<config>: lease: ttl_s ({ttl:g}) must be > fence_margin_s ({margin:g}) "
                       f"+ 2 x renew_interval_s ({renew:g})")


@pytest.mark.parametrize(("lease", "expected"), [
    ('renew_interval_s = 0', "lease: renew_interval_s must be > 0"),
    ('takeover_ready_failures = 0', "lease: takeover_ready_failures must be > 0"),
    ('endpoints = ["localhost:2379"]', "lease: endpoints[0] must be http(s)://HOST:PORT"),
    ('advertise_url = "r1:8000"', "lease: advertise_url must be http(s)://HOST[:PORT]"),
    ('backend = "etcd"', "lease.endpoints is required"),
])
def test_lease_keys_are_validated_naming_the_key(lease: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(expected)):
        parse_config(f"[lease]\n{lease}\n" + ENGINES)


def test_the_example_pair_is_a_pair() -> None:
    from pathlib import Path

    from narwhal.config import load_config

    root = Path(__file__).resolve().parent.parent / "examples"
    a, b = load_config(root / "standby-a.toml"), load_config(root / "standby-b.toml")
    assert a.lease.backend == b.lease.backend == "file"
    assert (a.lease.path, a.handoff.path, a.engines) == (b.lease.path, b.handoff.path, b.engines)
    assert a.lease.router_id != b.lease.router_id
    assert a.lease.advertise_url != b.lease.advertise_url
