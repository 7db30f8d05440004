"""A new user's first hour, as processes: two routers on one host keep their own handoff."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import httpx
import pytest

from narwhal.tools.local_fleet import render_config, start_mock_engine, start_router
from tests.e2e.waiting import wait_until

pytestmark = pytest.mark.e2e


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_two_routers_on_one_host_keep_their_own_default_handoff(nursery, tmp_path: Path):
    prefill = await start_mock_engine(nursery, "prefill", engine_id="p1")
    decode = await start_mock_engine(nursery, "decode", engine_id="d1")
    engines = [("p1", prefill.url, "prefill"), ("d1", decode.url, "decode")]
    state = tmp_path / "state"
    routers = []
    for drained in ("p1", "d1"):
        # No [handoff] path: the default, with the state directory under the test's own XDG_STATE_HOME.
        config = tmp_path / f"{drained}.toml"
        config.write_text(render_config(engines, {"controller": {"monitor_interval_s": 0.1}}))
        router = await start_router(nursery, str(config), listen=f"127.0.0.1:{free_port()}",
                                    env={"XDG_STATE_HOME": str(state)})
        routers.append((drained, router))
    paths = [Path(router.events("router_started")[0]["handoff"]) for _, router in routers]
    assert paths == [state / "narwhal" / f"narwhal-handoff-127.0.0.1-{router.port}.json" for _, router in routers]
    async with httpx.AsyncClient(timeout=10) as client:
        for drained, router in routers:
            response = await client.post(f"{router.url}/admin/engines/{drained}/drain")
            assert response.status_code == 200, response.text

    def holds(path: Path) -> dict[str, list[str]]:
        try:
            document = json.loads(path.read_bytes())
        except (OSError, ValueError):
            return {}
        return {e["name"]: [h["kind"] for h in e["holds"]] for e in document["engines"]}

    async def each_file_holds_its_own_drain() -> bool:
        return all(holds(path).get(drained) == ["operator_drain"] and
                   holds(path).get("d1" if drained == "p1" else "p1") == []
                   for (drained, _), path in zip(routers, paths, strict=True))

    await wait_until(each_file_holds_its_own_drain, what="each router's handoff to hold its own drain")
    for _, router in routers:
        await router.stop()
    await prefill.stop()
    await decode.stop()
