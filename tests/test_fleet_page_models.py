"""The fleet page groups engines by model (a heading row per model) when several are served, and only then.

The page's own script runs under Node with a small DOM stand-in (no browser): ``renderEngines`` is called with
an ``/admin/engines`` answer and the rows it builds are read back. Skips when ``node`` is not installed.
"""

from __future__ import annotations

from tests.fleet_page_script import run_page

_RUN = r"""
const tbody = new Node("tbody");
document.querySelector = () => tbody;
const engine = (name, model, ejected) => ({name, model, role: "decode", url: "http://x", ejected, eligible: !ejected,
  holds: [], evidence: {}, counters: {failures: {}}, in_flight: 0, drained: false, last_readmission: null});
const out = [];
for (const engines of ENGINES) {
  tbody.children = [];
  renderEngines({engines: engines.map(e => engine(...e))}, 10);
  out.push(tbody.children.map(r => [r.attrs.class, r.attrs["data-engine"] || r.attrs["data-model"],
                                    text(r.children[0])]));
}
console.log(JSON.stringify(out));
"""


def rows(*fleets: list[tuple[str, str, bool]]) -> list[list[list[str]]]:
    return run_page(_RUN, ENGINES=fleets)


def test_engines_are_grouped_under_a_heading_per_model_only_when_several_are_served() -> None:
    several, one = rows([["a1", "a", False], ["b1", "b", True], ["a2", "a", False]],
                        [["x1", "m", False], ["x2", "m", False]])
    assert [(kind, name) for kind, name, _ in several] == [
        ("model-heading", "a"), ("engine", "a1"), ("engine", "a2"), ("model-heading", "b"), ("engine", "b1")]
    assert several[0][2] == "Model a · 2 engines, 2 eligible"
    assert several[3][2] == "Model b · 1 engine, 0 eligible"
    assert [(kind, name) for kind, name, _ in one] == [("engine", "x1"), ("engine", "x2")]
