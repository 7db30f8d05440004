"""End-to-end fixtures: the real router and mock engines as processes on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from narwhal.tools.local_fleet import LocalProcess, render_config, start_mock_engine, start_router


class LocalFleet:
    """A running router with its mock engines, and an HTTP client for both."""

    def __init__(self, router: LocalProcess, engines: dict[str, LocalProcess], config_path: Path,
                 client: httpx.AsyncClient) -> None:
        self.router = router
        self.engines = engines
        self.config_path = config_path
        self.client = client

    @property
    def url(self) -> str:
        return self.router.url

    async def engine_stats(self, name: str) -> dict[str, Any]:
        response = await self.client.get(f"{self.engines[name].url}/mock/stats")
        return response.json()

    async def set_fault(self, name: str, mode: str, **params: Any) -> None:
        response = await self.client.post(f"{self.engines[name].url}/mock/faults", json={"mode": mode, **params})
        assert response.status_code == 200, response.text

    async def clear_faults(self, name: str) -> None:
        await self.client.delete(f"{self.engines[name].url}/mock/faults")


@pytest.fixture
async def start_fleet(nursery, tmp_path):
    """Start mock engines and a router: ``await start_fleet(prefill=1, decode=2, ...)``."""
    processes: list[LocalProcess] = []
    clients: list[httpx.AsyncClient] = []

    async def start(*, prefill: int = 1, decode: int = 1, mock_args: Sequence[str] = (),
                    sections: dict[str, dict[str, Any]] | None = None,
                    router_args: Sequence[str] = ()) -> LocalFleet:
        engines: dict[str, LocalProcess] = {}
        for role, count in (("prefill", prefill), ("decode", decode)):
            for i in range(1, count + 1):
                name = f"{role[0]}{i}"
                engines[name] = await start_mock_engine(nursery, role, engine_id=name, args=mock_args)
                processes.append(engines[name])
        merged: dict[str, dict[str, Any]] = {
            "serving": {"shutdown_grace_s": 5.0},
            "engine": {"connect_timeout_s": 1.0, "request_timeout_s": 10.0},
            "handoff": {"path": str(tmp_path / "handoff.json")},
            "fleet": {"attestation_key": "narwhal-dev-key"},
        }
        for section, values in (sections or {}).items():
            merged.setdefault(section, {}).update(values)
        config_path = tmp_path / "narwhal.toml"
        config_path.write_text(render_config(
            [(name, p.url, "prefill" if name.startswith("p") else "decode") for name, p in engines.items()],
            merged))
        router = await start_router(nursery, str(config_path), args=router_args)
        processes.append(router)
        client = httpx.AsyncClient(timeout=30.0)
        clients.append(client)
        return LocalFleet(router, engines, config_path, client)

    yield start
    with trio.CancelScope(shield=True):
        for client in clients:
            await client.aclose()
        for process in reversed(processes):
            await process.stop(grace_s=10.0)
