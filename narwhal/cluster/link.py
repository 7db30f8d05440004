"""The routers' link: replicas send evidence and placements to the controller's ``POST /cluster/evidence``.

What travels here may be lost with a controller (a streak, a placement): the
next controller starts from the fleet in etcd. ``EvidenceSender`` (a replica)
batches what its request path reports and posts it as soon as there is
evidence, and every ``relay_interval_s`` for the placements; the reply carries
the other routers' placements. ``EvidenceReceiver`` (the controller)
authenticates the peer (the cluster token, or a verified client certificate),
applies the evidence as a worker's, and relays placements through a bounded
``PlacementRelay``.

Events (JSON lines): ``cluster_link_failed``, ``cluster_link_restored``, ``cluster_evidence_refused``.
"""

from __future__ import annotations

import hmac
import logging
import math
import ssl
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec
import trio

from narwhal.cluster.records import ControllerRef, EvidenceBatch, EvidenceItem, EvidenceReply, PlacedPrompt
from narwhal.config import Config, resolve_config_path
from narwhal.errors import FailureClass, SuccessKind
from narwhal.obs.logs import log_event
from narwhal.wire import error_json

__all__ = ["MAX_BATCH_BYTES", "EvidenceReceiver", "EvidenceSender", "PlacementRelay", "link_ssl_context"]

# A batch body never exceeds this (the receiver answers 413 past it; the sender sends at most MAX_ITEMS).
MAX_BATCH_BYTES = 4 * 1024 * 1024
MAX_ITEMS = 2048
# A sender keeps each body under this: [admin] listen, where the link is served when set, takes 64 KiB bodies.
LINK_BODY_BYTES = 60_000
# An idle replica asks for the others' placements this often (a busy one every relay_interval_s).
IDLE_POLL_S = 2.0
MAX_PLACEMENTS = 2048
_encode = msgspec.json.Encoder().encode
_decode_batch = msgspec.json.Decoder(EvidenceBatch).decode
_decode_reply = msgspec.json.Decoder(EvidenceReply).decode


def link_ssl_context(config: Config, config_dir: Path | None) -> ssl.SSLContext | None:
    """The replica's client context toward a controller served over TLS: it trusts the CA that signs the
    routers' certificates (``serving.tls_client_ca_file``, else the engines' CA, else the system's) and, with
    mutual TLS, presents its own serving certificate."""
    serving = config.serving
    if serving.tls_cert_file is None:
        return None
    ca_file = serving.tls_client_ca_file or config.engine.tls_ca_file
    context = ssl.create_default_context(cafile=str(resolve_config_path(ca_file, config_dir)) if ca_file else None)
    if serving.tls_client_ca_file is not None and serving.tls_key_file is not None:
        context.load_cert_chain(str(resolve_config_path(serving.tls_cert_file, config_dir)),
                                str(resolve_config_path(serving.tls_key_file, config_dir)))
    return context


class PlacementRelay:
    """The controller's ring of recent placements from every router, read by cursor (bounded)."""

    def __init__(self, capacity: int = 16384) -> None:
        self._ring: deque[tuple[int, str, PlacedPrompt]] = deque(maxlen=capacity)
        self.seq = 0

    def add(self, origin: str, prompts: list[PlacedPrompt]) -> None:
        for prompt in prompts:
            self.seq += 1
            self._ring.append((self.seq, origin, prompt))

    def since(self, cursor: int, exclude: str, limit: int = MAX_PLACEMENTS) -> tuple[list[PlacedPrompt], int]:
        """Placements after ``cursor`` by routers other than ``exclude``, and the cursor to ask from next."""
        if cursor > self.seq:
            cursor = 0  # a new controller's ring: everything it has is new to the asker
        out: list[PlacedPrompt] = []
        last = cursor
        for seq, origin, prompt in self._ring:
            if seq <= cursor:
                continue
            if len(out) >= limit:
                break
            last = seq
            if origin != exclude:
                out.append(prompt)
        else:
            last = self.seq
        return out, last


class EvidenceReceiver:
    """``POST /cluster/evidence`` on the controller: authenticate, decode, apply, answer."""

    def __init__(self, *, router_id: str, token: str | None, mutual_tls: bool,
                 controller_ref: Callable[[], ControllerRef | None],
                 apply_evidence: Callable[[str, FailureClass | None, SuccessKind | None], None],
                 apply_placements: Callable[[list[PlacedPrompt]], None], relay: PlacementRelay,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``controller_ref()`` is None while this router is the controller, else who is."""
        self.router_id = router_id
        self._token = token.encode() if token is not None else None
        self._mutual_tls = mutual_tls
        self._controller_ref = controller_ref
        self._apply_evidence = apply_evidence
        self._apply_placements = apply_placements
        self.relay = relay
        self._clock = clock
        self._last_refusal_log = -1e9
        self.refused = 0
        self.batches = 0

    def placed_here(self, prompts: list[PlacedPrompt]) -> None:
        """The controller's own placements, for the replicas' next replies."""
        self.relay.add(self.router_id, prompts)

    def _authenticated(self, authorization: str | None, peer_cert: bool) -> bool:
        if self._mutual_tls and peer_cert:
            return True
        if self._token is None or authorization is None:
            return False
        scheme, _, credential = authorization.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(credential.strip().encode(), self._token)

    def _refuse(self, status: int, message: str, code: str, peer: str) -> tuple[int, bytes]:
        self.refused += 1
        now = self._clock()
        if now - self._last_refusal_log >= 1.0:  # a flood is counted, and said at most once a second
            self._last_refusal_log = now
            log_event("cluster_evidence_refused", level=logging.WARNING, peer=peer, status=status, reason=message,
                      refused=self.refused)
        return status, error_json(message, "invalid_request_error" if status != 401 else "authentication_error", code)

    def handle(self, body: bytes, *, authorization: str | None, peer_cert: bool, peer: str = "") -> tuple[int, bytes]:
        if not self._authenticated(authorization, peer_cert):
            how = "a verified client certificate" if self._mutual_tls else "the cluster token"
            return self._refuse(401, f"the routers' link needs {how} (Authorization: Bearer <token>)",
                                "cluster_unauthenticated", peer)
        if len(body) > MAX_BATCH_BYTES:
            return self._refuse(413, f"evidence batch over {MAX_BATCH_BYTES} bytes", "batch_too_large", peer)
        try:
            batch = _decode_batch(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return self._refuse(400, f"not an evidence batch: {exc}", "invalid_batch", peer)
        ref = self._controller_ref()
        if ref is not None:
            message = f"this router is not the controller: {ref.router_id or 'none'} is"
            return 409, _encode({"error": {"message": message, "type": "invalid_request_error",
                                           "code": "not_controller"}, "controller": ref})
        applied = 0
        for item in batch.evidence[:MAX_ITEMS]:
            try:
                failure = FailureClass(item.failure_class) if item.failure_class is not None else None
                success = SuccessKind(item.success_kind) if item.success_kind is not None else None
            except ValueError:
                continue  # a newer router's class: not ours to count
            if failure is None and success is None:
                continue
            self._apply_evidence(item.engine, failure, success)
            applied += 1
        prompts = [prompt for prompt in batch.placements[:MAX_PLACEMENTS] if prompt.blocks]
        if prompts:
            self._apply_placements(prompts)
            self.relay.add(batch.router_id, prompts)
        placements, cursor = self.relay.since(batch.cursor, exclude=batch.router_id)
        self.batches += 1
        return 200, _encode(EvidenceReply(controller=self.router_id, applied=applied, placements=placements,
                                          cursor=cursor))


class EvidenceSender:
    """A replica's side of the link: a bounded queue of evidence, posted to the controller."""

    def __init__(self, *, router_id: str, controller: Callable[[], ControllerRef | None], token: str | None,
                 apply_placements: Callable[[list[PlacedPrompt]], None] | None,
                 relay_interval_s: float = 0.25, timeout_s: float = 2.0, max_queue: int = 10_000,
                 ssl_context: ssl.SSLContext | None = None, client: httpx.AsyncClient | None = None) -> None:
        self.router_id = router_id
        self._controller = controller
        self._headers = {"content-type": "application/json"}
        if token is not None:
            self._headers["authorization"] = f"Bearer {token}"
        # Placements to relay (None: placement does not use the prefix index), deduplicated by (engine, last
        # block) as a worker's outbox is: a hot prompt goes once per batch.
        self._placed: dict[tuple[str, int], PlacedPrompt] | None = {} if apply_placements is not None else None
        self._apply_placements = apply_placements
        self.relay_interval_s = relay_interval_s
        self._queue: deque[EvidenceItem] = deque()
        self._max_queue = max_queue
        self._wake = trio.Event()
        self._client = client or httpx.AsyncClient(timeout=timeout_s, verify=ssl_context or True)
        self.cursor = 0
        self._cursor_of = ""
        self._last_placed = -math.inf
        self.dropped = 0
        self.sent = 0
        self.problem: str | None = None

    def placed(self, engine: str, blocks: list[int]) -> None:
        """This router placed ``blocks`` on ``engine``: the other routers learn it with the next batch."""
        placed = self._placed
        if placed is None or not blocks:
            return
        key = (engine, blocks[-1])
        self._last_placed = time.monotonic()
        if key not in placed:
            if len(placed) >= MAX_PLACEMENTS:
                self.dropped += 1
                return
            placed[key] = PlacedPrompt(engine, blocks)

    def report(self, item: EvidenceItem) -> None:
        """Queue one outcome for the controller (the oldest goes when the queue is full)."""
        if len(self._queue) >= self._max_queue:
            self._queue.popleft()
            self.dropped += 1
        self._queue.append(item)
        self._wake.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        delay = 0.1
        while True:
            with trio.move_on_after(self._poll_s()):
                await self._wake.wait()
            self._wake = trio.Event()
            ref = self._controller()
            if ref is None or not ref.cluster_url:
                continue  # no controller yet: the queue waits (bounded)
            if not await self._send(ref):
                await trio.sleep(delay)
                delay = min(delay * 2, 2.0)
                self._wake.set()
            else:
                delay = 0.1

    def _poll_s(self) -> float:
        """How long to wait for evidence before asking for the others' placements: ``relay_interval_s`` while
        this router places (it sent some in the last 10 s), 2 s when idle, never without a prefix index."""
        if self._placed is None:
            return 3600.0
        return self.relay_interval_s if time.monotonic() - self._last_placed < 10.0 else IDLE_POLL_S

    async def _send(self, ref: ControllerRef) -> bool:
        items = [self._queue.popleft() for _ in range(min(len(self._queue), MAX_ITEMS))]
        placements: list[PlacedPrompt] = []
        if self._placed:
            placements = list(self._placed.values())
            self._placed.clear()
        if ref.router_id != self._cursor_of:
            self.cursor, self._cursor_of = 0, ref.router_id  # another controller's ring
        body = _encode(EvidenceBatch(router_id=self.router_id, evidence=items, placements=placements,
                                     cursor=self.cursor))
        while len(body) > LINK_BODY_BYTES and (placements or len(items) > 1):
            # Within the admin listener's body bound: what does not fit goes with the next batch.
            if placements:
                placements, later = placements[:len(placements) // 2], placements[len(placements) // 2:]
                for prompt in later:
                    self.placed(prompt.engine, prompt.blocks)
            else:
                items, later_items = items[:len(items) // 2], items[len(items) // 2:]
                self._queue.extendleft(reversed(later_items))
            body = _encode(EvidenceBatch(router_id=self.router_id, evidence=items, placements=placements,
                                         cursor=self.cursor))
        url = ref.cluster_url.rstrip("/") + "/cluster/evidence"
        problem: str | None = None
        try:
            response = await self._client.post(url, content=body, headers=self._headers)
            if response.status_code == 200:
                reply = _decode_reply(response.content)
                self.cursor = reply.cursor
                if reply.placements and self._apply_placements is not None:
                    self._apply_placements(reply.placements)
            else:
                problem = f"HTTP {response.status_code}: {response.text[:200]}"
        except (httpx.HTTPError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        if problem is None:
            self.sent += 1
            if self.problem is not None:
                log_event("cluster_link_restored", controller=ref.router_id, url=url)
            self.problem = None
            return True
        # Put the evidence back (newest last), within the bound: it is still evidence once the link heals.
        for item in reversed(items):
            if len(self._queue) < self._max_queue:
                self._queue.appendleft(item)
            else:
                self.dropped += 1
        if problem != self.problem:
            log_event("cluster_link_failed", level=logging.WARNING, controller=ref.router_id, url=url,
                      **{"class": problem.split(":", 1)[0]}, message=problem)
        self.problem = problem
        return False

    async def aclose(self) -> None:
        await self._client.aclose()
