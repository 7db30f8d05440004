"""``python -m narwhal engine-check URL``: check one engine against the contract before adding it.

The checks are readmission's (``narwhal.control.contract``, the same verdicts
and words), run against one URL with no router:

    check        passes when
    -----------  -----------------------------------------------------------------
    health       GET /health answers 200
    models       GET /v1/models answers a model list (with --model: listing it)
    identity     GET /narwhal/identity answers the contract's fields
    attestation  POST /narwhal/attest with a fresh nonce echoes it, for the same
                 engine_id, signed with the fleet key
    model        the identity's model is one vLLM itself lists in /v1/models
                 (with --model: is that model)
    generation   (with --generation) the identity reports it
    kv_role      (with --role) kv_roles allow the role's KV transfer; without
                 --role, the engine has some KV role
    pd_probe     (with --peer) both sides report the KV role of their side (as
                 kv_role), and a one-token prefill on the prefill side hands
                 its KV to a one-token decode on the decode side

A check whose input failed is "not run". Exit 0 only when every check run
passes; 1 when one fails; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import math
import os
import secrets
import ssl
import sys
from pathlib import Path
from typing import Any, TextIO

import msgspec
import trio

from narwhal import attestation
from narwhal.config import Config, ConfigError, EngineConfig, EngineSpec, load_config
from narwhal.control import contract
from narwhal.errors import EngineFailure, FailureClass, NarwhalError
from narwhal.pools import classify
from narwhal.pools.control import ControlPool, ControlResponse
from narwhal.tls import engine_context
from narwhal.wire import AttestRequest, EngineIdentity, extract_handoff

__all__ = ["CheckRow", "add_parser", "check_engine", "format_table", "run_engine_check"]

_DEFAULT_TIMEOUT_S = 10.0
_MAX_DETAIL_CHARS = 1000


@dataclasses.dataclass(frozen=True)
class CheckRow:
    """One line of the table: the check, ``pass``/``FAIL``/``not run``, and why."""

    check: str
    result: str
    detail: str

    @property
    def failed(self) -> bool:
        return self.result != "pass"


@dataclasses.dataclass(frozen=True)
class Expectations:
    """What the engine must match; None where the operator did not say."""

    role: str | None = None
    model: str | None = None
    generation: str | None = None
    key: bytes | None = None
    # Where the key came from, for the table; or why there is none.
    key_source: str = ""
    peer: EngineSpec | None = None
    # Verifies https:// engines: the router's [engine] TLS settings with --config, else the system store.
    ssl_context: ssl.SSLContext | None = dataclasses.field(default=None, repr=False)


class _Unreachable(contract.ContractViolation):
    """The engine cannot be reached at all (connection or timeout): later checks are not run."""


class _Checker:
    def __init__(self, pool: ControlPool, engine: EngineSpec, expect: Expectations, timeout_s: float) -> None:
        self.pool = pool
        self.engine = engine
        self.expect = expect
        self.timeout_s = timeout_s
        self.rows: list[CheckRow] = []

    def row(self, check: str, result: str, detail: str) -> None:
        # Details quote what the engine said: bounded, whatever a check forgot to cut.
        self.rows.append(CheckRow(check, result, contract.bounded(detail, _MAX_DETAIL_CHARS)))

    async def call(self, method: str, path: str, body: bytes | None = None,
                   engine: EngineSpec | None = None) -> ControlResponse:
        engine = engine or self.engine
        try:
            if method == "GET":
                return await self.pool.get(engine, path, timeout_s=self.timeout_s)
            return await self.pool.post_json(engine, path, body or b"", timeout_s=self.timeout_s)
        except EngineFailure as exc:
            reason = f"{exc.failure_class}: {exc.message}"
            if exc.failure_class in (FailureClass.CONNECTION, FailureClass.TIMEOUT):
                raise _Unreachable(reason) from exc
            raise contract.ContractViolation(reason) from exc

    async def ok(self, method: str, path: str, body: bytes | None = None,
                 engine: EngineSpec | None = None) -> bytes:
        response = await self.call(method, path, body, engine)
        if response.status != 200:
            raise contract.ContractViolation(contract.status_reason(method, path, response.status, response.body))
        return response.body

    async def run(self) -> list[CheckRow]:
        try:
            await self.ok("GET", "/health")
        except _Unreachable as exc:
            self.row("health", "FAIL", exc.reason)
            for check in self._planned()[1:]:
                self.row(check, "not run", "the engine cannot be reached")
            return self.rows
        except contract.ContractViolation as exc:
            self.row("health", "FAIL", exc.reason)
        else:
            self.row("health", "pass", "GET /health answered 200")
        await self._after_health()
        return self.rows

    async def _after_health(self) -> None:
        expect = self.expect

        listed: list[str] | None = None
        try:
            listed = contract.listed_models(await self.ok("GET", "/v1/models"))
            if expect.model is not None:
                contract.check_listed_model(listed, expect.model)
            self.row("models", "pass", f"/v1/models lists {contract.shown_list(listed)}")
        except contract.ContractViolation as exc:
            self.row("models", "FAIL", exc.reason)

        identity: EngineIdentity | None = None
        try:
            identity = contract.read_identity(await self.ok("GET", "/narwhal/identity"))
            self.row("identity", "pass", _describe(identity))
        except contract.ContractViolation as exc:
            self.row("identity", "FAIL", exc.reason)

        await self._attestation(identity)
        self._model(identity, listed)
        if expect.generation is not None:
            self._judge("generation", identity, lambda i: contract.check_generation(i, expect.generation or ""),
                        f"engine reports generation {expect.generation!r}")
        if expect.role is not None:
            self._judge("kv_role", identity, lambda i: contract.check_kv_role(expect.role or "", i),
                        f"a {expect.role} engine needs KV role {contract.KV_ROLE_FOR[expect.role]!r}; "
                        f"engine reports kv_roles {contract.shown_list(identity.kv_roles if identity else [])}")
        elif identity is not None and not identity.kv_roles:
            self.row("kv_role", "FAIL", "engine reports no kv_roles: it has no KV connector "
                                        "(--kv-transfer-config) and cannot serve P/D")
        elif identity is not None:
            self.row("kv_role", "pass", f"kv_roles {contract.shown_list(identity.kv_roles)} (give --role to check one)")
        else:
            self.row("kv_role", "not run", "no identity")
        if expect.peer is not None:
            await self._pd_probe(identity, listed)

    def _planned(self) -> list[str]:
        checks = ["health", "models", "identity", "attestation", "model"]
        if self.expect.generation is not None:
            checks.append("generation")
        checks.append("kv_role")
        if self.expect.peer is not None:
            checks.append("pd_probe")
        return checks

    def _judge(self, check: str, identity: EngineIdentity | None, verdict: Any, passed: str) -> None:
        if identity is None:
            self.row(check, "not run", "no identity")
            return
        try:
            verdict(identity)
        except contract.ContractViolation as exc:
            self.row(check, "FAIL", exc.reason)
        else:
            self.row(check, "pass", passed)

    async def _attestation(self, identity: EngineIdentity | None) -> None:
        expect = self.expect
        if identity is None:
            self.row("attestation", "not run", "no identity")
            return
        if expect.key is None:
            self.row("attestation", "FAIL", expect.key_source)
            return
        nonce = secrets.token_hex(16)
        try:
            raw = await self.ok("POST", "/narwhal/attest", msgspec.json.encode(AttestRequest(nonce)))
            contract.verify_attestation(expect.key, identity, nonce, raw)
        except contract.ContractViolation as exc:
            self.row("attestation", "FAIL", exc.reason)
        else:
            self.row("attestation", "pass", f"a fresh nonce signed with the key from {expect.key_source}")

    def _model(self, identity: EngineIdentity | None, listed: list[str] | None) -> None:
        if identity is None or listed is None:
            self.row("model", "not run", "no identity" if identity is None else "no model list")
            return
        try:
            contract.check_listed_model(listed, identity.model)
            if self.expect.model is not None:
                contract.check_identity_model(identity, self.expect.model)
        except contract.ContractViolation as exc:
            reason = exc.reason
            if self.expect.model is None:
                reason = (f"/narwhal/identity names model {contract.shown(identity.model)}; "
                          f"/v1/models lists {contract.shown_list(listed)}")
            self.row("model", "FAIL", reason)
        else:
            self.row("model", "pass", f"{contract.shown(identity.model)} is served by the engine itself (/v1/models)")

    async def _pd_probe(self, identity: EngineIdentity | None, listed: list[str] | None) -> None:
        peer = self.expect.peer
        assert peer is not None and self.expect.role is not None
        model = self.expect.model or (identity.model if identity else None) or (listed[0] if listed else None)
        if model is None:
            self.row("pd_probe", "not run", "no model to ask for")
            return
        prefill, decode = (self.engine, peer) if self.expect.role == "prefill" else (peer, self.engine)
        peer_identity = await self._identity_of(peer)
        # vLLM's NixlConnector runs a prefill on a kv_consumer (and a decode on a kv_producer) all the
        # same: the legs alone would pass a pair the router refuses at readmission. Each side's role first.
        for side, role, side_identity in ((prefill, "prefill", identity if prefill is self.engine else peer_identity),
                                          (decode, "decode", identity if decode is self.engine else peer_identity)):
            if side_identity is None:
                continue  # the engine under check has its identity row; an unreadable peer shows in the legs
            try:
                contract.check_kv_role(role, side_identity)
            except contract.ContractViolation as exc:
                self.row("pd_probe", "FAIL", f"{role} on {side.url}: {exc.reason} (vLLM may run the leg all the "
                                             f"same; the router refuses the engine in that role)")
                return
        leg = "prefill"
        try:
            raw = await self.ok("POST", "/v1/completions", contract.probe_prefill_body(model), prefill)
            kv = extract_handoff(raw)
            if kv is None:
                raise contract.ContractViolation(
                    "kv_handoff: prefill response carries no readable kv_transfer_params")
            leg = "decode"
            body = await self.ok("POST", "/v1/completions", contract.probe_decode_body(model, kv), decode)
            failure = classify.sse_body_failure(decode.name, body)
            if failure is not None:
                raise contract.ContractViolation(f"{failure.failure_class}: {failure.message}")
        except contract.ContractViolation as exc:
            self.row("pd_probe", "FAIL", f"{leg} on {(prefill if leg == 'prefill' else decode).url}: {exc.reason}")
        else:
            self.row("pd_probe", "pass", f"prefill on {prefill.url} handed its KV to a decode on {decode.url}")


    async def _identity_of(self, engine: EngineSpec) -> EngineIdentity | None:
        """The peer's identity for its role check; None when it cannot be read (the probe's legs then say more)."""
        try:
            return contract.read_identity(await self.ok("GET", "/narwhal/identity", engine=engine))
        except contract.ContractViolation:
            return None


def _describe(identity: EngineIdentity) -> str:
    started = identity.process_started_at
    when = (datetime.datetime.fromtimestamp(started, datetime.UTC).isoformat(timespec="seconds")
            .replace("+00:00", "Z") if math.isfinite(started) else repr(started))
    return (f"engine_id {contract.shown(identity.engine_id)}, model {contract.shown(identity.model)}, "
            f"generation {contract.shown(identity.generation)}, kv_roles {contract.shown_list(identity.kv_roles)}, "
            f"process started {when}")


async def check_engine(url: str, expect: Expectations, *, timeout_s: float = _DEFAULT_TIMEOUT_S,
                       pool: ControlPool | None = None) -> list[CheckRow]:
    """Run every check against the engine at ``url``; one row per check, in order."""
    engine = EngineSpec(name="engine", url=url, role=expect.role or "prefill")  # type: ignore[arg-type]
    owned = pool is None
    if pool is None:
        pool = ControlPool(control_connections=2,
                           engine_config=EngineConfig(connect_timeout_s=min(timeout_s, 5.0),
                                                      health_timeout_s=timeout_s),
                           ssl_context=expect.ssl_context)
    try:
        return await _Checker(pool, engine, expect, timeout_s).run()
    finally:
        if owned:
            await pool.aclose()


def format_table(url: str, rows: list[CheckRow]) -> str:
    """The rows as an aligned table, then one summary line."""
    width = max(len(row.check) for row in rows)
    lines = [f"engine-check {url}", f"{'check'.ljust(width)}  result   detail"]
    lines += [f"{row.check.ljust(width)}  {row.result.ljust(7)}  {row.detail}" for row in rows]
    failed = [row.check for row in rows if row.failed]
    lines.append(f"{len(rows) - len(failed)} of {len(rows)} checks passed" +
                 (f"; failed or not run: {', '.join(failed)}" if failed else ""))
    return "\n".join(lines) + "\n"


# ----- the command ---------------------------------------------------------------------------------

def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``engine-check`` on the top-level CLI; sets ``run`` for dispatch."""
    p = subparsers.add_parser(
        "engine-check", help="check one engine against the engine contract before adding it",
        description="Check one engine the way readmission would: health, /v1/models, identity, "
                    "attestation with a fresh nonce, KV role, and a one-token P/D probe with --peer.")
    p.add_argument("url", metavar="URL", help="the engine, http://HOST:PORT or https://HOST:PORT")
    p.add_argument("--role", choices=("prefill", "decode"), help="the role it will have in [[engines]]")
    p.add_argument("--key-file", metavar="F", help=f"the fleet key (default: --config's, else "
                                                  f"${attestation.KEY_FILE_ENV} or ${attestation.KEY_ENV})")
    p.add_argument("--peer", metavar="URL", help="an engine of the other role for the one-token P/D probe "
                                                 "(needs --role)")
    p.add_argument("--model", help="the model it must serve (default: --config's fleet.model)")
    p.add_argument("--generation", help="the generation it must report (default: --config's fleet.generation)")
    p.add_argument("--config", metavar="FILE",
                   help="the router's narwhal.toml: fleet model, generation and key, and [engine] TLS for https://")
    p.add_argument("--timeout-s", type=float, default=_DEFAULT_TIMEOUT_S,
                   help=f"per call (default {_DEFAULT_TIMEOUT_S:g}; the P/D probe's legs too)")
    p.set_defaults(run=run_engine_check)


class _UsageError(NarwhalError):
    pass


def _expectations(args: argparse.Namespace) -> Expectations:
    model, generation, key, source, context = args.model, args.generation, None, "", None
    if args.config:
        try:
            config = load_config(args.config)
            context = engine_context(config.engine, Path(args.config).parent)
        except ConfigError as exc:
            raise _UsageError(f"config error: {exc}") from None
        # The URL's own [[engines]] entry, when it has one, names the model (and so the generation) it serves.
        served = _served_model(config, args.url)
        model = model or served or config.fleet.model
        generation = generation or config.fleet.generation_of(model)
        if not args.key_file:
            key = config.attestation_key_bytes(Path(args.config).parent)
            source = f"{args.config} [fleet]" if key else ""
    if args.key_file:
        try:
            key, source = attestation.read_key_file(args.key_file), args.key_file
        except attestation.FleetKeyError as exc:
            raise _UsageError(str(exc)) from None
    elif key is None:
        try:
            key = attestation.key_from_environment()
            source = "$" + (attestation.KEY_FILE_ENV if os.environ.get(attestation.KEY_FILE_ENV)
                            else attestation.KEY_ENV)
        except attestation.FleetKeyError as exc:
            source = f"{exc}; or give --key-file F"
    peer = None
    if args.peer:
        if args.role is None:
            raise _UsageError("--peer needs --role: the role of URL (the peer has the other one)")
        peer = _spec("peer", args.peer, "decode" if args.role == "prefill" else "prefill")
    if not (args.timeout_s > 0 and math.isfinite(args.timeout_s)):
        raise _UsageError(f"--timeout-s must be a positive number, got {args.timeout_s}")
    return Expectations(role=args.role, model=model, generation=generation, key=key, key_source=source, peer=peer,
                        ssl_context=context)


def _served_model(config: Config, url: str) -> str | None:
    """The model ``url``'s ``[[engines]]`` entries serve, when the config lists it (under one model)."""
    try:
        address = _spec("URL", url, "prefill").address
    except _UsageError:
        return None
    models = {config.model_of(spec) for spec in config.engines if spec.address == address}
    return models.pop() if len(models) == 1 else None


def _spec(name: str, url: str, role: str) -> EngineSpec:
    try:
        return EngineSpec(name=name, url=url, role=role)  # type: ignore[arg-type]
    except ValueError as exc:
        raise _UsageError(f"{name}: {exc}") from None


def run_engine_check(args: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run the checks and print the table; 0 when all pass, 1 when one fails, 2 for bad arguments."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        expect = _expectations(args)
        _spec("URL", args.url, args.role or "prefill")
    except _UsageError as exc:
        err.write(f"narwhal engine-check: {exc}\n")
        return 2
    rows = trio.run(functools.partial(check_engine, args.url, expect, timeout_s=args.timeout_s))
    out.write(format_table(args.url, rows))
    return 1 if any(row.failed for row in rows) else 0
