"""The cluster's keys in etcd, over the v3 JSON gateway: router membership and reads of the published fleet.

Writes of ``<key>/fleet/`` are the controller's and go through the lease
backend (guarded by its lease, ``EtcdLeaseBackend.write_guarded``); this store
only registers routers and reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import httpx
import msgspec

from narwhal.cluster.records import FleetEntry, RouterEntry
from narwhal.discovery.etcd_http import EtcdHttp, EtcdRefused, EtcdUnavailable, b64, key_value, prefix_end

__all__ = ["ClusterStore", "FleetKey"]

_router = msgspec.json.Decoder(RouterEntry)
_fleet = msgspec.json.Decoder(FleetEntry)
_encode = msgspec.json.Encoder().encode
# A cluster listing never reads more than this many keys (1,000 engines and 64 routers are far below).
MAX_KEYS = 100_000


class FleetKey(msgspec.Struct, frozen=True):
    """One published engine: the revision that wrote it and when (wall clock), for a router's lag."""

    name: str
    mod_revision: int
    written_at: float


class ClusterStore:
    """Router keys under ``<key>/routers/``; the fleet under ``<key>/fleet/``."""

    def __init__(self, endpoints: Sequence[str], *, key: str, timeout_s: float,
                 client: httpx.AsyncClient | None = None) -> None:
        self.routers_prefix = f"{key}/routers/"
        self.fleet_prefix = f"{key}/fleet/"
        self._http = EtcdHttp(endpoints, timeout_s=timeout_s, client=client)

    async def grant(self, ttl_s: int) -> int:
        answer = await self._http.post("/v3/lease/grant", {"TTL": ttl_s})
        lease_id = int(answer.get("ID") or 0)
        if not lease_id:
            raise EtcdUnavailable(f"etcd granted no lease: {answer.get('error') or answer}")
        return lease_id

    async def keepalive(self, lease_id: int) -> bool:
        """False when the lease is gone (expired, revoked): the caller grants a new one."""
        try:
            answer = await self._http.post("/v3/lease/keepalive", {"ID": str(lease_id)})
        except EtcdRefused:
            return False
        return int((answer.get("result") or {}).get("TTL") or 0) > 0

    async def revoke(self, lease_id: int) -> None:
        try:
            await self._http.post("/v3/lease/revoke", {"ID": str(lease_id)})
        except EtcdRefused:
            pass  # gone already

    async def put_router(self, entry: RouterEntry, lease_id: int) -> None:
        await self._http.post("/v3/kv/put", {"key": b64(self.routers_prefix + entry.router_id),
                                             "value": b64(_encode(entry)), "lease": str(lease_id)})

    async def _range(self, prefix: str, *, keys_only: bool = False) -> tuple[list[tuple[str, bytes, int]], int]:
        body = {"key": b64(prefix), "range_end": b64(prefix_end(prefix)), "limit": str(MAX_KEYS)}
        if keys_only:
            body["keys_only"] = True  # type: ignore[assignment]
        answer = await self._http.post("/v3/kv/range", body)
        revision = int((answer.get("header") or {}).get("revision") or 0)
        kvs = [key_value(entry) for entry in answer.get("kvs") or []]
        return [(kv.key_text, kv.value_bytes, kv.mod_revision) for kv in kvs], revision

    async def routers(self) -> list[RouterEntry]:
        """Every registered router (values that do not decode are left out)."""
        found, _ = await self._range(self.routers_prefix)
        entries = []
        for _key, value, _mod in found:
            try:
                entries.append(_router.decode(value))
            except (msgspec.DecodeError, ValueError):
                continue
        return entries

    async def fleet_keys(self) -> tuple[list[FleetKey], int]:
        """Every published engine with its revision, and the store's revision."""
        found, revision = await self._range(self.fleet_prefix)
        keys = []
        for key, value, mod in found:
            try:
                written_at = _fleet.decode(value).written_at
            except (msgspec.DecodeError, ValueError):
                written_at = 0.0
            keys.append(FleetKey(key[len(self.fleet_prefix):], mod, written_at))
        return keys, revision

    async def aclose(self) -> None:
        await self._http.aclose()
