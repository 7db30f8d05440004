"""The fleet page (/admin/ui) in a real browser: headless Chromium against a live router and mock engines.

The router and the engines run as processes. Chromium loads the page (the
admin token in the URL fragment, which never reaches the server), runs its
script for a few seconds of virtual time, and prints the rendered DOM; the test
asserts on that DOM while an engine is stopped (ejected, readmission refused)
and started again (readmitted). A screenshot of the page with the engine
ejected is kept in ``$NARWHAL_ARTIFACTS`` (default ``artifacts/`` in the
checkout) as ``fleet-page.png``, with the DOM dumps beside it.

Without a Chromium binary (``apt-get install chromium``; ``.ci/run`` installs
it) the test skips and says why.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import trio

from narwhal.tools.local_fleet import start_mock_engine
from tests.e2e.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

TOKEN = "browser-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
SECTIONS: dict[str, dict[str, Any]] = {
    "admin": {"token": TOKEN},
    "engine": {"connect_timeout_s": 0.5, "health_timeout_s": 0.5},
    "controller": {"monitor_interval_s": 0.2, "stage_timeout_s": 1.5},
    "recovery": {"liveness_misses": 2, "probe_interval_s": 0.5},
}
REQUEST = {"model": "mock-model", "prompt": "hello", "max_tokens": 4}
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
                  "--hide-scrollbars", "--mute-audio")
ARTIFACTS = Path(os.environ.get("NARWHAL_ARTIFACTS", Path(__file__).resolve().parents[2] / "artifacts"))


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("BROWSER TEST SKIPPED: no chromium binary on PATH (apt-get install -y chromium; .ci/run does)")


class Dom(HTMLParser):
    """Every element's tag, attributes and own text, in document order."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.elements: list[dict[str, Any]] = []
        self._open: list[dict[str, Any]] = []
        self.html = html
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = {"tag": tag, **{k: v or "" for k, v in attrs}, "text": ""}
        self.elements.append(element)
        if tag not in ("input", "meta", "br", "img", "link"):
            self._open.append(element)

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            if self._open.pop()["tag"] == tag:
                break

    def handle_data(self, data: str) -> None:
        for element in self._open:
            element["text"] += data

    def find(self, **attrs: str) -> list[dict[str, Any]]:
        return [e for e in self.elements if all(e.get(k) == v for k, v in attrs.items())]


async def render(url: str, *, budget_ms: int = 3000, screenshot: Path | None = None) -> Dom:
    """Load ``url`` in headless Chromium and return the DOM after ``budget_ms`` of virtual time."""
    binary = chromium()
    with tempfile.TemporaryDirectory(prefix="narwhal-chromium-") as profile:
        argv = [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}",
                "--window-size=1500,1100"]
        argv += [f"--screenshot={screenshot}"] if screenshot is not None else ["--dump-dom"]
        with trio.fail_after(90):
            result = await trio.run_process([*argv, url], capture_stdout=True, capture_stderr=True, check=False)
    assert result.returncode == 0, result.stderr.decode(errors="replace")[-2000:]
    return Dom(result.stdout.decode())


def save(name: str, data: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / name).write_text(data)


async def test_the_fleet_page_shows_an_engine_ejected_refused_and_readmitted_in_chromium(start_fleet, nursery) -> None:
    chromium()
    fleet = await start_fleet(prefill=1, decode=2, sections=SECTIONS)
    page = f"{fleet.url}/admin/ui"
    for _ in range(6):
        response = await fleet.client.post(f"{fleet.url}/v1/completions", json=REQUEST)
        assert response.status_code == 200, response.text

    # Without the token the page asks for it and shows no fleet data.
    dom = await render(page, budget_ms=1500)
    [body] = dom.find(tag="body")
    assert body["data-state"] == "login"
    assert dom.find(tag="tr", **{"class": "engine"}) == []
    assert dom.find(tag="input", id="token")

    # With it: a row per engine, all eligible, the eight monitor stages, the charts.
    dom = await render(f"{page}#token={TOKEN}")
    save("fleet-page-healthy.html", dom.html)
    [body] = dom.find(tag="body")
    assert body["data-state"] == "live"
    rows = dom.find(tag="tr", **{"class": "engine"})
    assert [(r["data-engine"], r["data-state"]) for r in rows] == [
        ("p1", "eligible"), ("d1", "eligible"), ("d2", "eligible")]
    assert len(dom.find(tag="tr", **{"class": "stage"})) == 8
    [requests_chart] = dom.find(tag="svg", id="chart-requests")
    assert int(requests_chart["data-points-requests"]) > 0
    assert dom.find(tag="button", **{"data-action": "drain"})

    # d2 stops: ejected, its readmission refused while it is down.
    port = fleet.engines["d2"].port
    await fleet.engines["d2"].stop()

    async def d2() -> dict[str, Any]:
        response = await fleet.client.get(f"{fleet.url}/admin/engines/d2", headers=AUTH)
        return response.json()["engine"]

    async def refused() -> bool:
        engine = await d2()
        last = engine["last_readmission"]
        return engine["ejected"] and last is not None and last["outcome"] == "refused"

    await wait_until(refused, timeout_s=20, what="d2 ejected and its readmission refused")

    async def ejection_in_timeline() -> bool:
        response = await fleet.client.get(f"{fleet.url}/admin/timeline?seconds=30", headers=AUTH)
        return "ejected" in response.json()["state"]["d2"]

    await wait_until(ejection_in_timeline, timeout_s=10, what="a complete second with d2 ejected in the timeline")
    dom = await render(f"{page}#token={TOKEN}")
    rows = {r["data-engine"]: r for r in dom.find(tag="tr", **{"class": "engine"})}
    assert rows["d2"]["data-state"] == "ejected" and rows["d1"]["data-state"] == "eligible"
    assert "ejected" in rows["d2"]["text"]
    refusal = [e for e in dom.find(tag="td", **{"class": "refusal"}) if e["text"] != "none"]
    assert len(refusal) == 1 and "UTC" in refusal[0]["text"]
    segments = dom.find(tag="rect", **{"class": "state-segment", "data-engine": "d2"})
    assert {s["data-state"] for s in segments} >= {"ejected"}
    assert all(s["data-state"] == "eligible" for s in dom.find(tag="rect", **{"data-engine": "d1"}))
    save("fleet-page-ejected.html", dom.html)
    await render(f"{page}#token={TOKEN}", screenshot=ARTIFACTS / "fleet-page.png")
    assert (ARTIFACTS / "fleet-page.png").stat().st_size > 10_000

    # d2 comes back at the same address: readmitted, the page shows it eligible again.
    new = await start_mock_engine(nursery, "decode", engine_id="d2", port=port)
    try:
        async def back() -> bool:
            return (await d2())["eligible"]

        await wait_until(back, timeout_s=20, what="d2 readmitted")
        dom = await render(f"{page}#token={TOKEN}")
        rows = {r["data-engine"]: r for r in dom.find(tag="tr", **{"class": "engine"})}
        save("fleet-page-readmitted.html", dom.html)
        assert rows["d2"]["data-state"] == "eligible"
        states = [s["data-state"] for s in dom.find(tag="rect", **{"class": "state-segment", "data-engine": "d2"})]
        assert "ejected" in states  # the ejection stays on the chart
    finally:
        with trio.CancelScope(shield=True):
            await new.stop()


async def test_the_bench_report_renders_in_chromium(tmp_path) -> None:
    chromium()
    from test_bench import FaultReport, _run_report, _timeline

    from narwhal.tools.bench.html_report import render_html
    from narwhal.tools.bench.report import BenchReport

    faults = FaultReport(
        killed_engine="d1", failing_engine="d2", failing_status=500,
        timeline=[{"at_s": 2.0, "event": "d1 killed (SIGKILL)"}], goodput=1.0, requests_lost=0, lost_by_kind={},
        streams_cut=0, cut_with_error_event=0, cut_silently=0, attempts_on_dead_engine=1,
        dead_engine_last_attempt_s=0.01, dead_engine_ineligible_s=0.02, restarted_engine_eligible_s=1.0,
        restarted_engine_first_served_s=1.5, failing_engine_requests_during_fault=4,
        failing_engine_last_request_s=0.1, failing_engine_ineligible_s=0.1)
    report = BenchReport(settings={"scenario": "faults"}, run=_run_report("narwhal"), faults=faults,
                         timeline=_timeline(["eligible"] * 3 + ["ejected"] * 4 + ["eligible"] * 3),
                         load_started_unix=1001.0)
    path = tmp_path / "report.html"
    path.write_text(render_html(report))
    dom = await render(path.as_uri(), budget_ms=500)
    assert len(dom.find(tag="svg")) == 4
    assert dom.find(tag="rect", **{"class": "state-segment", "data-engine": "d1", "data-state": "ejected"})
    assert len(dom.find(tag="line", **{"class": "fault-mark"})) == 4
    [figures] = dom.find(tag="pre", id="figures")
    assert "requests/s" in figures["text"]
    await render(path.as_uri(), budget_ms=500, screenshot=ARTIFACTS / "bench-report.png")
