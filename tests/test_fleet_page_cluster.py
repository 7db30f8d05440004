"""The fleet page's Routers section (``GET /admin/cluster``): shown in replicas mode or with more than one router,
hidden for a lone router in standby mode. The page's script runs under Node with a small DOM stand-in; skips when
``node`` is missing."""

from __future__ import annotations

from tests.fleet_page_script import PAGE, run_page

_RUN = r"""
const tbody = new Node("tbody");
document.querySelector = sel => sel === "#routers tbody" ? tbody : new Node("q");
const out = [];
for (const view of VIEWS) {
  tbody.children = [];
  delete nodes["cluster-body"];
  renderCluster(view);
  const body = nodes["cluster-body"];
  out.push([nodes["cluster"].hidden, body ? text(body) : "", tbody.children.map(row => row.children.map(text))]);
}
console.log(JSON.stringify(out));
"""

ROUTER = {"router_id": "r1", "role": "controller", "advertise_url": "http://a:8000", "fleet_revision": 7,
          "lag_s": 0.0, "cluster_url": "http://a:9000", "is_self": False}


def render(*views: dict) -> list[list]:
    return run_page(_RUN, VIEWS=views)


def test_the_routers_section_lists_every_router_in_replicas_mode() -> None:
    view = {"mode": "replicas", "router_id": "r2", "role": "replica", "controller": "r1", "fleet_revision": 7,
            "view_age_s": 1.25, "stale": True,
            "routers": [ROUTER, {**ROUTER, "router_id": "r2", "role": "replica", "advertise_url": "http://b:8000",
                                 "fleet_revision": 6, "lag_s": 0.5, "is_self": True}]}
    [[hidden, body, rows]] = render(view)
    assert not hidden
    for part in ("Mode: replicas", "This router: replica", "Controller: r1", "Fleet revision: 7", "View age: 1.3 s",
                 "Stale: yes"):
        assert part in body, (part, body)
    assert rows == [["r1", "controller", "http://a:8000", "7", "0.0 s"],
                    ["r2 (this router)", "replica", "http://b:8000", "6", "0.5 s"]]


def test_the_routers_section_is_hidden_for_a_lone_router_in_standby_mode() -> None:
    lone = {"mode": "standby", "router_id": "r1", "role": "controller", "controller": "r1", "fleet_revision": 0,
            "view_age_s": None, "stale": False, "routers": [{**ROUTER, "is_self": True}]}
    two = {**lone, "routers": [ROUTER, {**ROUTER, "router_id": "r2", "role": "standby"}]}
    [[lone_hidden, _, _], [two_hidden, _, rows]] = render(lone, two)
    assert lone_hidden and not two_hidden
    assert len(rows) == 2


def test_the_page_fetches_admin_cluster_and_has_the_section() -> None:
    page = PAGE.read_text()
    assert 'getJSON("/admin/cluster")' in page and "<h2>Routers</h2>" in page and 'id="routers"' in page


_TENANTS = r"""
const tbody = new Node("tbody");
document.querySelector = sel => sel === "#tenants tbody" ? tbody : new Node("q");
const out = [];
for (const view of VIEWS) {
  tbody.children = [];
  renderTenants(view);
  out.push([nodes["tenants-box"].hidden, tbody.children.map(row => row.children.map(text))]);
}
console.log(JSON.stringify(out));
"""


def test_the_tenants_section_lists_the_top_tenants_when_keys_are_on() -> None:
    views = [{"auth": True, "tenants": [{"tenant": "team-a", "requests": 12, "errors": 2, "prompt_tokens": 300,
                                         "completion_tokens": 90, "refusals": {"requests": 2}}]},
             {"auth": False, "tenants": []}]
    shown, hidden = run_page(_TENANTS, VIEWS=views)
    assert shown == [False, [["team-a", "12", "2", "300", "90", "requests 2"]]]
    assert hidden[0] is True
