"""Per-tenant limits: requests and tokens per minute as continuously refilled token buckets, and concurrency.

Pure: the caller passes ``now`` (any monotonic clock, in seconds). A bucket holds at most the per-minute limit
(times the router's share) and refills at limit / 60 per second. A request takes one request token at
admission; its tokens (prompt plus completion) are charged after it ends, so the token bucket may go
negative, and the tenant's next request waits until it is back above zero.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import msgspec

from narwhal.auth.keys import KeyEntry

__all__ = ["LimitRefusal", "TenantLimits", "format_reset"]

# A concurrency slot comes back when some request of the tenant ends: no time to compute, a second to suggest.
_CONCURRENT_RETRY_S = 1.0


class LimitRefusal(msgspec.Struct, frozen=True, kw_only=True):
    """A request over one of its tenant's limits: which, when to retry, and the headers of the 429."""

    reason: Literal["requests", "tokens", "concurrent"]
    retry_after_s: float
    headers: list[tuple[bytes, bytes]]


def format_reset(seconds: float) -> str:
    """A duration as OpenAI's ``x-ratelimit-reset-*`` writes it (Go's style): ``20ms``, ``1s``, ``6m0s``, ``1.5s``."""
    ms = math.ceil(max(seconds, 0.0) * 1000 - 1e-6)
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def _scaled(limit: int, share: float) -> int:
    # Floor (a tiny epsilon against 0.29 * 100 = 28.999...): the routers' shares never add up to more than the limit.
    return max(1, math.floor(limit * share + 1e-9))


class _Bucket:
    """Tokens up to ``capacity``, refilled at ``capacity / 60`` per second; full until first used."""

    __slots__ = ("capacity", "rate", "level", "last")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.rate = capacity / 60.0
        self.level = float(capacity)
        self.last: float | None = None

    def refill(self, now: float) -> float:
        if self.last is not None and now > self.last:
            self.level = min(float(self.capacity), self.level + (now - self.last) * self.rate)
        if self.last is None or now > self.last:
            self.last = now
        return self.level

    def rescale(self, capacity: int) -> None:
        # The same fraction of the new capacity (a deficit keeps its wait): a reload never refills a bucket.
        self.level = self.level * capacity / self.capacity
        self.capacity = capacity
        self.rate = capacity / 60.0

    def seconds_until(self, level: float) -> float:
        return max(0.0, (level - self.level) / self.rate)


def _bucket(old: _Bucket | None, limit: int | None, share: float) -> _Bucket | None:
    if limit is None:
        return None
    capacity = _scaled(limit, share)
    if old is None:
        return _Bucket(capacity)
    if old.capacity != capacity:
        old.rescale(capacity)
    return old


class _Tenant:
    __slots__ = ("requests", "tokens", "max_concurrent", "in_flight")

    def __init__(self) -> None:
        self.requests: _Bucket | None = None
        self.tokens: _Bucket | None = None
        self.max_concurrent: int | None = None
        self.in_flight = 0


class TenantLimits:
    """Every tenant's token buckets (requests, tokens per minute, refilled continuously) and concurrency."""

    def __init__(self) -> None:
        self._tenants: dict[str, _Tenant] = {}
        # The tenants with at least one limit (the others' requests skip the buckets).
        self.limited: frozenset[str] = frozenset()

    def configure(self, keys: Sequence[KeyEntry], share: float = 1.0) -> None:
        """Take the limits of ``keys`` times ``share`` (this router's part, 0 < share <= 1), at least 1 each.

        Kept tenants keep their buckets (scaled to the new capacity, never refilled) and their requests in
        flight; removed tenants are forgotten.
        """
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        tenants: dict[str, _Tenant] = {}
        for entry in keys:
            tenant = self._tenants.get(entry.name) or _Tenant()
            tenant.requests = _bucket(tenant.requests, entry.requests_per_minute, share)
            tenant.tokens = _bucket(tenant.tokens, entry.tokens_per_minute, share)
            tenant.max_concurrent = None if entry.max_concurrent is None else _scaled(entry.max_concurrent, share)
            tenants[entry.name] = tenant
        self._tenants = tenants
        self.limited = frozenset(name for name, tenant in tenants.items()
                                 if tenant.requests is not None or tenant.tokens is not None
                                 or tenant.max_concurrent is not None)

    def admit(self, tenant: str, now: float) -> LimitRefusal | None:
        """Take one request (and one concurrency slot), or refuse saying which limit and when to retry."""
        state = self._tenants.get(tenant)
        if state is None:
            return None  # a tenant without limits (or removed by a reload since its key was looked up)
        refusals: list[tuple[float, Literal["requests", "tokens", "concurrent"]]] = []
        if state.requests is not None and state.requests.refill(now) < 1:
            refusals.append((state.requests.seconds_until(1.0), "requests"))
        if state.tokens is not None and state.tokens.refill(now) <= 0:
            # Available again once above zero: the deficit's time, and a millisecond to be above it.
            refusals.append((state.tokens.seconds_until(0.0) + 0.001, "tokens"))
        if state.max_concurrent is not None and state.in_flight >= state.max_concurrent:
            refusals.append((_CONCURRENT_RETRY_S, "concurrent"))
        if refusals:
            # The client must wait for every refused resource: the longest wait is the one to name.
            retry_after_s, reason = max(refusals)
            headers = self.headers(tenant, now)
            headers.append((b"retry-after", str(max(1, math.ceil(retry_after_s))).encode()))
            return LimitRefusal(reason=reason, retry_after_s=retry_after_s, headers=headers)
        if state.requests is not None:
            state.requests.level -= 1
        state.in_flight += 1
        return None

    def release(self, tenant: str) -> None:
        """The request ended: its concurrency slot back."""
        state = self._tenants.get(tenant)
        if state is not None and state.in_flight > 0:
            state.in_flight -= 1

    def charge(self, tenant: str, tokens: int, now: float) -> None:
        """Take a finished request's tokens (prompt plus completion); the bucket may go below zero."""
        state = self._tenants.get(tenant)
        if state is not None and state.tokens is not None and tokens > 0:
            state.tokens.refill(now)
            state.tokens.level -= tokens

    def headers(self, tenant: str, now: float) -> list[tuple[bytes, bytes]]:
        """OpenAI's ``x-ratelimit-*`` headers for the limits ``tenant`` has (none without limits)."""
        state = self._tenants.get(tenant)
        headers: list[tuple[bytes, bytes]] = []
        if state is None:
            return headers
        for kind, bucket in (("requests", state.requests), ("tokens", state.tokens)):
            if bucket is None:
                continue
            level = bucket.refill(now)
            headers += [
                (b"x-ratelimit-limit-" + kind.encode(), str(bucket.capacity).encode()),
                (b"x-ratelimit-remaining-" + kind.encode(), str(max(0, math.floor(level))).encode()),
                (b"x-ratelimit-reset-" + kind.encode(), format_reset(bucket.seconds_until(bucket.capacity)).encode()),
            ]
        return headers

    def in_flight(self, tenant: str) -> int:
        """The tenant's admitted requests not yet released (0 for an unknown tenant)."""
        state = self._tenants.get(tenant)
        return 0 if state is None else state.in_flight
