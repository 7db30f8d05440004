"""Narwhal's identity and attestation endpoints inside a stock vLLM engine, as a pure ASGI middleware.

Loaded by vLLM's own flag (vLLM imports the dotted path and, for a class, calls
``app.add_middleware(cls)``)::

    vllm serve MODEL --middleware narwhal.engine_plugin.IdentityMiddleware ...

It answers ``GET /narwhal/identity`` and ``POST /narwhal/attest`` (the engine
contract in ``docs/architecture.md``) and hands every other request, untouched
and unbuffered, to vLLM's app. What it reports:

    field               from
    ------------------  ------------------------------------------------------------
    engine_id           $NARWHAL_ENGINE_ID
    generation          $NARWHAL_GENERATION
    model               $NARWHAL_MODEL, else --served-model-name (its first name),
                        else the model argument (``vllm serve MODEL`` / --model)
    kv_roles            $NARWHAL_KV_ROLE, else --kv-transfer-config's kv_role:
                        kv_producer -> [producer], kv_consumer -> [consumer],
                        kv_both -> [producer, consumer]; no KV connector -> []
    process_started_at  this process's start, from /proc/self/stat (else the time
                        the middleware was built)
    kv_events           --kv-events-config's endpoint, replay_endpoint and topic, as
                        given (a wildcard host stays: the router puts the engine's
                        host in its place); null unless it enables the zmq publisher

The attestation key is read from ``$NARWHAL_FLEET_KEY_FILE`` (on every attest,
so a fixed or rotated key file needs no engine restart) or ``$NARWHAL_FLEET_KEY``.
Without a key ``/narwhal/attest`` answers 503 saying so, never a signature over
an empty key; without an engine id, generation or model both endpoints answer
503 naming what is missing.

With ``$NARWHAL_REGISTER_ETCD`` set it also registers the engine in etcd for the
router's discovery (``narwhal.plugin_register``): started at vLLM's lifespan
start-up (or the first request), revoked at its shutdown.

Standard library only (and ``narwhal.attestation`` and ``narwhal.plugin_register``,
themselves stdlib-only): this module runs inside vLLM's process, so it must not
import trio, msgspec or httpx.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

from narwhal import attestation
from narwhal.errors import NarwhalError
from narwhal.plugin_register import PluginRegistrar, Registration, registration_from_environment

__all__ = [
    "ENGINE_ID_ENV",
    "GENERATION_ENV",
    "KV_ROLE_ENV",
    "MODEL_ENV",
    "IdentityMiddleware",
    "PluginSettings",
    "VllmArgs",
    "kv_roles_for",
    "parse_vllm_argv",
    "process_started_at",
]

ENGINE_ID_ENV = "NARWHAL_ENGINE_ID"
GENERATION_ENV = "NARWHAL_GENERATION"
KV_ROLE_ENV = "NARWHAL_KV_ROLE"
MODEL_ENV = "NARWHAL_MODEL"

IDENTITY_PATH = "/narwhal/identity"
ATTEST_PATH = "/narwhal/attest"

# vLLM's kv_role values (and Narwhal's own words, for $NARWHAL_KV_ROLE) -> the contract's kv_roles.
_KV_ROLES: dict[str, tuple[str, ...]] = {
    "kv_producer": ("producer",),
    "kv_consumer": ("consumer",),
    "kv_both": ("producer", "consumer"),
    "producer": ("producer",),
    "consumer": ("consumer",),
    "both": ("producer", "consumer"),
}

# An attest body is {"nonce": "..."}; the router's nonce is 32 hex characters.
_MAX_ATTEST_BODY_BYTES = 4096
_MAX_NONCE_CHARS = 256

# vLLM's KVEventsConfig.endpoint default.
_KV_EVENTS_ENDPOINT = "tcp://*:5557"

_log = logging.getLogger(__name__)


def _show_plugin_logs() -> None:
    """Give this logger a stderr handler when nothing would show its INFO lines.

    Stock vLLM configures only its own ``vllm`` logger: with no handler here and none on the root logger, the
    plugin's INFO lines (its identity, each registration and deregistration) were dropped and only WARNING and up
    reached stderr through Python's last resort. A deployment that configures logging itself keeps its own.
    """
    if _log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
    _log.addHandler(handler)
    if _log.level == logging.NOTSET:
        _log.setLevel(logging.INFO)
    # Ours only: a root handler added later must not print each line twice.
    _log.propagate = False


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


# ----- what the engine is, from its command line and environment ---------------------------


@dataclasses.dataclass(frozen=True)
class VllmArgs:
    """The few vLLM arguments the plugin reads; None where the command line does not say."""

    model: str | None = None
    served_model_name: str | None = None
    # The kv_role of --kv-transfer-config; "" when a config is given without one.
    kv_role: str | None = None
    # Why --kv-transfer-config could not be read, if it could not.
    kv_config_problem: str | None = None
    # --kv-events-config as given (JSON, then any dotted --kv-events-config.KEY on top); None if not given.
    kv_events_config: dict[str, Any] | None = None
    # Why --kv-events-config could not be read, if it could not.
    kv_events_problem: str | None = None

    def kv_events(self) -> dict[str, Any] | None:
        """The publisher's endpoints as vLLM's KVEventsConfig resolves them; None when events are off."""
        config = self.kv_events_config
        if config is None or self.kv_events_problem is not None:
            return None
        enabled = _truthy(config.get("enable_kv_cache_events", False))
        # vLLM: publisher None means "zmq" when events are enabled, "null" otherwise.
        publisher = config.get("publisher") or ("zmq" if enabled else "null")
        if not enabled or publisher != "zmq":
            return None
        replay = config.get("replay_endpoint")
        return {"endpoint": str(config.get("endpoint") or _KV_EVENTS_ENDPOINT),
                "replay_endpoint": None if replay in (None, "") else str(replay),
                "topic": str(config.get("topic") or "")}


def parse_vllm_argv(argv: Sequence[str]) -> VllmArgs:
    """Read the model, served name and KV role from a ``vllm serve`` (or api_server) command line.

    Accepts ``--flag value`` and ``--flag=value``, underscores for dashes, the
    positional ``vllm serve MODEL`` (which wins over ``--model``, as in vLLM),
    and vLLM's dotted JSON form ``--kv-transfer-config.kv_role VALUE``.
    """
    args = list(argv[1:])
    positional: str | None = None
    # ``vllm serve MODEL ...``: argv[1] is the subcommand, the model comes right after it.
    if len(args) >= 2 and args[0] == "serve" and not args[1].startswith("-"):
        positional = args[1]
    flag_model: str | None = None
    served: str | None = None
    kv_role: str | None = None
    problem: str | None = None
    kv_events: dict[str, Any] | None = None
    kv_events_problem: str | None = None
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        name, eq, inline = arg.partition("=")
        head, dot, key = name[2:].partition(".")
        flag = "--" + head.replace("_", "-") + (dot + key if dot else "")
        if eq:
            value: str | None = inline
        else:
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
        if value is None:
            continue
        if flag == "--model":
            flag_model = value
        elif flag == "--served-model-name":
            served = value  # nargs="+": the first name is the one vLLM answers with
        elif flag == "--kv-transfer-config":
            kv_role, problem = _kv_role_from_json(value)
        elif flag == "--kv-transfer-config.kv_role":
            kv_role, problem = value, None
        elif flag == "--kv-events-config":
            try:
                parsed = json.loads(value)
            except ValueError as exc:
                kv_events_problem = f"--kv-events-config is not JSON ({exc})"
                continue
            if not isinstance(parsed, dict):
                kv_events_problem = "--kv-events-config is not a JSON object"
                continue
            kv_events = {**(kv_events or {}), **parsed}
        elif flag.startswith("--kv-events-config."):
            kv_events = {**(kv_events or {}), flag.partition(".")[2]: value}
    return VllmArgs(model=positional or flag_model, served_model_name=served, kv_role=kv_role,
                    kv_config_problem=problem, kv_events_config=kv_events, kv_events_problem=kv_events_problem)


def _truthy(value: Any) -> bool:
    # A dotted flag's value is the command line's string; JSON gives a bool.
    return value is True or (isinstance(value, str) and value.strip().lower() in ("true", "1", "yes"))


def _kv_role_from_json(text: str) -> tuple[str | None, str | None]:
    try:
        config = json.loads(text)
    except ValueError as exc:
        return None, f"--kv-transfer-config is not JSON ({exc})"
    if not isinstance(config, dict):
        return None, "--kv-transfer-config is not a JSON object"
    role = config.get("kv_role")
    if role is None:
        return "", None
    if not isinstance(role, str):
        return None, f"--kv-transfer-config kv_role is not a string: {role!r}"
    return role, None


def kv_roles_for(kv_role: str) -> tuple[str, ...] | None:
    """The contract's kv_roles for a vLLM kv_role (or producer/consumer/both); None if unknown."""
    return _KV_ROLES.get(kv_role.strip().lower())


def process_started_at(*, proc: Path = Path("/proc"), now: Callable[[], float] = time.time) -> float | None:
    """This process's start as unix seconds, from ``/proc/self/stat``; None where /proc cannot tell.

    The kernel gives the start in clock ticks since boot; ``/proc/uptime`` (1/100 s)
    ties boot time to the wall clock more finely than ``/proc/stat``'s whole-second
    ``btime``, which matters when a restart closely follows a maintenance start.
    """
    try:
        stat = (proc / "self" / "stat").read_text()
        uptime_s = float((proc / "uptime").read_text().split()[0])
        # Field 2 (the command) is in parentheses and may itself hold spaces or ')'.
        fields = stat[stat.rindex(")") + 2:].split()
        start_ticks = int(fields[19])  # field 22, starttime; fields[0] is field 3
        ticks_per_s = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return now() - uptime_s + start_ticks / ticks_per_s


@dataclasses.dataclass(frozen=True)
class PluginSettings:
    """What the engine reports, fixed when the middleware is built; ``problems`` say what is missing."""

    engine_id: str | None
    generation: str | None
    model: str | None
    kv_roles: tuple[str, ...]
    process_started_at: float
    problems: tuple[str, ...] = ()
    # The environment the key is read from at each attest (a key file may be fixed without a restart).
    key_environ: Mapping[str, str] = dataclasses.field(default_factory=dict, repr=False)
    # The etcd registration $NARWHAL_REGISTER_ETCD asks for; a one-line problem if it cannot be done; None if not asked.
    registration: Registration | str | None = None
    # vLLM's KV event publisher (endpoint, replay_endpoint, topic), None when it publishes none.
    kv_events: Mapping[str, Any] | None = None
    # Why --kv-events-config could not be read: a warning, not a problem (the engine serves and is identified).
    kv_events_problem: str | None = None

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None,
                         *, started_at: float | None = None, proc: Path = Path("/proc")) -> PluginSettings:
        """Settings from the vLLM process's environment and command line (``os.environ``, ``sys.argv``)."""
        env = dict(os.environ if environ is None else environ)
        vllm = parse_vllm_argv(sys.argv if argv is None else argv)
        problems: list[str] = []
        engine_id = env.get(ENGINE_ID_ENV, "").strip() or None
        if engine_id is None:
            problems.append(f"{ENGINE_ID_ENV} is not set")
        generation = env.get(GENERATION_ENV, "").strip() or None
        if generation is None:
            problems.append(f"{GENERATION_ENV} is not set")
        model = env.get(MODEL_ENV, "").strip() or vllm.served_model_name or vllm.model
        if not model:
            problems.append(f"cannot tell the served model from the command line: set {MODEL_ENV}")
        override = env.get(KV_ROLE_ENV, "").strip()
        kv_roles: tuple[str, ...] = ()
        if override:
            roles = kv_roles_for(override)
            if roles is None:
                problems.append(f"{KV_ROLE_ENV}={override!r} is not one of kv_producer, kv_consumer, kv_both")
            kv_roles = roles or ()
        elif vllm.kv_config_problem is not None:
            problems.append(f"{vllm.kv_config_problem}: set {KV_ROLE_ENV}")
        elif vllm.kv_role:
            roles = kv_roles_for(vllm.kv_role)
            if roles is None:
                problems.append(f"--kv-transfer-config kv_role {vllm.kv_role!r} is not one of "
                                f"kv_producer, kv_consumer, kv_both: set {KV_ROLE_ENV}")
            kv_roles = roles or ()
        if started_at is None:
            started_at = process_started_at(proc=proc)
        if started_at is None:
            started_at = time.time()
        for name, value, env_name in (("engine_id", engine_id, ENGINE_ID_ENV),
                                      ("generation", generation, GENERATION_ENV), ("model", model, MODEL_ENV)):
            limit = attestation.IDENTITY_FIELD_CHARS[name]
            if value and len(value) > limit:
                # A router refuses it: say so here, where it can be fixed.
                problems.append(f"{name} is {len(value)} characters long, more than {limit} (set {env_name})")
        key_environ = {name: env[name] for name in (attestation.KEY_FILE_ENV, attestation.KEY_ENV) if name in env}
        registration = registration_from_environment(env, engine_id=engine_id, model=model, kv_roles=kv_roles,
                                                     identity_problems=problems)
        return cls(engine_id=engine_id, generation=generation, model=model, kv_roles=kv_roles,
                   process_started_at=started_at, problems=tuple(problems), key_environ=key_environ,
                   registration=registration, kv_events=vllm.kv_events(), kv_events_problem=vllm.kv_events_problem)

    def identity(self) -> dict[str, Any]:
        """The ``GET /narwhal/identity`` answer."""
        return {"engine_id": self.engine_id, "model": self.model, "generation": self.generation,
                "process_started_at": self.process_started_at, "kv_roles": list(self.kv_roles),
                "kv_events": None if self.kv_events is None else dict(self.kv_events)}

    def key(self) -> bytes:
        """The fleet key, read now; ``attestation.FleetKeyError`` saying why there is none."""
        return attestation.key_from_environment(self.key_environ)


# ----- the middleware ---------------------------------------------------------------------


class IdentityMiddleware:
    """Answers ``/narwhal/identity`` and ``/narwhal/attest``; passes everything else to ``app`` as is."""

    def __init__(self, app: ASGIApp, settings: PluginSettings | None = None) -> None:
        """Starlette builds it as ``cls(app)`` (``add_middleware`` with no options, as vLLM calls it)."""
        self.app = app
        self.settings = settings if settings is not None else PluginSettings.from_environment()
        _show_plugin_logs()
        s = self.settings
        if s.problems:
            _log.warning("narwhal identity plugin cannot identify this engine: %s", "; ".join(s.problems))
        else:
            _log.info("narwhal identity plugin: engine_id=%s model=%s generation=%s kv_roles=%s",
                      s.engine_id, s.model, s.generation, list(s.kv_roles))
        if s.kv_events_problem is not None:
            # The engine is still identified; only a router's precise placement misses its KV events.
            _log.warning("narwhal identity plugin cannot report KV events: %s", s.kv_events_problem)
        self.registrar: PluginRegistrar | None = None
        if isinstance(s.registration, str):
            # The engine serves on; only the router's discovery misses it, and this line says why.
            _log.error("narwhal registration: not registering this engine in etcd: %s", s.registration)
        elif s.registration is not None:
            self.registrar = PluginRegistrar(s.registration)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.registrar is not None:
            if scope.get("type") == "lifespan":
                await self.app(scope, self._lifespan_receive(receive, self.registrar), send)
                return
            # A server run without lifespan events: start at the first request instead (once).
            self.registrar.start()
        path = _route_path(scope) if scope.get("type") == "http" else None
        if path == IDENTITY_PATH:
            await self._identity(scope, send)
        elif path == ATTEST_PATH:
            await self._attest(scope, receive, send)
        else:
            # The stream goes straight through: no wrapper around receive or send.
            await self.app(scope, receive, send)

    @staticmethod
    def _lifespan_receive(receive: Receive, registrar: PluginRegistrar) -> Receive:
        """vLLM's lifespan messages, passed on after starting the registration or revoking it."""

        async def lifespan_receive() -> Message:
            message = await receive()
            kind = message.get("type")
            if kind == "lifespan.startup":
                registrar.start()  # it registers once /health answers 200, after the model is loaded
            elif kind == "lifespan.shutdown":
                # Blocks the loop for at most the revoke's deadlines: the engine is going away, nothing waits.
                registrar.stop()
            return message

        return lifespan_receive

    async def _identity(self, scope: Scope, send: Send) -> None:
        if scope.get("method") != "GET":
            await _error(send, 405, f"use GET on {IDENTITY_PATH}", "MethodNotAllowed", allow="GET")
            return
        if self.settings.problems:
            await _unidentified(send, self.settings.problems)
            return
        await _json(send, 200, self.settings.identity())

    async def _attest(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("method") != "POST":
            await _error(send, 405, f"use POST on {ATTEST_PATH}", "MethodNotAllowed", allow="POST")
            return
        try:
            body = await _read_body(receive, _MAX_ATTEST_BODY_BYTES)
        except _BodyTooLarge:
            await _error(send, 413, f"attest body larger than {_MAX_ATTEST_BODY_BYTES} bytes", "BadRequestError")
            return
        if body is None:
            return  # the client went away
        nonce, problem = _nonce(body)
        if problem is not None:
            await _error(send, 400, problem, "BadRequestError")
            return
        s = self.settings
        if s.problems:
            await _unidentified(send, s.problems)
            return
        try:
            key = s.key()
        except attestation.FleetKeyError as exc:
            await _error(send, 503, f"narwhal attestation is not configured on this engine: {exc}",
                         "ServiceUnavailable", code="no_fleet_key")
            return
        assert s.engine_id is not None and s.generation is not None  # no problems means both are set
        await _json(send, 200, {"engine_id": s.engine_id, "nonce": nonce,
                                "signature": attestation.sign(key, s.engine_id, nonce, s.generation)})


def _route_path(scope: Scope) -> str:
    path = str(scope.get("path", ""))
    # Servers differ on whether ``path`` carries ``root_path`` (vLLM's --root-path); accept both.
    root = str(scope.get("root_path") or "")
    if root and path.startswith(root + "/"):
        return path[len(root):]
    return path


class _BodyTooLarge(NarwhalError):
    pass


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The request body, at most ``limit`` bytes (_BodyTooLarge past it); None if the client left."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _nonce(body: bytes) -> tuple[str, str | None]:
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: deeply nested arrays, hostile or broken
        return "", 'attest body must be JSON: {"nonce": "..."}'
    nonce = request.get("nonce") if isinstance(request, dict) else None
    if not isinstance(nonce, str) or not nonce:
        return "", 'attest body must be {"nonce": "<non-empty string>"}'
    # "|" separates the signed fields; a nonce holding one could shift them.
    if len(nonce) > _MAX_NONCE_CHARS or "|" in nonce or not nonce.isprintable():
        return "", f"nonce must be at most {_MAX_NONCE_CHARS} printable characters without '|'"
    return nonce, None


async def _unidentified(send: Send, problems: Sequence[str]) -> None:
    await _error(send, 503, "narwhal identity plugin is not configured on this engine: " + "; ".join(problems),
                 "ServiceUnavailable", code="engine_unidentified")


async def _error(send: Send, status: int, message: str, type_: str, *, code: str | int | None = None,
                 allow: str | None = None) -> None:
    body = {"error": {"message": message, "type": type_, "code": status if code is None else code}}
    await _json(send, status, body, extra=[(b"allow", allow.encode())] if allow else [])


async def _json(send: Send, status: int, payload: Any, *, extra: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(payload, separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"cache-control", b"no-store"), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
