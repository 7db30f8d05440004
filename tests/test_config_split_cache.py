"""An engine's URL is parsed once per URL, however many engines: urlsplit's own cache holds only 128."""

from __future__ import annotations

import urllib.parse

import pytest

import narwhal.config as config
from narwhal.config import EngineSpec


def test_fleet_of_hundreds_reads_host_port_and_tls_from_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "_SPLITS", {})
    specs = [EngineSpec(name=f"e{i}", url=f"{'https' if i % 2 else 'http'}://Host-{i}.example:{9000 + i}/",
                        role="decode") for i in range(300)]
    parsed: list[str] = []
    real = urllib.parse.urlsplit
    monkeypatch.setattr(urllib.parse, "urlsplit", lambda url, *a, **k: parsed.append(url) or real(url, *a, **k))
    for _ in range(3):
        for i, spec in enumerate(specs):
            assert (spec.host, spec.port, spec.tls) == (f"host-{i}.example", 9000 + i, bool(i % 2))
            assert spec.address == ("https" if i % 2 else "http", f"host-{i}.example", 9000 + i)
    assert len(parsed) == 300  # once per URL


def test_the_cache_starts_over_past_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "_SPLITS", {})
    monkeypatch.setattr(config, "_MAX_SPLITS", 4)
    specs = [EngineSpec(name=f"e{i}", url=f"http://h:{8000 + i}", role="prefill") for i in range(10)]
    assert [spec.port for spec in specs] == list(range(8000, 8010))
    assert len(config._SPLITS) <= 4
