"""A new user's first hour, as processes: two routers on one host keep their own handoff; the example pair runs."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest
import trio

from narwhal.tools.local_fleet import LocalProcess, render_config, start_mock_engine, start_router
from tests.e2e.waiting import wait_until

pytestmark = pytest.mark.e2e


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
async def started(nursery) -> AsyncIterator[Callable[[Awaitable[LocalProcess]], Awaitable[LocalProcess]]]:
    """``await started(start_router(...))``: the process is stopped when the test ends, pass or fail."""
    processes: list[LocalProcess] = []

    async def keep(starting: Awaitable[LocalProcess]) -> LocalProcess:
        process = await starting
        processes.append(process)
        return process

    yield keep
    with trio.CancelScope(shield=True):
        for process in reversed(processes):
            await process.stop(grace_s=10.0)


async def test_two_routers_on_one_host_keep_their_own_default_handoff(nursery, started, tmp_path: Path):
    prefill = await started(start_mock_engine(nursery, "prefill", engine_id="p1"))
    decode = await started(start_mock_engine(nursery, "decode", engine_id="d1"))
    engines = [("p1", prefill.url, "prefill"), ("d1", decode.url, "decode")]
    state = tmp_path / "state"
    routers = []
    for drained in ("p1", "d1"):
        # No [handoff] path: the default, with the state directory under the test's own XDG_STATE_HOME.
        config = tmp_path / f"{drained}.toml"
        config.write_text(render_config(engines, {"controller": {"monitor_interval_s": 0.1}}))
        router = await started(start_router(nursery, str(config), listen=f"127.0.0.1:{free_port()}",
                                            env={"XDG_STATE_HOME": str(state)}))
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


async def test_the_standby_example_pair_runs_as_it_is(nursery, started, tmp_path: Path):
    # The examples verbatim, but for their ports (the suite may not own 8000, 8010, 9001, 9101),
    # with a home directory of the test's own: the lease and handoff go under it.
    root = Path(__file__).resolve().parents[2]
    prefill = await started(start_mock_engine(nursery, "prefill", engine_id="p1"))
    decode = await started(start_mock_engine(nursery, "decode", engine_id="d1"))
    ports = {"8000": str(free_port()), "8010": str(free_port()), "9001": str(prefill.port),
             "9101": str(decode.port)}
    routers = {}
    for name in ("a", "b"):
        text = (root / "examples" / f"standby-{name}.toml").read_text()
        for old, new in ports.items():
            text = text.replace(f"127.0.0.1:{old}", f"127.0.0.1:{new}")
        config = tmp_path / f"standby-{name}.toml"
        config.write_text(text)
        listen = f"127.0.0.1:{ports['8000' if name == 'a' else '8010']}"
        routers[name] = await started(start_router(nursery, str(config), listen=listen,
                                                   env={"HOME": str(tmp_path)}))

    async with httpx.AsyncClient(timeout=10) as client:
        async def one_serves() -> dict[str, str] | None:
            # Until the standby's first lease read its /ready says "lease not read yet": wait past it.
            texts = {name: (await client.get(f"{r.url}/ready")).text.strip() for name, r in routers.items()}
            settled = "ready" in texts.values() and not any("not read yet" in text for text in texts.values())
            return texts if settled else None

        texts = await wait_until(one_serves, timeout_s=30, what="one router of the pair to take the lease")
        active = next(name for name, text in texts.items() if text == "ready")
        standby = "b" if active == "a" else "a"
        assert texts[standby] == f"standby: lease held by router-{active}"
        response = await client.post(f"{routers[active].url}/v1/completions",
                                     json={"model": "mock-model", "prompt": "hi", "max_tokens": 4})
        assert response.status_code == 200, response.text
    state = tmp_path / ".local" / "state" / "narwhal" / "standby"
    assert (state / "lease.json").exists()
    for router in routers.values():
        assert router.events("router_started")[0]["handoff"] == str(state / "lease.handoff.json")
