"""``GET /admin/tenants``: each client key's traffic, read from the router's own metrics (workers' included).

The figures are the ``narwhal_tenant_*`` series as ``/metrics`` renders them
(with ``serving.workers > 1`` the controller's sums over every worker), so the
page and a scrape never disagree. Pure: it parses the exposition text.
"""

from __future__ import annotations

import re

import msgspec

__all__ = ["TenantRow", "TenantsView", "tenants_view"]

_SAMPLE = re.compile(r'^(narwhal_tenant_(?:requests|tokens|refusals)_total)\{([^}]*)\} ([0-9.e+-]+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class TenantRow(msgspec.Struct, kw_only=True):
    """One tenant's totals since the router started."""

    tenant: str
    requests: int = 0
    # Finished with a status of 400 or more (or a client that went away: 499).
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    refusals: dict[str, int] = {}


class TenantsView(msgspec.Struct, frozen=True, kw_only=True):
    """The tenants with the most requests first (at most ``limit``); ``auth`` is whether keys are on."""

    auth: bool
    tenants: list[TenantRow]


def tenants_view(metrics_text: str, *, auth: bool, limit: int = 20) -> TenantsView:
    """The top tenants by requests in ``metrics_text`` (the /metrics exposition)."""
    rows: dict[str, TenantRow] = {}
    for line in metrics_text.splitlines():
        if not line.startswith("narwhal_tenant_"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels_text, value_text = match.groups()
        labels = dict(_LABEL.findall(labels_text))
        tenant = labels.get("tenant", "")
        value = int(float(value_text))
        row = rows.setdefault(tenant, TenantRow(tenant=tenant, refusals={}))
        if name == "narwhal_tenant_requests_total":
            row.requests += value
            if labels.get("status", "0").isdigit() and int(labels["status"]) >= 400:
                row.errors += value
        elif name == "narwhal_tenant_tokens_total":
            if labels.get("kind") == "prompt":
                row.prompt_tokens += value
            else:
                row.completion_tokens += value
        else:
            reason = labels.get("reason", "")
            row.refusals[reason] = row.refusals.get(reason, 0) + value
    ranked = sorted(rows.values(), key=lambda row: (-row.requests, -sum(row.refusals.values()), row.tenant))
    return TenantsView(auth=auth, tenants=ranked[:limit])
