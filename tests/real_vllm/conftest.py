"""Fixtures of the real-vLLM tier: one session-wide fleet of stock vLLM engines, a Narwhal router per test.

Run the tier with ``python3 tests/real_vllm/run.py`` (it builds or finds the cached venv and model, takes the
machine's real-vLLM lock and runs pytest in that venv).  Fixtures, for tests that build on this tier:

``vllm_fleet``      the session's ``VllmFleet`` (1 prefill ``p1`` + ``NARWHAL_REAL_VLLM_DECODE`` decode engines
                    ``d1``, ``d2``...), started once; engines are process groups (``fleet["d1"].signal_group``).
``fleet``           the same fleet, with every dead, frozen or unhealthy engine restarted first: use this one.
``start_narwhal``   ``await start_narwhal(**sections)``: a router (``python -m narwhal serve``) in front of the
                    fleet (``engines=["p1", "d1"]``: of those only; ``more_engines``: other engines as (name, url,
                    role, model); ``models``: ``[[fleet.models]]`` entries), every engine eligible; returns a
                    ``Narwhal`` with ``url``, ``client`` (httpx), ``openai`` (the official client), ``call(fn,
                    *args)`` (runs a blocking call, such as an ``openai`` one, in a thread), ``engine(name)`` and
                    ``wait_engine(name, predicate, what=)``.

Helpers: ``metric(fleet_engine_url, name, **labels)`` reads one sample of an engine's /metrics;
``pd_by_hand(...)`` runs one request through a prefill/decode pair with no router (the reference).

The official client runs synchronously in worker threads: its async streams are async generators that trio's
finalizer reports as unclosed when a stream ends before its generator does.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import trio

from narwhal.tools.local_fleet import LocalProcess, start_router
from tests.real_vllm.fleet import DEFAULT_START_TIMEOUT_S, REPO, TIER_NOTES, VllmFleet, running_fleet, tier_environment

ADMIN_TOKEN = "real-vllm-admin"
AUTH = {"authorization": f"Bearer {ADMIN_TOKEN}"}
HERE = Path(__file__).resolve().parent
T = TypeVar("T")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    # Not asked for (the default run has -m "not real_vllm"): not even imported, so the main suite needs
    # neither vLLM nor the tier's test dependencies.
    expr = " ".join((config.option.markexpr or "").split())
    if "real_vllm" not in expr or "not real_vllm" in expr:
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Every test under this directory belongs to the tier, marked or not: the default run deselects it.
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.real_vllm)


@pytest.fixture(scope="session")
def vllm_environment() -> tuple[str, str]:
    """The tier venv's python and the tiny model's directory, or a skip that says how to get them."""
    found = tier_environment()
    if found is None:
        pytest.skip("the real-vLLM tier runs in its own venv: python3 tests/real_vllm/run.py")
    return found


_START_TIMES: list[tuple[list[str], float]] = []


@pytest.fixture(scope="session")
def vllm_fleet(vllm_environment: tuple[str, str], tmp_path_factory: pytest.TempPathFactory):
    """The session's engines: 1 prefill + $NARWHAL_REAL_VLLM_DECODE (default 2) decode, stopped at the end."""
    python, model = vllm_environment
    decode = int(os.environ.get("NARWHAL_REAL_VLLM_DECODE", "2"))
    workdir = tmp_path_factory.mktemp("vllm")
    with running_fleet(python, model, workdir, prefill=1, decode=decode) as fleet:
        try:
            yield fleet
        finally:
            _START_TIMES.extend(fleet.start_times)


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    # What the engines cost in start time, for the tier's README and CI budget.
    for names, seconds in _START_TIMES:
        terminalreporter.write_line(f"real-vllm: started {'+'.join(names)} (ready, NIXL warmed up) in {seconds:.1f} s")
    for note in TIER_NOTES:
        terminalreporter.write_line(f"real-vllm: {note}")


@pytest.fixture
def fleet(vllm_fleet: VllmFleet) -> VllmFleet:
    """The session's fleet with every engine healthy (restarted if an earlier test killed or froze it)."""
    vllm_fleet.ensure_healthy(DEFAULT_START_TIMEOUT_S)
    return vllm_fleet


class Narwhal:
    """A router in front of the real fleet, with clients for it."""

    def __init__(self, process: LocalProcess, fleet: VllmFleet, client: httpx.AsyncClient,
                 config_path: Path) -> None:
        import openai

        self.process = process
        self.fleet = fleet
        self.client = client
        self.config_path = config_path
        self.openai = openai.OpenAI(base_url=f"{process.url}/v1", api_key="unused", max_retries=0, timeout=120.0)

    @property
    def url(self) -> str:
        return self.process.url

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking call (the openai client's) in a worker thread."""
        return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)

    async def engine(self, name: str) -> dict[str, Any]:
        """The router's view of one engine (``GET /admin/engines/{name}``)."""
        response = await self.client.get(f"{self.url}/admin/engines/{name}", headers=AUTH)
        assert response.status_code == 200, response.text
        return response.json()["engine"]

    async def wait_engine(self, name: str, predicate: Callable[[dict[str, Any]], bool], *, what: str,
                          timeout_s: float = 120.0) -> dict[str, Any]:
        """Poll the engine's state until ``predicate`` holds; fail after ``timeout_s``."""
        with trio.move_on_after(timeout_s):
            while True:
                state = await self.engine(name)
                if predicate(state):
                    return state
                await trio.sleep(0.1)
        raise AssertionError(f"timed out after {timeout_s:g} s waiting for {name}: {what}; last state {state}")

    async def wait_listed_and_eligible(self, name: str, *, timeout_s: float) -> None:
        """Poll until the router lists ``name`` and places on it (a discovered engine may be unlisted meanwhile)."""
        with trio.fail_after(timeout_s):
            while True:
                response = await self.client.get(f"{self.url}/admin/engines/{name}", headers=AUTH)
                if response.status_code == 200 and response.json()["engine"]["eligible"]:
                    return
                await trio.sleep(0.2)

    async def wait_none_ejected(self, *, after: str, skip: Sequence[str] = (), timeout_s: float = 90.0) -> None:
        """Poll until no engine but ``skip`` is ejected; a tier note says which were (``after``: what came before).

        A restarted vLLM's first NIXL handshake can keep its peer's API server silent for seconds on 2 busy cores;
        the router then ejects the peer (liveness) and readmits it once it answers. Requests that follow wait.
        """
        noted = False
        with trio.fail_after(timeout_s):
            while True:
                response = await self.client.get(f"{self.url}/admin/engines", headers=AUTH)
                assert response.status_code == 200, response.text
                ejected = [e["name"] for e in response.json()["engines"] if e["ejected"] and e["name"] not in skip]
                if not ejected:
                    return
                if not noted:
                    TIER_NOTES.append(f"{after}: the router had ejected {', '.join(ejected)}; waited for readmission")
                    noted = True
                await trio.sleep(0.2)

    async def aclose(self) -> None:
        self.openai.close()
        await self.client.aclose()


# A handoff fsync on the machine's disk can wait tens of seconds behind the writes of vLLM engines starting
# (the filesystem's journal flushes them first); tmpfs has no such wait.
SHM = Path("/dev/shm")


@pytest.fixture
def handoff_dir(tmp_path: Path):
    """Where the routers of a test keep their handoffs: on tmpfs when the machine has one."""
    if not (SHM.is_dir() and os.access(SHM, os.W_OK)):
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(prefix="narwhal-real-handoff-", dir=SHM) as directory:
        yield Path(directory)


@pytest.fixture
async def start_narwhal(fleet: VllmFleet, nursery: trio.Nursery, tmp_path: Path, handoff_dir: Path):
    """``await start_narwhal(**sections)``: a router in front of ``fleet``, returned once every engine is eligible."""
    started: list[Narwhal] = []
    logs: list[Any] = []

    async def start(*, engines: Sequence[str] | None = None, more_engines: Sequence[tuple[str, str, str, str]] = (),
                    models: Sequence[dict[str, Any]] = (), **sections: dict[str, Any]) -> Narwhal:
        sections.setdefault("admin", {})["token"] = ADMIN_TOKEN
        config_path = tmp_path / f"narwhal-{len(started)}.toml"
        config_path.write_text(fleet.router_config(handoff_dir / f"handoff-{len(started)}.json", engines=engines,
                                                   more_engines=more_engines, models=models, **sections))
        env = {"PYTHONPATH": str(REPO)}
        # Its JSON log lines are kept in process.lines and, for whoever reads the run afterwards, in a file.
        log = (tmp_path / f"router-{len(started)}.log").open("w")
        logs.append(log)
        process = await start_router(nursery, str(config_path), env=env, timeout_s=60.0, echo=log)
        router = Narwhal(process, fleet, httpx.AsyncClient(timeout=120.0), config_path)
        started.append(router)
        for name in [*(fleet.engines if engines is None else engines), *(e[0] for e in more_engines)]:
            await router.wait_engine(name, lambda e: e["eligible"], what="eligible at start", timeout_s=60.0)
        return router

    yield start
    with trio.CancelScope(shield=True):
        for router in started:
            await router.aclose()
            await router.process.stop(grace_s=10.0)
        for log in logs:
            log.close()


async def metric(client: httpx.AsyncClient, url: str, name: str, **labels: str) -> float:
    """The sum of an engine's /metrics samples called ``name`` whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    response = await client.get(f"{url}/metrics")
    assert response.status_code == 200, response.text
    total = 0.0
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


async def pd_by_hand(client: httpx.AsyncClient, prefill_url: str, decode_url: str, route: str,
                     body: dict[str, Any]) -> dict[str, Any]:
    """One request through a prefill and a decode engine with no router: vLLM's own P/D flow, by hand."""
    from narwhal.wire import PREFILL_KV_REQUEST

    first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_KV_REQUEST}
    response = await client.post(f"{prefill_url}{route}", json=first)
    assert response.status_code == 200, response.text
    kv = response.json()["kv_transfer_params"]
    response = await client.post(f"{decode_url}{route}", json={**body, "kv_transfer_params": kv})
    assert response.status_code == 200, response.text
    return response.json()
