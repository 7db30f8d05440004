"""``bench --routers N``: N Narwhal routers as one cluster (``[lease] mode = "replicas"`` on one etcd).

Each router gets the same lease ``key`` and cluster token file, its own
``router_id`` (``bench-r1`` ..) and port; the bench waits until every router's
``/ready`` is 200 and its ``/admin/cluster`` lists all N, then loads them. Per
router the report gives its role and CPU seconds per request (its own process
tree, over the requests the load sent it); ``--compare-routers`` sets the
N-router pass beside a lone router's (no lease) on the same fleet.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio

from narwhal.tools.bench.fleet import Target

__all__ = ["CLUSTER_KEY_PREFIX", "RouterUsage", "RoutersComparison", "cluster_lease", "compare_routers",
           "format_comparison_lines", "format_router_lines", "router_roles", "router_usage", "wait_for_cluster",
           "write_cluster_token"]

# Under this prefix each run (and each pass) takes a key of its own, so that an --etcd shared with
# anything else, or a previous pass's registrations still within their TTL, never meet this pass's routers.
CLUSTER_KEY_PREFIX = "/narwhal-bench"


class RouterUsage(msgspec.Struct, frozen=True, kw_only=True):
    """One router of a pass: its id and role, the requests the load sent it and the CPU they cost it."""

    router_id: str
    # "controller" or "replica" from its /admin/cluster; "lone" for a router with no lease.
    role: str
    requests: int
    cpu_s: float | None
    cpu_per_request_ms: float | None


class RoutersComparison(msgspec.Struct, frozen=True, kw_only=True):
    """``--compare-routers``: the N-router pass over the lone router's pass (same kv_events mode)."""

    kv_events: str
    routers: int
    hit_rate_ratio: float | None
    # Summed CPU over summed requests, over the lone router's: all N routers, the replicas, the controller.
    cpu_per_request_ratio: float | None
    replica_cpu_per_request_ratio: float | None
    controller_cpu_per_request_ratio: float | None
    # The replicas' CPU per request over that of the same N routers with no lease (the split's cost set apart).
    replica_vs_independent_ratio: float | None = None


def write_cluster_token(workdir: Path) -> Path:
    """A fresh random link token in ``workdir`` (one printable line), shared by the pass's routers."""
    path = workdir / "cluster-token"
    path.write_text(secrets.token_urlsafe(24) + "\n")
    path.chmod(0o600)
    return path


def cluster_lease(*, etcd_url: str, key: str, router_id: str, token_file: Path,
                  extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One router's ``[lease]`` section; ``extra`` (``--set lease.*``) wins. TTL and renewal stay at defaults."""
    lease: dict[str, Any] = {"backend": "etcd", "mode": "replicas", "endpoints": [etcd_url], "key": key,
                             "router_id": router_id, "cluster_token_file": str(token_file)}
    lease.update(extra or {})
    return lease


async def _cluster_view(client: httpx.AsyncClient, router: Target) -> dict[str, Any] | None:
    """A router's ``GET /admin/cluster`` body; None on any error."""
    try:
        response = await client.get(router.url + "/admin/cluster")
        body = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return body if isinstance(body, dict) else None


async def _ready(client: httpx.AsyncClient, router: Target) -> bool:
    try:
        return (await client.get(router.url + "/ready")).status_code == 200
    except httpx.HTTPError:
        return False


def _listed(view: dict[str, Any] | None) -> int:
    routers = view.get("routers") if view is not None else None
    return len(routers) if isinstance(routers, list) else 0


async def wait_for_cluster(client: httpx.AsyncClient, routers: Sequence[Target], *, timeout_s: float = 60.0) -> None:
    """Until every router's /ready is 200 and its /admin/cluster lists all of them; RuntimeError past the timeout."""
    want = len(routers)
    last: list[tuple[bool, int]] = []
    with trio.move_on_after(timeout_s):
        while True:
            last = [(await _ready(client, router), _listed(await _cluster_view(client, router))) for router in routers]
            if all(ready and listed >= want for ready, listed in last):
                return
            for router in routers:
                if router.process is not None and router.process.returncode is not None:
                    raise RuntimeError(f"router {router.url} exited with status {router.process.returncode} "
                                       "before the cluster formed")
            await trio.sleep(0.2)
    states = ", ".join(f"{router.url} ready={ready} lists {listed}"
                       for router, (ready, listed) in zip(routers, last, strict=False))
    raise RuntimeError(f"the {want} routers did not form one cluster within {timeout_s:g} s: {states}")


async def router_roles(client: httpx.AsyncClient, routers: Sequence[Target]) -> list[tuple[str, str]]:
    """(router_id, role) of each router from its own /admin/cluster; ("?", "?") where it did not answer."""
    found = []
    for router in routers:
        view = await _cluster_view(client, router)
        if view is None:
            found.append(("?", "?"))
            continue
        role = str(view.get("role", "?"))
        found.append((str(view.get("router_id", "?")), "lone" if view.get("mode") == "standby" else role))
    return found


def router_usage(roles: Sequence[tuple[str, str]], requests: Sequence[int],
                 cpu_s: Sequence[float | None]) -> list[RouterUsage]:
    """Per router (same order in all three): its role, requests and CPU, and CPU per request in ms."""
    rows = []
    for (router_id, role), served, cpu in zip(roles, requests, cpu_s, strict=True):
        per_request = round(cpu / served * 1000, 4) if cpu is not None and served else None
        rows.append(RouterUsage(router_id=router_id, role=role, requests=served,
                                cpu_s=None if cpu is None else round(cpu, 3), cpu_per_request_ms=per_request))
    return rows


def _cpu_per_request(rows: Sequence[RouterUsage], role: str | None = None) -> float | None:
    """Summed CPU over summed requests of the rows with ``role`` (all rows when None)."""
    chosen = [row for row in rows if (role is None or row.role == role) and row.cpu_s is not None]
    served = sum(row.requests for row in chosen)
    return sum(row.cpu_s or 0.0 for row in chosen) / served if served else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def compare_routers(*, kv_events: str, routers: int, lone_hit_rate: float | None, hit_rate: float | None,
                    lone: Sequence[RouterUsage], several: Sequence[RouterUsage],
                    independent: Sequence[RouterUsage] = ()) -> RoutersComparison:
    """The N-router pass against the lone router's: hit rates, and CPU per request by role; with
    ``independent`` (the same N routers with no lease) also the replicas' CPU per request over theirs."""
    alone = _cpu_per_request(lone)
    replicas = _cpu_per_request(several, "replica")
    return RoutersComparison(
        kv_events=kv_events, routers=routers, hit_rate_ratio=_ratio(hit_rate, lone_hit_rate),
        cpu_per_request_ratio=_ratio(_cpu_per_request(several), alone),
        replica_cpu_per_request_ratio=_ratio(replicas, alone),
        controller_cpu_per_request_ratio=_ratio(_cpu_per_request(several, "controller"), alone),
        replica_vs_independent_ratio=_ratio(replicas, _cpu_per_request(independent)) if independent else None)


def _cell(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_router_lines(pass_name: str, rows: Sequence[RouterUsage]) -> list[str]:
    """A pass's routers: one line each with its role, requests and CPU per request."""
    lines = []
    for row in rows:
        lines.append(f"  {pass_name} {row.router_id} ({row.role}): {row.requests} requests, "
                     f"CPU {_cell(row.cpu_s)} s, {_cell(row.cpu_per_request_ms)} ms/request")
    return lines


def format_comparison_lines(comparisons: Sequence[RoutersComparison]) -> list[str]:
    """``--compare-routers``: per kv_events mode, the ratios against one router (and against N with no lease)."""
    lines = []
    for c in comparisons:
        line = (f"  {c.routers} routers / 1 router ({c.kv_events}): hit rate {_cell(c.hit_rate_ratio)}, "
                f"CPU per request {_cell(c.cpu_per_request_ratio)} (replicas {_cell(c.replica_cpu_per_request_ratio)}, "
                f"controller {_cell(c.controller_cpu_per_request_ratio)})")
        if c.replica_vs_independent_ratio is not None:
            line += f"; replicas / {c.routers} routers with no lease {_cell(c.replica_vs_independent_ratio)}"
        lines.append(line)
    return lines
