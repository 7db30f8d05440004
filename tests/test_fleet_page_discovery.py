"""The fleet page's Discovery line: shown with backend, state, last event, revision and age when discovery is on,
hidden when off. The page's script runs under Node with a small DOM stand-in; skips when ``node`` is missing."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.test_fleet_page_models import PAGE

_DOM = r"""
class Node { constructor(tag) { this.tag = tag; this.attrs = {}; this.children = []; this.dataset = {};
  this.hidden = false; this.textContent = ""; }
  setAttribute(k, v) { this.attrs[k] = String(v); } append(...c) { this.children.push(...c); }
  addEventListener() {} replaceChildren(...c) { this.children = c; } }
const nodes = {};
globalThis.document = {createElement: t => new Node(t), createElementNS: (_, t) => new Node(t),
  querySelector: () => new Node("q"), getElementById: id => (nodes[id] ||= new Node(id)), body: new Node("body")};
globalThis.location = {hash: "", pathname: "/admin/ui"};
globalThis.history = {replaceState() {}};
globalThis.fetch = async () => { throw new Error("no network here"); };
globalThis.setTimeout = () => 0; globalThis.setInterval = () => 0;
"""

_RUN = r"""
function text(n) { return typeof n === "string" || typeof n === "number" ? String(n) : n.children.map(text).join(""); }
const out = [];
for (const view of VIEWS) {
  renderDiscovery(view);
  out.push([nodes["discovery"].hidden, text(nodes["discovery-body"])]);
}
console.log(JSON.stringify(out));
"""


def render(*views: dict) -> list[list]:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the page's script cannot run here")
    script = PAGE.read_text().split("<script>", 1)[1].split("</script>", 1)[0]
    program = _DOM + script + f"\nconst VIEWS = {json.dumps(views)};\n" + _RUN
    result = subprocess.run([node, "-e", program], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_discovery_line_shows_when_discovery_is_on_and_hides_when_off() -> None:
    on = {"backend": "etcd", "state": "degraded", "acting": True, "revision": 42, "resource_version": None,
          "last_event_at": None, "view_age_s": 3.25, "degraded": "etcd unreachable", "engines": [{}, {}]}
    [[hidden, body], [off_hidden, _]] = render(on, {"backend": "none", "state": "off", "engines": []})
    assert not hidden and off_hidden
    for part in ("Backend: etcd", "State: degraded", "Last event: —", "Revision: 42", "View age: 3.3 s",
                 "Engines: 2", "Degraded: etcd unreachable"):
        assert part in body, (part, body)
