"""The fleet page's Discovery line: shown with backend, state, last event, revision and age when discovery is on,
hidden when off. The page's script runs under Node with a small DOM stand-in; skips when ``node`` is missing."""

from __future__ import annotations

from tests.fleet_page_script import run_page

_RUN = r"""
const out = [];
for (const view of VIEWS) {
  renderDiscovery(view);
  out.push([nodes["discovery"].hidden, text(nodes["discovery-body"])]);
}
console.log(JSON.stringify(out));
"""


def render(*views: dict) -> list[list]:
    return run_page(_RUN, VIEWS=views)


def test_the_discovery_line_shows_when_discovery_is_on_and_hides_when_off() -> None:
    on = {"backend": "etcd", "state": "degraded", "acting": True, "revision": 42, "resource_version": None,
          "last_event_at": None, "view_age_s": 3.25, "degraded": "etcd unreachable", "engines": [{}, {}]}
    [[hidden, body], [off_hidden, _]] = render(on, {"backend": "none", "state": "off", "engines": []})
    assert not hidden and off_hidden
    for part in ("Backend: etcd", "State: degraded", "Last event: —", "Revision: 42", "View age: 3.3 s",
                 "Engines: 2", "Degraded: etcd unreachable"):
        assert part in body, (part, body)
