"""The etcd lease, over etcd v3's JSON gateway (``/v3/...``) with httpx.

No maintained etcd v3 client runs on trio (the async ones are asyncio: grpc.aio
or aiohttp), and the gateway is a stable part of etcd's API, so this module
speaks it directly. Keys, beside ``lease.key`` (``K``)::

    K            the LeaseRecord as JSON, attached to the holder's etcd lease,
                 so it disappears when that lease expires or is revoked
    K/epoch      the last epoch handed out (no lease: it outlives holders)
    K/handoff    the holder's handoff document
    K/takeover   a standby's TakeoverRequest

Acquisition is one txn: K's create_revision is 0 (nobody holds it) and
K/epoch's mod_revision is what we read, then put K (with our lease) and
K/epoch + 1 and delete K/takeover. The handoff is put by a txn that compares
K's create_revision and lease with ours, so a writer whose lease is gone
cannot overwrite its successor's. Every call tries the endpoints in turn,
starting with the last one that answered (``narwhal.discovery.etcd_http.EtcdHttp``,
the transport discovery and ``narwhal register`` use too).
"""

from __future__ import annotations

import base64
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import msgspec

from narwhal.discovery.etcd_http import EtcdHttp, EtcdRefused, EtcdUnavailable
from narwhal.lease.backend import Acquisition, LeaseBackendError, Renewal
from narwhal.lease.rules import LeaseRecord, TakeoverRequest

__all__ = ["EtcdLeaseBackend"]

_encoder = msgspec.json.Encoder()
_decode_record = msgspec.json.Decoder(LeaseRecord)
_decode_takeover = msgspec.json.Decoder(TakeoverRequest)


def _b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


class _EtcdRefused(LeaseBackendError):
    """etcd answered the request with a 4xx: it understood and refused."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"etcd refused the request: HTTP {status} {text!r}")
        self.status = status


class _KeyValue(msgspec.Struct, kw_only=True):
    key: str = ""
    value: str = ""
    create_revision: int = 0
    mod_revision: int = 0
    lease: int = 0


def _kv(entry: dict[str, Any]) -> _KeyValue:
    # The gateway writes int64 as strings; msgspec converts them in lax mode.
    return msgspec.convert(entry, _KeyValue, strict=False)


class EtcdLeaseBackend:
    """The lease record, epoch counter, handoff and takeover request in etcd."""

    name = "etcd"

    def __init__(self, *, endpoints: Sequence[str], key: str, ttl_s: float, timeout_s: float,
                 client: httpx.AsyncClient | None = None, wall_clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        self.endpoints = [endpoint.rstrip("/") for endpoint in endpoints]
        self.key = key
        self.epoch_key = f"{key}/epoch"
        self.handoff_key = f"{key}/handoff"
        self.takeover_key = f"{key}/takeover"
        # etcd counts lease TTLs in whole seconds: round up, never down.
        self.grant_ttl_s = max(1, math.ceil(ttl_s))
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self.wall_clock = wall_clock
        self.monotonic = monotonic
        # A record put by hand without an etcd lease: (create, mod revision) and when we first saw it.
        self._unleased: tuple[tuple[int, int], float] | None = None
        # The transport discovery uses too: endpoints in turn, from the last one that answered.
        self._http = EtcdHttp(self.endpoints, timeout_s=timeout_s, client=client)
        # The etcd lease under which we hold the key, while we hold it.
        self._lease_id = 0

    def __repr__(self) -> str:
        endpoint = self._http.endpoints[self._http.current]
        return f"<EtcdLeaseBackend {self.key!r} at {endpoint} [lease {self._lease_id or '-'}]>"

    # -- transport ---------------------------------------------------------------------

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST to the first endpoint that answers; raise LeaseBackendError when none does."""
        try:
            return await self._http.post(path, body)
        except EtcdRefused as exc:
            # A definitive answer (e.g. "requested lease not found"): another member would say the same.
            raise _EtcdRefused(exc.status, exc.text) from None
        except EtcdUnavailable as exc:
            raise LeaseBackendError(str(exc)) from None

    async def _txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
                   failure: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return await self._post("/v3/kv/txn", {"compare": compare, "success": success, "failure": failure or []})

    def _range_op(self, key: str) -> dict[str, Any]:
        return {"request_range": {"key": _b64(key)}}

    @staticmethod
    def _ranged(answer: dict[str, Any], index: int) -> _KeyValue | None:
        """The key of the ``index``-th range response in a txn answer, or None when absent."""
        responses = answer.get("responses") or []
        if index >= len(responses):
            return None
        kvs = (responses[index].get("response_range") or {}).get("kvs") or []
        return _kv(kvs[0]) if kvs else None

    async def _range(self, key: str) -> _KeyValue | None:
        answer = await self._post("/v3/kv/range", {"key": _b64(key)})
        kvs = answer.get("kvs") or []
        return _kv(kvs[0]) if kvs else None

    def _record(self, kv: _KeyValue | None) -> LeaseRecord | None:
        if kv is None:
            return None
        try:
            record = _decode_record.decode(_unb64(kv.value))
        except (msgspec.DecodeError, ValueError) as exc:
            raise LeaseBackendError(f"etcd key {self.key} is not a lease record: {exc}") from None
        return msgspec.structs.replace(record, revision=kv.create_revision, lease_id=kv.lease)

    # -- the backend -------------------------------------------------------------------

    async def read(self) -> LeaseRecord | None:
        answer = await self._txn([], [self._range_op(self.key), self._range_op(self.takeover_key)])
        record = self._record(self._ranged(answer, 0))
        takeover = self._ranged(answer, 1)
        if record is not None and takeover is not None:
            record = msgspec.structs.replace(record, takeover=self._takeover(takeover))
        return record

    def _takeover(self, kv: _KeyValue) -> TakeoverRequest | None:
        try:
            return _decode_takeover.decode(_unb64(kv.value))
        except (msgspec.DecodeError, ValueError):
            return None  # a garbled request is no request

    def _unleased_expired(self, kv: _KeyValue) -> bool:
        """A record without an etcd lease nobody renews: it expires ``ttl_s`` after we first saw it."""
        seen = (kv.create_revision, kv.mod_revision)
        if self._unleased is None or self._unleased[0] != seen:
            self._unleased = (seen, self.monotonic())
        return self.monotonic() - self._unleased[1] >= self.ttl_s

    async def acquire(self, router_id: str, advertise_url: str, *, after_epoch: int = 0,
                      take_missing: bool = True) -> Acquisition:
        answer = await self._txn([], [self._range_op(self.key), self._range_op(self.epoch_key)])
        held_kv = self._ranged(answer, 0)
        held = self._record(held_kv)
        if held_kv is not None and held_kv.lease == 0 and self._unleased_expired(held_kv):
            # Written by hand (etcdctl put): no holder renews it, so it is replaced like an expired one.
            key_compare = [{"key": _b64(self.key), "target": "MOD", "result": "EQUAL",
                            "mod_revision": str(held_kv.mod_revision)}]
        elif held is not None or not take_missing:
            return Acquisition(acquired=False, record=held)
        else:
            key_compare = [{"key": _b64(self.key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}]
        epoch_kv = self._ranged(answer, 1)
        # Epochs identify terms: never reuse one, even after the counter was deleted or restored older.
        last_epoch = max(int(_unb64(epoch_kv.value) or b"0") if epoch_kv is not None else 0, after_epoch,
                         held.epoch if held is not None else 0)
        granted = await self._post("/v3/lease/grant", {"TTL": self.grant_ttl_s})
        lease_id = int(granted.get("ID") or 0)
        if not lease_id:
            raise LeaseBackendError(f"etcd granted no lease: {granted.get('error') or granted}")
        now = self.wall_clock()
        record = LeaseRecord(holder=router_id, epoch=last_epoch + 1, advertise_url=advertise_url,
                             acquired_at=now)
        try:
            answer = await self._txn(
                [*key_compare,
                 {"key": _b64(self.epoch_key), "target": "MOD", "result": "EQUAL",
                  "mod_revision": str(epoch_kv.mod_revision if epoch_kv is not None else 0)}],
                [{"request_put": {"key": _b64(self.key), "value": _b64(_encoder.encode(record)),
                                  "lease": str(lease_id)}},
                 {"request_put": {"key": _b64(self.epoch_key), "value": _b64(str(record.epoch))}},
                 {"request_delete_range": {"key": _b64(self.takeover_key)}}],
                [self._range_op(self.key)])
        except LeaseBackendError:
            await self._revoke_quietly(lease_id)
            raise
        if not answer.get("succeeded"):
            await self._revoke_quietly(lease_id)
            return Acquisition(acquired=False, record=self._record(self._ranged(answer, 0)))
        self._lease_id = lease_id
        revision = int((answer.get("header") or {}).get("revision") or 0)
        if held_kv is not None:
            revision = held_kv.create_revision  # a put over the hand-written key keeps its create_revision
        return Acquisition(acquired=True, record=msgspec.structs.replace(record, revision=revision, lease_id=lease_id))

    async def _revoke_quietly(self, lease_id: int) -> None:
        try:
            await self._post("/v3/lease/revoke", {"ID": str(lease_id)})
        except LeaseBackendError:
            pass  # an unused lease expires by itself within its TTL

    async def renew(self, record: LeaseRecord) -> Renewal:
        if not self._lease_id:
            return Renewal(ok=False, lost=True, reason="no etcd lease held")
        try:
            answer = await self._post("/v3/lease/keepalive", {"ID": str(self._lease_id)})
        except _EtcdRefused as exc:
            return Renewal(ok=False, lost=True, reason=f"etcd lease {self._lease_id} refused: {exc}")
        result = answer.get("result") or {}
        if int(result.get("TTL") or 0) <= 0:
            return Renewal(ok=False, lost=True, reason=f"etcd lease {self._lease_id} has expired")
        answer = await self._txn([], [self._range_op(self.key), self._range_op(self.takeover_key)])
        kv = self._ranged(answer, 0)
        if kv is None or kv.create_revision != record.revision or kv.lease != self._lease_id:
            return Renewal(ok=False, lost=True, reason=f"etcd key {self.key} is no longer ours")
        takeover_kv = self._ranged(answer, 1)
        takeover = self._takeover(takeover_kv) if takeover_kv is not None else None
        return Renewal(ok=True, takeover=takeover)

    async def release(self, record: LeaseRecord) -> bool:
        lease_id = self._lease_id
        if not lease_id or record.lease_id and record.lease_id != lease_id:
            return False
        # Revoking deletes the key with it: the next acquirer finds create_revision 0. On an
        # unreachable etcd the lease id is kept, so that the caller can try again.
        try:
            await self._post("/v3/lease/revoke", {"ID": str(lease_id)})
        except _EtcdRefused as exc:
            if exc.status != 404:
                raise
            self._lease_id = 0
            return False  # expired already: nothing left to give up
        self._lease_id = 0
        return True

    async def term_over(self, record: LeaseRecord) -> bool:
        """The key is gone: its holder's term is surely over when its etcd lease is gone too (expired,
        or revoked by the holder after it stopped serving) and the epoch counter was not reset."""
        if not record.lease_id:
            return False
        answer = await self._txn([], [self._range_op(self.key), self._range_op(self.epoch_key)])
        if self._ranged(answer, 0) is not None:
            return False
        epoch_kv = self._ranged(answer, 1)
        epoch = int(_unb64(epoch_kv.value) or b"0") if epoch_kv is not None else 0
        if epoch < record.epoch:
            return False  # the counter was deleted or restored: so may the lease have been, under a live holder
        try:
            alive = await self._post("/v3/lease/timetolive", {"ID": str(record.lease_id)})
        except _EtcdRefused as exc:
            return exc.status == 404  # "requested lease not found"
        return int(alive.get("TTL") or -1) <= 0

    async def request_takeover(self, request: TakeoverRequest) -> bool:
        record = await self.read()
        if record is None or record.epoch != request.epoch:
            return False
        answer = await self._txn(
            [{"key": _b64(self.key), "target": "CREATE", "result": "EQUAL",
              "create_revision": str(record.revision)}],
            [{"request_put": {"key": _b64(self.takeover_key), "value": _b64(_encoder.encode(request))}}])
        return bool(answer.get("succeeded"))

    async def clear_takeover(self, record: LeaseRecord) -> None:
        await self._post("/v3/kv/deleterange", {"key": _b64(self.takeover_key)})

    async def read_handoff(self) -> bytes | None:
        kv = await self._range(self.handoff_key)
        return _unb64(kv.value) if kv is not None else None

    async def write_handoff(self, data: bytes, record: LeaseRecord) -> bool:
        """Put the handoff only if the key is still ours (same create_revision, same lease)."""
        if not self._lease_id:
            return False
        answer = await self._txn(
            [{"key": _b64(self.key), "target": "CREATE", "result": "EQUAL",
              "create_revision": str(record.revision)},
             {"key": _b64(self.key), "target": "LEASE", "result": "EQUAL", "lease": str(self._lease_id)}],
            [{"request_put": {"key": _b64(self.handoff_key), "value": _b64(data)}}])
        return bool(answer.get("succeeded"))

    async def write_guarded(self, puts: Sequence[tuple[str, bytes]], deletes: Sequence[str],
                            record: LeaseRecord) -> bool:
        """Put and delete keys only while the lease key is still ours, as the handoff is written.

        In one txn per 64 operations (etcd's default limit is 128); False as soon as one finds the key not ours.
        """
        if not self._lease_id:
            return False
        guard = [{"key": _b64(self.key), "target": "CREATE", "result": "EQUAL",
                  "create_revision": str(record.revision)},
                 {"key": _b64(self.key), "target": "LEASE", "result": "EQUAL", "lease": str(self._lease_id)}]
        ops: list[dict[str, Any]] = [{"request_put": {"key": _b64(key), "value": _b64(value)}} for key, value in puts]
        ops += [{"request_delete_range": {"key": _b64(key)}} for key in deletes]
        for start in range(0, len(ops), 64):
            answer = await self._txn(guard, ops[start:start + 64])
            if not answer.get("succeeded"):
                return False
        return True

    async def aclose(self) -> None:
        await self._http.aclose()
