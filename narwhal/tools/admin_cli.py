"""``python -m narwhal admin engines|models|cluster|reload|drain NAME|...``: the operator's commands.

Each talks to a running router's admin API (``--url``, default
http://127.0.0.1:8000; ``--token``, default ``$NARWHAL_ADMIN_TOKEN``), prints
the fleet as a table or the action's result, and exits 1 with one line on
stderr when the router cannot be reached or says no (401, 404, a refused
readmission's 409 with the failed check and why, a reload whose TLS files
failed); a token that cannot travel in an HTTP header (not printable ASCII)
exits 2 before any request.

Against a replica (``[lease] mode = "replicas"``) a drain or a reload is a 409
``not_controller`` naming the controller: the command is sent once more, to the
controller's ``cluster_url`` with the same token and TLS options, and stderr
says so; a second refusal is printed as the error (never followed again).

An ``https://`` router is verified with ``--ca-file`` (default
``$NARWHAL_ADMIN_CA_FILE``), else with OpenSSL's default store, which honours
``$SSL_CERT_FILE`` and ``$SSL_CERT_DIR``; ``--cert-file``/``--key-file`` present
a client certificate to a router that asks for one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import ssl
import sys
import urllib.parse
from collections.abc import Callable
from typing import Any, TextIO

import httpx

from narwhal.config import admin_token_problem
from narwhal.errors import NarwhalError
from narwhal.tools.cli_args import http_url

__all__ = ["add_parser", "format_cluster", "format_discovery", "format_engines", "format_models", "format_placement",
           "format_reload", "run_admin"]

DEFAULT_URL = "http://127.0.0.1:8000"
TOKEN_ENV = "NARWHAL_ADMIN_TOKEN"
CA_FILE_ENV = "NARWHAL_ADMIN_CA_FILE"
# A readmission runs up to six engine calls, each bounded by engine.health_timeout_s.
_TIMEOUT_S = 120.0
_DRAIN_KINDS = ("operator_drain", "maintenance")


class _AdminError(NarwhalError):
    """Why an admin command failed, as the one line to print."""


def _add_connection_options(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    # On the sub-actions the defaults are suppressed, so options given before the
    # action are not overwritten by the action parser's defaults.
    parser.add_argument("--url", default=DEFAULT_URL if defaults else argparse.SUPPRESS, type=http_url,
                        help=f"the router's admin address (default {DEFAULT_URL})")
    parser.add_argument("--token", default=None if defaults else argparse.SUPPRESS,
                        help=f"bearer token for [admin] token (default ${TOKEN_ENV})")
    parser.add_argument("--ca-file", default=None if defaults else argparse.SUPPRESS, metavar="FILE",
                        help=f"CA bundle that verifies an https:// router (default ${CA_FILE_ENV}, else the "
                             "system store or $SSL_CERT_FILE)")
    parser.add_argument("--cert-file", default=None if defaults else argparse.SUPPRESS, metavar="FILE",
                        help="client certificate (PEM) for a router that requires one")
    parser.add_argument("--key-file", default=None if defaults else argparse.SUPPRESS, metavar="FILE",
                        help="the client certificate's private key (PEM; omit when it is in --cert-file)")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``admin`` and its actions on the top-level CLI; sets ``run`` for dispatch."""
    admin = subparsers.add_parser(
        "admin", help="inspect engines, drain, maintain and readmit them",
        description="Operate a running router through its admin API.")
    _add_connection_options(admin, defaults=True)
    actions = admin.add_subparsers(dest="action", required=True, metavar="ACTION")
    engines = actions.add_parser("engines", help="show every engine: role, state, holds, streaks, in flight")
    _add_connection_options(engines, defaults=False)
    models = actions.add_parser("models", help="show every served model: aliases, max_model_len, whether it "
                                               "can serve, its engines")
    _add_connection_options(models, defaults=False)
    discovery = actions.add_parser("discovery", help="show discovery: backend, state, revision, last event, age "
                                                     "of the view, the discovered engines")
    _add_connection_options(discovery, defaults=False)
    placement = actions.add_parser("placement", help="show each prefill engine's prefix index and KV event feed "
                                                     "(state, last sequence, blocks, events/s, resyncs, dropped)")
    _add_connection_options(placement, defaults=False)
    cluster = actions.add_parser("cluster", help="show the routers serving this fleet: role, advertise URL, fleet "
                                                 "revision applied, lag (* marks the router asked)")
    cluster.add_argument("--json", action="store_true", help="print /admin/cluster's JSON as it came")
    _add_connection_options(cluster, defaults=False)
    reload = actions.add_parser("reload", help="read the config file again (as SIGHUP does) and show what changed",
                                description="Read the router's config file again, as SIGHUP does, and show "
                                            "what changed and which changes need a restart.")
    _add_connection_options(reload, defaults=False)
    for action, text in (("drain", "stop new placements on NAME; requests in flight finish"),
                         ("maintenance", "drain NAME for planned maintenance and record the start"),
                         ("readmit", "verify NAME and return it to placement (clears drains)")):
        parser = actions.add_parser(action, help=text, description=text)
        parser.add_argument("name", metavar="NAME", help="engine name from the config")
        _add_connection_options(parser, defaults=False)
    admin.set_defaults(run=run_admin)


def run_admin(args: argparse.Namespace, *, transport: httpx.BaseTransport | None = None,
              out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Carry out one admin action; 0 on success, 1 (with one line on stderr) on failure."""
    out = out or sys.stdout
    err = err or sys.stderr
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV)
    if token:
        problem = admin_token_problem(token)
        if problem is not None:
            source = "--token" if args.token is not None else f"${TOKEN_ENV}"
            err.write(f"narwhal admin: {source}: the token {problem}\n")
            return 2
    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        verify = _tls_context(args)
    except _AdminError as exc:
        err.write(f"narwhal admin: {exc}\n")
        return 2

    def open_client(url: str) -> httpx.Client:
        # trust_env=False: no proxy from the environment on the way to a router; SSL_CERT_FILE is
        # honoured by _tls_context instead.
        return httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=_TIMEOUT_S,
                            transport=transport, trust_env=False, verify=verify)

    try:
        with open_client(args.url) as client:
            admin = _Admin(client, args.url.rstrip("/"), open_client, err)
            if args.action == "engines":
                out.write(format_engines(admin.call("GET", "/admin/engines")["engines"]))
            elif args.action == "discovery":
                out.write(format_discovery(admin.call("GET", "/admin/discovery")))
            elif args.action == "placement":
                out.write(format_placement(admin.call("GET", "/admin/placement")))
            elif args.action == "models":
                out.write(format_models(admin.call("GET", "/admin/models")["models"]))
            elif args.action == "cluster":
                view = admin.call("GET", "/admin/cluster")
                out.write(json.dumps(view, indent=2) + "\n" if args.json else format_cluster(view))
            elif args.action == "reload":
                body = admin.call("POST", "/admin/reload")
                out.write(format_reload(body))
                if body.get("tls") == "failed":
                    # The config part applied; the TLS files did not, and the router keeps its old ones.
                    raise _AdminError("the TLS files were not reloaded: the router keeps its running "
                                      "certificates until a reload reads good files")
            else:
                path = f"/admin/engines/{urllib.parse.quote(args.name, safe='')}/{args.action}"
                out.write(_format_action(admin.call("POST", path)))
    except _AdminError as exc:
        err.write(f"narwhal admin: {exc}\n")
        return 1
    except httpx.InvalidURL as exc:
        err.write(f"narwhal admin: --url {args.url!r}: {exc}\n")
        return 2
    return 0


def _tls_context(args: argparse.Namespace) -> ssl.SSLContext:
    """The context that verifies an https:// router: --ca-file, $NARWHAL_ADMIN_CA_FILE, else OpenSSL's defaults."""
    ca_file = getattr(args, "ca_file", None)
    source = "--ca-file"
    if ca_file is None and os.environ.get(CA_FILE_ENV):
        ca_file, source = os.environ[CA_FILE_ENV], f"${CA_FILE_ENV}"
    cert_file, key_file = getattr(args, "cert_file", None), getattr(args, "key_file", None)
    if key_file is not None and cert_file is None:
        raise _AdminError("--key-file needs --cert-file")
    try:
        # Without a CA file: the system store, or $SSL_CERT_FILE / $SSL_CERT_DIR when set.
        context = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise _AdminError(f"{source} {ca_file!r}: cannot load a CA bundle: {_reason(exc)}") from None
    if cert_file is not None:
        try:
            context.load_cert_chain(cert_file, key_file)
        except (OSError, ssl.SSLError) as exc:
            raise _AdminError(f"--cert-file {cert_file!r}: cannot load the client certificate"
                              f"{'' if key_file is None else f' and key {key_file!r}'}: {_reason(exc)}") from None
    return context


def _reason(exc: OSError | ssl.SSLError) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    return exc.strerror or str(exc)


class _Admin:
    """One command's calls to ``--url``; a replica's ``not_controller`` answer is followed once, to the controller."""

    def __init__(self, client: httpx.Client, url: str, open_client: Callable[[str], httpx.Client],
                 err: TextIO) -> None:
        self.client = client
        self.url = url
        self.open_client = open_client
        self.err = err

    def call(self, method: str, path: str) -> dict[str, Any]:
        """The answer's JSON object on 200; else ``_AdminError`` with the one line to print."""
        response = _send(self.client, method, path)
        controller = _controller_of(response)
        if controller is None:
            return _answer(self.client, response)
        who, url = controller
        self.err.write(f"narwhal admin: {self.url} is a replica; sent to the controller {who} at {url}\n")
        # Once: the controller's own answer is the command's, a second not_controller included.
        with self.open_client(url) as client:
            return _answer(client, _send(client, method, path))


def _controller_of(response: httpx.Response) -> tuple[str, str] | None:
    """(router_id, cluster_url) of a replica's 409 ``not_controller`` that names where the controller is."""
    if response.status_code != 409:
        return None
    try:
        body = response.json()
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    error, controller = body.get("error"), body.get("controller")
    if not isinstance(error, dict) or error.get("code") != "not_controller" or not isinstance(controller, dict):
        return None
    url = controller.get("cluster_url")
    if not isinstance(url, str) or urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        return None
    who = controller.get("router_id")
    return (who if isinstance(who, str) and who else "(unnamed)"), url


def _send(client: httpx.Client, method: str, path: str) -> httpx.Response:
    try:
        return client.request(method, path)
    except httpx.HTTPError as exc:
        hint = ""
        if "CERTIFICATE_VERIFY_FAILED" in str(exc):
            hint = f" (pass --ca-file or set {CA_FILE_ENV} to the CA that signed the router's certificate)"
        elif "CERTIFICATE_REQUIRED" in str(exc) or "certificate required" in str(exc):
            hint = " (the router requires a client certificate: pass --cert-file and --key-file)"
        raise _AdminError(f"cannot reach {client.base_url}: {exc or type(exc).__name__}{hint}") from None


def _answer(client: httpx.Client, response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code == 200 and isinstance(body, dict):
        return body
    error = body.get("error") if isinstance(body, dict) else None
    error = error if isinstance(error, dict) else {}
    message = error.get("message") if isinstance(error.get("message"), str) else None
    message = message or response.text.strip()[:200] or response.reason_phrase
    if response.status_code == 401:
        message += f" (pass --token or set {TOKEN_ENV})"
    elif response.status_code == 404 and error.get("code") != "engine_not_found" and "--url" not in message:
        # Not this router's admin API: the traffic port of one with [admin] listen set, or not a router.
        message += (f" (no admin API at {client.base_url}: if the router sets [admin] listen, "
                    "pass --url ADMIN_ADDRESS)")
    raise _AdminError(f"HTTP {response.status_code}: {message}")


def format_cluster(view: dict[str, Any]) -> str:
    """``/admin/cluster`` as a line about this router's view, then a row per router (``*``: the one asked)."""
    age = view.get("view_age_s")
    lines = [f"cluster: mode {view.get('mode')}, this router {view.get('router_id')} ({view.get('role')}), "
             f"controller {view.get('controller') or '-'}, view age "
             + ("-" if age is None else f"{age:.1f} s") + f", stale {'yes' if view.get('stale') else 'no'}", ""]
    header = ("", "ROUTER", "ROLE", "ADVERTISE_URL", "FLEET_REVISION", "LAG_S")
    rows = [("*" if r.get("is_self") else "", str(r.get("router_id")), str(r.get("role")),
             str(r.get("advertise_url")), str(r.get("fleet_revision")), f"{r.get('lag_s', 0.0):.1f}")
            for r in view.get("routers", [])]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
              for row in (header, *rows)]
    return "\n".join(lines) + "\n"


def format_reload(body: dict[str, Any]) -> str:
    """A reload's answer: one line per kind of change, and the keys that wait for a restart."""
    changes = body.get("changes") or {}
    lines = [f"reloaded {body.get('file', '')}"]
    for field, label in (("engines_added", "engines added"), ("engines_removed", "engines removed"),
                         ("engines_changed", "engines changed (url or role: removed and added)"),
                         ("keys_changed", "keys changed"),
                         ("keys_needing_restart", "need a restart (running values kept)")):
        if changes.get(field):
            lines.append(f"  {label}: {', '.join(changes[field])}")
    if len(lines) == 1:
        lines.append("  nothing changed")
    if body.get("tls") == "reloaded":
        lines.append("  TLS files: reloaded")
    elif body.get("tls") == "failed":
        reason = body.get("tls_error") or "no reason given (see the router's tls_reload_failed log line)"
        lines.append(f"  TLS files: failed: {reason}")
    return "\n".join(lines) + "\n"


def _when(wall: float | None) -> str:
    if wall is None:
        return "-"
    return datetime.datetime.fromtimestamp(wall, datetime.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _state(engine: dict[str, Any]) -> str:
    if engine.get("ejected"):
        return "ejected"
    held = [h["kind"] for h in engine.get("holds", []) if not h.get("deferred")]
    if any(kind in _DRAIN_KINDS for kind in held):
        return "drained" if engine.get("drained") else "draining"
    if held or not engine.get("eligible", True):
        return "held"
    return "eligible"


def _holds(engine: dict[str, Any]) -> str:
    holds = [h["kind"] + (" (deferred)" if h.get("deferred") else "") for h in engine.get("holds", [])]
    return ", ".join(holds) or "-"


def _streaks(engine: dict[str, Any]) -> str:
    streaks = [f"{cls}={n}" for cls, n in engine.get("evidence", {}).items() if n]
    if engine.get("liveness_misses"):
        streaks.append(f"liveness={engine['liveness_misses']}")
    return ", ".join(streaks) or "-"


def format_engines(engines: list[dict[str, Any]]) -> str:
    """The fleet as a table, then one line per engine that is out or has a readmission to report."""
    header = ("NAME", "ROLE", "STATE", "HOLDS", "STREAKS", "IN FLIGHT")
    rows = [(e["name"], e["role"], _state(e), _holds(e), _streaks(e), str(e.get("in_flight", 0)))
            for e in engines]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
             for row in (header, *rows)]
    notes: list[str] = []
    for engine in engines:
        if engine.get("ejected"):
            notes.append(f"{engine['name']}: ejected: {engine.get('ejected_reason') or 'no reason recorded'}")
        for hold in engine.get("holds", []):
            notes.append(f"{engine['name']}: {hold['kind']}: {hold.get('reason', '')}")
        if engine.get("maintenance_started_at") is not None:
            notes.append(f"{engine['name']}: maintenance since {_when(engine['maintenance_started_at'])}")
        last = engine.get("last_readmission")
        if last:
            notes.append(f"{engine['name']}: last readmission {_describe_readmission(last)}")
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def format_discovery(view: dict[str, Any]) -> str:
    """``/admin/discovery`` as a few lines, then the discovered engines as a table."""
    if view.get("state") == "off":
        return "discovery: off ([discovery] backend = \"none\")\n"
    where = (f"resourceVersion {view.get('resource_version')}" if view.get("backend") == "kubernetes"
             else f"revision {view.get('revision')}")
    age = view.get("view_age_s")
    lines = [f"discovery: {view.get('backend')}, {view.get('state')}"
             + (f" ({view.get('degraded')})" if view.get("degraded") else "")
             + ("" if view.get("acting") else ", standby: watching, not applying"),
             f"{where}, last event {_when(view.get('last_event_at'))}, view confirmed "
             + ("never" if age is None else f"{age:.1f} s ago"), ""]
    header = ("ENGINE", "ROLE", "MODEL", "URL")
    rows = [(e["name"], e["role"], e["model"], e["url"]) for e in view.get("engines", [])]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
              for row in (header, *rows)]
    refused = [f"{r['name']}: refused: {r['problem']}" for r in view.get("refused", [])]
    if refused:
        lines += ["", *refused]
    return "\n".join(lines) + "\n"


def format_placement(view: dict[str, Any]) -> str:
    """``/admin/placement`` as a line of settings, then a row per prefill engine."""
    lines = [f"placement: {view.get('policy')}, kv_events {view.get('kv_events')}", ""]
    header = ("ENGINE", "MODEL", "INDEX", "KV_EVENTS", "LAST_SEQ", "BLOCKS", "EVENTS/S", "RESYNCS", "DROPPED")
    rows = []
    for name, engine in view.get("engines", {}).items():
        feed = engine.get("kv_events", {})
        index = engine.get("index", {})
        rows.append((name, engine.get("model", ""), f"{index.get('entries', 0)} ({index.get('bytes', 0)} B)",
                     str(feed.get("state")), "-" if feed.get("last_seq") is None else str(feed["last_seq"]),
                     str(feed.get("blocks", 0)), f"{feed.get('events_per_s', 0.0):.1f}",
                     str(feed.get("resyncs", 0)), str(feed.get("dropped", 0))))
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
              for row in (header, *rows)]
    return "\n".join(lines) + "\n"


def format_models(models: list[dict[str, Any]]) -> str:
    """The served models as a table, then each model's engines and why a model cannot serve."""
    header = ("MODEL", "ALIASES", "GENERATION", "MAX_MODEL_LEN", "SERVING", "ENGINES")
    rows = [(m["name"], ", ".join(m.get("aliases", [])) or "-", m.get("generation", ""),
             "-" if m.get("max_model_len") is None else str(m["max_model_len"]),
             "yes" if m.get("can_serve") else "no",
             ", ".join(f"{e['name']} ({e['role']}, {e['state']})" for e in m.get("engines", [])) or "-")
            for m in models]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
             for row in (header, *rows)]
    notes = [f"{m['name']}: cannot serve: {m['reason']}" for m in models if not m.get("can_serve")]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def _describe_readmission(result: dict[str, Any]) -> str:
    who = "operator" if result.get("operator") else "automatic"
    if result.get("outcome") == "readmitted":
        return f"readmitted at {_when(result.get('at'))} ({who})"
    return (f"refused at {_when(result.get('at'))} ({who}) by check {result.get('check')}: "
            f"{result.get('reason')}")


def _format_action(body: dict[str, Any]) -> str:
    engine = body["engine"]
    name = engine["name"]
    action = body["action"]
    if action == "readmit":
        passed = ", ".join(body["readmission"].get("passed", []))
        return f"{name}: readmitted (passed: {passed}); state {_state(engine)}\n"
    in_flight = engine.get("in_flight", 0)
    settled = ("drained: nothing in flight" if engine.get("drained")
               else f"draining: {in_flight} request(s) in flight will finish")
    if action == "maintenance":
        return (f"{name}: maintenance started {_when(body.get('maintenance_started_at'))}; {settled}; "
                f"restart the engine, then run: narwhal admin readmit {name}\n")
    return f"{name}: drain requested; {settled}; undo with: narwhal admin readmit {name}\n"
