"""etcd v3's JSON gateway (``/v3/...``) over httpx: endpoints in turn, bounded answers.

No maintained etcd v3 client runs on trio, so Narwhal speaks the gateway
itself; this one transport serves discovery, ``narwhal register`` and the
etcd lease (``narwhal.lease.etcd_backend``, which turns its errors into
``LeaseBackendError``).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import httpx
import msgspec

from narwhal.errors import NarwhalError

__all__ = ["MAX_ANSWER_BYTES", "EtcdHttp", "EtcdRefused", "EtcdUnavailable", "KeyValue", "b64", "prefix_end",
           "unb64"]

# Bound on one unary answer (a page of a list, a lease call): far above what discovery reads.
MAX_ANSWER_BYTES = 16 * 1024 * 1024

_encoder = msgspec.json.Encoder()


class EtcdUnavailable(NarwhalError):
    """No endpoint answered: every one refused the connection, timed out or had no leader."""


class EtcdRefused(EtcdUnavailable):
    """etcd understood the request and refused it (HTTP 4xx): another member would say the same."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"etcd refused the request: HTTP {status} {text!r}")
        self.status = status
        self.text = text

    @property
    def compacted(self) -> bool:
        """A read at a revision etcd has compacted away."""
        return "compacted" in self.text


class KeyValue(msgspec.Struct, frozen=True, kw_only=True):
    """One key as the gateway writes it (base64 key and value, int64 as strings)."""

    key: str = ""
    value: str = ""
    create_revision: int = 0
    mod_revision: int = 0
    lease: int = 0

    @property
    def key_text(self) -> str:
        # Bytes that are not UTF-8 stay distinct (two such keys never share a name); entry.py refuses them.
        return unb64(self.key).decode(errors="surrogateescape")

    @property
    def value_bytes(self) -> bytes:
        return unb64(self.value)


def b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def prefix_end(prefix: str) -> bytes:
    """The range end that covers every key starting with ``prefix`` (etcdctl's ``--prefix``)."""
    raw = bytearray(prefix.encode())
    while raw:
        if raw[-1] < 0xFF:
            raw[-1] += 1
            return bytes(raw)
        raw.pop()
    return b"\0"  # every key


def key_value(entry: Any) -> KeyValue:
    # The gateway writes int64 as strings; lax mode converts them.
    return msgspec.convert(entry, KeyValue, strict=False)


class EtcdHttp:
    """POSTs to the first endpoint that answers, starting with the last one that did."""

    def __init__(self, endpoints: Sequence[str], *, timeout_s: float, client: httpx.AsyncClient | None = None) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        self.endpoints = [endpoint.rstrip("/") for endpoint in endpoints]
        self.timeout_s = timeout_s
        self.client = client or httpx.AsyncClient(timeout=timeout_s)
        self.current = 0

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """The first JSON object an endpoint answers; EtcdRefused on a 4xx, EtcdUnavailable when none answers."""
        problems: list[str] = []
        count = len(self.endpoints)
        payload = _encoder.encode(body)
        for step in range(count):
            index = (self.current + step) % count
            endpoint = self.endpoints[index]
            try:
                response = await self.client.post(f"{endpoint}{path}", content=payload,
                                                  headers={"content-type": "application/json"},
                                                  timeout=self.timeout_s)
            except httpx.HTTPError as exc:
                problems.append(f"{endpoint}: {type(exc).__name__}")
                continue
            if len(response.content) > MAX_ANSWER_BYTES:
                problems.append(f"{endpoint}: answer over {MAX_ANSWER_BYTES} bytes")
                continue
            if 400 <= response.status_code < 500:
                self.current = index
                raise EtcdRefused(response.status_code, response.text[:300])
            if response.status_code != 200:
                # A member without a leader or quorum says so with an error: try the next one.
                problems.append(f"{endpoint}: HTTP {response.status_code} {response.text[:200]!r}")
                continue
            try:
                # A lease keepalive answers as a stream of objects: the first is ours.
                answer = msgspec.json.decode(response.content.split(b"\n", 1)[0])
            except msgspec.DecodeError:
                problems.append(f"{endpoint}: not JSON")
                continue
            if not isinstance(answer, dict):
                problems.append(f"{endpoint}: not a JSON object")
                continue
            self.current = index
            return answer
        raise EtcdUnavailable(f"etcd unreachable: {'; '.join(problems)}")

    async def aclose(self) -> None:
        await self.client.aclose()
