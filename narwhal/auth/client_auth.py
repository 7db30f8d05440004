"""The request path's client auth: the caller's key, the models it may use, its limits and its place in line.

``ClientAuth`` is what the request core asks, in this order, before any engine
sees a request: ``identify`` (401 ``invalid_api_key``), ``check_model`` (403
``model_not_allowed``), ``admit`` (429 ``rate_limit_exceeded`` with OpenAI's
``x-ratelimit-*`` headers), then the priority gate's ``enter`` (503
``overloaded`` / ``pool_saturated`` / ``queue_full`` with ``retry-after``).
``finish`` gives back what ``admit`` and ``enter`` took and charges the tokens
the request used. Without a keys file the data plane builds no ``ClientAuth``:
nothing of this runs (and the bounded policy waits for capacity as before,
without the gate). ``AuthSettings(keys=None)`` (every caller the anonymous
tenant) exists for the gate's own tests; the router never builds it.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import trio

from narwhal.auth.keys import KeyEntry, KeyStore, read_keys_file
from narwhal.auth.limits import TenantLimits
from narwhal.auth.priority import GateRefused, PriorityGate, Ticket
from narwhal.config import Config, ConfigError, resolve_config_path
from narwhal.errors import NarwhalError

__all__ = ["ANONYMOUS", "Admitted", "AuthRefused", "AuthSettings", "ClientAuth", "KeyMemo", "read_client_keys"]

# The one tenant when a ClientAuth has no keys (its own tests; the router builds none without a keys file).
ANONYMOUS = KeyEntry(name="-", sha256="0" * 64)


def read_client_keys(config: Config, base_dir: Path | None) -> list[KeyEntry] | None:
    """The entries of ``[auth] keys_file`` (None when unset); a ConfigError naming ``auth.keys_file`` otherwise."""
    if config.auth.keys_file is None:
        return None
    path = resolve_config_path(config.auth.keys_file, base_dir)
    try:
        return list(read_keys_file(path).keys)
    except ConfigError as exc:
        raise ConfigError(f"auth.keys_file: {exc}") from None


class AuthSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What the data plane needs of ``[auth]`` (the keys as read by the controller) and ``serving.max_queue``."""

    keys: list[KeyEntry] | None = None  # None: no client auth
    reserve_high: float = 0.0
    max_queue: int = 256
    # This router's part of each limit (1 / routers serving, x 1 / worker processes).
    share: float = 1.0


class AuthRefused(NarwhalError):
    """A request refused by client auth: the status, the OpenAI error body's fields and the headers to send."""

    def __init__(self, status: int, message: str, type_: str, code: str, reason: str,
                 headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        # The refusal's reason label (narwhal_tenant_refusals_total): invalid_api_key, model, requests, ...
        self.reason = reason
        self.headers = list(headers)


class KeyMemo:
    """One client connection's last verified key: its ``Authorization`` header, the key set it was found in
    and the entry. A reload replaces the key set, so a memo of the old one is never used again."""

    __slots__ = ("entry", "header", "store")

    def __init__(self) -> None:
        self.header = b""
        self.store: KeyStore | None = None
        self.entry: KeyEntry | None = None


class Admitted:
    """One admitted request's holdings: its tenant, its gate ticket (and how long it waited for it), and whether
    it took its tenant's limits (a tenant without limits takes none: no clock read, no bucket).

    A served request carries no ``x-ratelimit-*`` headers (a refused one does): computing them costs a refill
    and six formatted values per request, for headers OpenAI's clients read only on a 429.
    """

    __slots__ = ("key", "limited", "queue_wait_s", "ticket")

    def __init__(self, key: KeyEntry, ticket: Ticket | None, queue_wait_s: float, limited: bool = False) -> None:
        self.key = key
        self.ticket = ticket
        self.queue_wait_s = queue_wait_s
        self.limited = limited


def _retry_after(seconds: float) -> tuple[bytes, bytes]:
    return b"retry-after", str(max(1, math.ceil(seconds))).encode()


class ClientAuth:
    """Keys, limits and the priority gate of one data-plane process."""

    def __init__(self, settings: AuthSettings, *, capacity: int, bounded: bool,
                 clock: Callable[[], float] = trio.current_time) -> None:
        self._clock = clock
        self._bounded = bounded
        self.enabled = settings.keys is not None
        self.store = KeyStore(settings.keys or [])
        self.limits = TenantLimits()
        self.limits.configure(settings.keys or [], share=settings.share)
        # The tenants with a limit: only their requests read the clock and touch a bucket.
        self.limited = self.limits.limited
        self._free = _free_admissions(settings)
        self.gate = PriorityGate(capacity=capacity, reserve_high=settings.reserve_high,
                                 max_queue=settings.max_queue, clock=clock)
        self._capacity = capacity
        self.settings = settings
        self._gated = _gated(settings, bounded)

    def configure(self, settings: AuthSettings) -> None:
        """A reload (or a new share): keys added are admitted at once, keys removed refused at once."""
        if settings == self.settings:
            return
        self.settings = settings
        self.enabled = settings.keys is not None
        self.store = KeyStore(settings.keys or [])
        self.limits.configure(settings.keys or [], share=settings.share)
        self.limited = self.limits.limited
        self._free = _free_admissions(settings)
        self.gate.reconfigure(capacity=self._capacity, reserve_high=settings.reserve_high,
                              max_queue=settings.max_queue)
        # Requests admitted ungated before a reload that gates them hold no ticket: the gate counts from here
        # (the data pool's own connection bound still holds meanwhile).
        self._gated = _gated(settings, self._bounded)

    def identify(self, authorization: bytes | None, memo: KeyMemo | None = None) -> KeyEntry:
        """The caller's key entry; 401 for a missing, malformed or unknown key.

        ``memo``: the connection's last verified key (``KeyMemo``); the same header again on it, with the same
        keys, is that entry without a hash (compared in constant time, as the digest would be)."""
        if not self.enabled:
            return ANONYMOUS
        store = self.store
        if memo is not None and memo.store is store and authorization is not None:
            entry = memo.entry
            if entry is not None and hmac.compare_digest(memo.header, authorization):
                return entry
        key = store.lookup(authorization)
        if key is None:
            what = "no API key" if authorization is None else "an invalid API key"
            raise AuthRefused(401, f"this router needs a valid API key (Authorization: Bearer KEY); the request "
                              f"had {what}", "invalid_request_error", "invalid_api_key", "invalid_api_key",
                              [(b"www-authenticate", b'Bearer realm="narwhal"')])
        if memo is not None and authorization is not None:
            memo.header, memo.store, memo.entry = authorization, store, key
        return key

    def check_model(self, key: KeyEntry, names: Sequence[str]) -> None:
        """403 when the key may use none of ``names`` (the model as asked, and the served model it names)."""
        allowed = key.models
        if allowed is None or any(name in allowed for name in names):
            return
        raise AuthRefused(403, f"the API key {key.name!r} may not use the model {names[0]!r}",
                          "invalid_request_error", "model_not_allowed", "model")

    async def admit(self, key: KeyEntry, deadline: float) -> Admitted:
        """Take the tenant's limits and a place in the gate (waiting in line under the bounded policy)."""
        if not self._bounded:
            return self.admit_now(key)
        limited = key.name in self.limited and self._take_limits(key)
        try:
            ticket, waited = await self.gate.enter(key.name, key.priority, deadline)
        except BaseException as exc:
            refusal = self._not_admitted(key, limited, exc)
            if refusal is None:
                raise
            raise refusal from None
        return Admitted(key, ticket, waited, limited)

    def admit_now(self, key: KeyEntry) -> Admitted:
        """The saturate policy's admission: the tenant's limits and a slot at once, or a refusal; never waits."""
        limited = key.name in self.limited and self._take_limits(key)
        if not self._gated:
            if not limited:
                # Nothing taken, nothing to give back: the tenant's one shared admission (not a new object).
                try:
                    free = self._free[key.name]
                except KeyError:  # a reload removed the key since it was looked up
                    free = None
                if free is not None and free.key is key:
                    return free
            return Admitted(key, None, 0.0, limited)
        try:
            ticket = self.gate.try_enter(key.name, key.priority)
        except BaseException as exc:
            refusal = self._not_admitted(key, limited, exc)
            if refusal is None:
                raise
            raise refusal from None
        return Admitted(key, ticket, 0.0, limited)

    def _not_admitted(self, key: KeyEntry, limited: bool, exc: BaseException) -> AuthRefused | None:
        """The gate refused (503 to raise) or failed otherwise (None: re-raise); the limits taken go back."""
        if limited:
            self.limits.release(key.name)
        return _capacity_refusal(key, exc) if isinstance(exc, GateRefused) else None

    def _take_limits(self, key: KeyEntry) -> bool:
        """One request off a limited tenant's limits (True), or 429."""
        refusal = self.limits.admit(key.name, self._clock())
        if refusal is None:
            return True
        limit = {"requests": "requests per minute", "tokens": "tokens per minute",
                 "concurrent": "concurrent requests"}[refusal.reason]
        raise AuthRefused(429, f"rate limit reached for {key.name!r}: {limit}; retry after "
                          f"{max(1, math.ceil(refusal.retry_after_s))} s", "requests", "rate_limit_exceeded",
                          refusal.reason, refusal.headers)

    def finish(self, admitted: Admitted, tokens: int) -> None:
        """The request ended: its gate slot and concurrency back, its tokens charged."""
        if admitted.ticket is not None:
            self.gate.leave(admitted.ticket)
            admitted.ticket = None
        name = admitted.key.name
        if admitted.limited:
            admitted.limited = False
            self.limits.release(name)
        if tokens > 0 and name in self.limited:
            self.limits.charge(name, tokens, self._clock())


def _free_admissions(settings: AuthSettings) -> dict[str, Admitted]:
    """Each key's admission that holds nothing (no ticket, no limit taken): never changed by ``finish``."""
    return {key.name: Admitted(key, None, 0.0) for key in settings.keys or ()}


def _gated(settings: AuthSettings, bounded: bool) -> bool:
    """Whether requests pass the priority gate: always under the bounded policy (its queue); under saturate
    only with a reserve for high priority. Without one the gate would refuse exactly when the data pool is
    full, as the pool itself does (``pool_saturated``), so it is skipped: no ticket per request."""
    return bounded or settings.reserve_high > 0


def _capacity_refusal(key: KeyEntry, exc: GateRefused) -> AuthRefused:
    message = {"overloaded": f"the router is at capacity for {key.priority} priority requests",
               "pool_saturated": "router saturated: no free data connection",
               "queue_full": "the queue for capacity is full"}[exc.code]
    return AuthRefused(503, message, "service_unavailable", exc.code, exc.code, [_retry_after(exc.retry_after_s)])
