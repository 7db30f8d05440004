"""Per-tenant limits: buckets refilled on time, tokens charged after the fact, concurrency, share, reload, headers."""

from __future__ import annotations

import pytest
import trio

from narwhal.auth.keys import KeyEntry
from narwhal.auth.limits import TenantLimits, format_reset

H = "a" * 64


def key(name: str = "t", **limits: int) -> KeyEntry:
    return KeyEntry(name=name, sha256=(name.encode().hex() + H)[:64], **limits)


def limits_for(*keys: KeyEntry, share: float = 1.0) -> TenantLimits:
    limits = TenantLimits()
    limits.configure(keys, share)
    return limits


def admit_all(limits: TenantLimits, tenant: str, n: int, now: float) -> None:
    for _ in range(n):
        assert limits.admit(tenant, now) is None
        limits.release(tenant)


def test_a_tenant_without_limits_and_an_unknown_one_are_admitted():
    limits = limits_for(key("free"))
    for tenant in ("free", "unknown"):
        admit_all(limits, tenant, 1000, 0.0)
        assert limits.headers(tenant, 0.0) == []


def test_a_request_limit_refills_continuously():
    limits = limits_for(key(requests_per_minute=60))
    admit_all(limits, "t", 60, 100.0)
    refusal = limits.admit("t", 100.0)
    assert refusal is not None and refusal.reason == "requests"
    assert refusal.retry_after_s == pytest.approx(1.0)
    # One per second comes back: half a second is not enough, a second is, for one request only.
    assert limits.admit("t", 100.5) is not None
    assert limits.admit("t", 101.0) is None
    assert limits.admit("t", 101.0) is not None
    # A minute refills the bucket, never beyond its capacity.
    admit_all(limits, "t", 60, 1000.0)
    assert limits.admit("t", 1000.0) is not None


async def test_a_request_limit_refills_on_the_mock_clock(autojump_clock):
    # The rule a router drives with trio.current_time (MockClock, autojump_threshold=0): wait retry_after_s, retry.
    limits = limits_for(key(requests_per_minute=2))
    admitted = []
    start = trio.current_time()
    while len(admitted) < 5:
        refusal = limits.admit("t", trio.current_time())
        if refusal is None:
            limits.release("t")
            admitted.append(trio.current_time() - start)
        else:
            await trio.sleep(refusal.retry_after_s)
    assert admitted == pytest.approx([0.0, 0.0, 30.0, 60.0, 90.0], abs=1e-6)


def test_tokens_are_charged_after_the_fact_and_the_bucket_goes_negative():
    limits = limits_for(key(tokens_per_minute=600))  # 10 tokens a second
    assert limits.admit("t", 0.0) is None
    limits.charge("t", 1500, 0.0)  # the request used more than the whole bucket: 900 below zero
    limits.release("t")
    refusal = limits.admit("t", 0.0)
    assert refusal is not None and refusal.reason == "tokens"
    assert refusal.retry_after_s == pytest.approx(90.0, abs=0.01)
    # At 90 s the bucket is at zero, still refused: the first whole second it is above zero is 91.
    assert dict(refusal.headers)[b"retry-after"] == b"91"
    assert limits.admit("t", 89.0) is not None
    assert limits.admit("t", 90.1) is None


def test_a_bucket_at_zero_refuses_and_retry_after_is_at_least_one_second():
    limits = limits_for(key(tokens_per_minute=60))
    assert limits.admit("t", 0.0) is None
    limits.charge("t", 60, 0.0)
    refusal = limits.admit("t", 0.0)
    assert refusal is not None and refusal.reason == "tokens"
    assert 0 < refusal.retry_after_s < 0.01
    assert dict(refusal.headers)[b"retry-after"] == b"1"


def test_concurrency_is_released():
    limits = limits_for(key(max_concurrent=2))
    assert limits.admit("t", 0.0) is None
    assert limits.admit("t", 0.0) is None
    refusal = limits.admit("t", 0.0)
    assert refusal is not None and refusal.reason == "concurrent" and refusal.retry_after_s == 1.0
    assert dict(refusal.headers)[b"retry-after"] == b"1"
    limits.release("t")
    assert limits.admit("t", 0.0) is None
    # A release too many never makes room beyond the limit.
    for _ in range(5):
        limits.release("t")
    assert limits.in_flight("t") == 0


def test_a_refused_request_takes_nothing():
    limits = limits_for(key(requests_per_minute=60, max_concurrent=1))
    assert limits.admit("t", 0.0) is None
    for _ in range(10):
        assert limits.admit("t", 0.0).reason == "concurrent"
    limits.release("t")
    assert dict(limits.headers("t", 0.0))[b"x-ratelimit-remaining-requests"] == b"59"


def test_the_longest_wait_is_the_one_named():
    limits = limits_for(key(requests_per_minute=60, tokens_per_minute=60, max_concurrent=1))
    assert limits.admit("t", 0.0) is None
    limits.charge("t", 600, 0.0)
    refusal = limits.admit("t", 0.0)
    assert refusal.reason == "tokens" and refusal.retry_after_s == pytest.approx(540.0, abs=0.01)


@pytest.mark.parametrize(("limit", "share", "capacity"), [(60, 0.5, 30), (60, 1.0, 60), (1, 0.5, 1), (3, 0.5, 1),
                                                          (100, 1 / 3, 33), (100, 0.29, 29), (10, 0.01, 1)])
def test_share_scales_every_limit_at_least_one(limit, share, capacity):
    limits = limits_for(key(requests_per_minute=limit, tokens_per_minute=limit, max_concurrent=limit), share=share)
    headers = dict(limits.headers("t", 0.0))
    assert headers[b"x-ratelimit-limit-requests"] == headers[b"x-ratelimit-limit-tokens"] == str(capacity).encode()
    admit_all(limits, "t", capacity, 0.0)
    assert limits.admit("t", 0.0).reason == "requests"
    # The refill is the scaled limit per minute: one more request after 60 / capacity seconds.
    assert limits.admit("t", 60.0 / capacity) is None
    # And as many at once as the scaled max_concurrent (the buckets full again a minute later).
    for _ in range(capacity - 1):
        assert limits.admit("t", 1000.0) is None
    assert limits.admit("t", 1000.0).reason == "concurrent"


def test_share_must_be_a_part():
    for share in (0.0, -1.0, 1.5):
        with pytest.raises(ValueError):
            TenantLimits().configure([key()], share)


def test_reconfigure_keeps_state_scales_it_and_forgets_removed_tenants():
    limits = limits_for(key("a", requests_per_minute=60, tokens_per_minute=600, max_concurrent=2),
                        key("gone", requests_per_minute=1))
    assert limits.admit("a", 0.0) is None  # one slot in flight
    admit_all(limits, "a", 29, 0.0)  # 30 requests taken: half the bucket
    limits.charge("a", 1200, 0.0)  # 600 tokens below zero: 60 s to wait
    assert limits.admit("gone", 0.0) is None
    assert limits.admit("gone", 0.0) is not None
    limits.configure([key("a", requests_per_minute=120, tokens_per_minute=300, max_concurrent=1), key("new")])
    headers = dict(limits.headers("a", 0.0))
    # Half of the new capacity, not refilled; the token deficit scaled keeps its wait.
    assert headers[b"x-ratelimit-limit-requests"] == b"120"
    assert headers[b"x-ratelimit-remaining-requests"] == b"60"
    refusal = limits.admit("a", 0.0)
    assert refusal.reason == "tokens" and refusal.retry_after_s == pytest.approx(60.0, abs=0.01)
    # The request in flight kept its slot against the new max_concurrent of 1.
    assert limits.in_flight("a") == 1
    limits.charge("a", -5, 0.0)  # nothing to refund: a negative charge changes nothing
    assert limits.admit("a", 61.0).reason == "concurrent"
    limits.release("a")
    assert limits.admit("a", 61.0) is None
    # Removed: forgotten (no limits); configured again later, it starts full.
    assert limits.headers("gone", 0.0) == []
    admit_all(limits, "gone", 5, 0.0)
    limits.configure([key("gone", requests_per_minute=1)])
    assert limits.admit("gone", 0.0) is None
    assert limits.in_flight("gone") == 1


def test_a_limit_added_by_a_reload_starts_full_and_a_removed_one_stops_counting():
    limits = limits_for(key("a", requests_per_minute=1))
    assert limits.admit("a", 0.0) is None
    limits.release("a")
    limits.configure([key("a", tokens_per_minute=10)])
    admit_all(limits, "a", 10, 0.0)
    assert dict(limits.headers("a", 0.0)) == {
        b"x-ratelimit-limit-tokens": b"10", b"x-ratelimit-remaining-tokens": b"10",
        b"x-ratelimit-reset-tokens": b"0s"}


def test_headers_are_openais():
    limits = limits_for(key(requests_per_minute=60, tokens_per_minute=6000))
    assert limits.admit("t", 10.0) is None
    limits.charge("t", 600, 10.0)
    assert limits.headers("t", 10.0) == [
        (b"x-ratelimit-limit-requests", b"60"),
        (b"x-ratelimit-remaining-requests", b"59"),
        (b"x-ratelimit-reset-requests", b"1s"),
        (b"x-ratelimit-limit-tokens", b"6000"),
        (b"x-ratelimit-remaining-tokens", b"5400"),
        (b"x-ratelimit-reset-tokens", b"6s"),
    ]
    limits.charge("t", 6000, 10.0)  # 600 below zero: remaining 0, full again in 6000 + 600 tokens' time
    headers = dict(limits.headers("t", 10.0))
    assert headers[b"x-ratelimit-remaining-tokens"] == b"0"
    assert headers[b"x-ratelimit-reset-tokens"] == b"1m6s"
    refusal = limits.admit("t", 10.0)
    assert [name for name, _ in refusal.headers] == [
        b"x-ratelimit-limit-requests", b"x-ratelimit-remaining-requests", b"x-ratelimit-reset-requests",
        b"x-ratelimit-limit-tokens", b"x-ratelimit-remaining-tokens", b"x-ratelimit-reset-tokens", b"retry-after"]
    assert dict(refusal.headers)[b"retry-after"] == b"7"


@pytest.mark.parametrize(("seconds", "text"), [
    (0.0, "0s"), (-1.0, "0s"), (0.02, "20ms"), (0.0001, "1ms"), (0.25, "250ms"), (1.0, "1s"), (1.5, "1.5s"),
    (8.64, "8.64s"), (59.999, "59.999s"), (60.0, "1m0s"), (360.0, "6m0s"), (90.5, "1m30.5s"), (3600.0, "1h0m0s"),
    (3725.0, "1h2m5s"),
])
def test_reset_is_written_as_openai_writes_it(seconds, text):
    assert format_reset(seconds) == text
