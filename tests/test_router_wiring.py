"""The router wires each config bound to the right part (no I/O: construction only)."""

import ast
from pathlib import Path

import msgspec
import pytest
import trio

import narwhal.router
from narwhal.config import parse_config
from narwhal.errors import PoolSaturated, StartupError
from narwhal.pools.classify import pool_slot
from narwhal.router import Router, preflight
from narwhal.serving.data_plane import LocalDataPlane
from narwhal.workers.plane import WorkerDataPlane
from tests.test_admin_api import fleet_config, start_mock_fleet

CONFIG = """
[serving]
max_connections = 7
policy = "{policy}"
[engine]
control_connections = 3
[[engines]]
name = "p1"
url = "http://127.0.0.1:9001"
role = "prefill"
[[engines]]
name = "d1"
url = "http://127.0.0.1:9002"
role = "decode"
"""


def router(policy: str = "saturate") -> Router:
    return Router(parse_config(CONFIG.format(policy=policy)))


# A part's container changed in place from outside it (``self.fleet.listeners.append(...)``).
_MUTATORS = frozenset({"append", "extend", "insert", "update", "add", "setdefault", "__setitem__"})
# The one assignment into another object: the TLS reload swaps the running admin listener's
# context (read again from the files, as the data plane's server swaps its own), not wiring.
_TLS_SWAP = "self.admin_server.ssl_context"


def _own_field(target: ast.expr) -> bool:
    """``self.name``: a field of the router itself."""
    return isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"


def wiring_after_construction(source: str) -> list[str]:
    """Every place ``source`` sets a field of an object other than ``self``, or fills a part's container."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        while any(isinstance(target, (ast.Tuple, ast.List)) for target in targets):
            targets = [element for target in targets
                       for element in (target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target])]
        found += [ast.unparse(target) for target in targets
                  if isinstance(target, (ast.Attribute, ast.Subscript)) and not _own_field(target)]
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id == "setattr":
                found.append(ast.unparse(node))
            elif (isinstance(func, ast.Attribute) and func.attr in _MUTATORS
                  and isinstance(func.value, ast.Attribute) and not _own_field(func.value)):
                found.append(ast.unparse(func))
    return found


def test_the_composition_root_sets_no_field_of_a_part_it_built():
    # Every part gets its collaborators when it is built (a cycle is closed by a callable resolved when
    # called, or by an object built first and given to both sides, like the hub's Poke); a reload hands
    # each part the new config through its ``configure``. router.py sets only the router's own fields.
    source = Path(narwhal.router.__file__).read_text()
    assert wiring_after_construction(source) == [_TLS_SWAP]


def test_the_wiring_check_sees_a_field_set_on_a_part_and_a_part_s_list_filled():
    source = ("class Router:\n"
              "    def __init__(self, hub, view):\n"
              "        self.fleet = make()\n"
              "        self.fleet.on_change = hub.poke\n"
              "        view.on_engines, self.x = f, 1\n"
              "        self.fleet.listeners.append(g)\n"
              "        self.tables.append(h)\n"
              "        setattr(hub, 'admit_until', f)\n")
    assert sorted(wiring_after_construction(source)) == sorted([
        "self.fleet.on_change", "view.on_engines", "setattr(hub, 'admit_until', f)", "self.fleet.listeners.append"])


def test_data_pool_is_bounded_by_serving_max_connections_and_control_pool_by_control_connections():
    built = router()
    assert built.data_plane.data_pool.statistics().max_connections == 7
    assert built.control_pool.statistics().control_connections == 3


def test_the_stages_that_never_wait_are_plain_calls_and_the_others_tasks():
    # The monitor calls run_now in its pass's task; health, readmission and persistence wait (engines, the disk).
    stages = router().monitor.stages
    assert {stage.name for stage in stages if hasattr(stage, "run_now")} == {
        "controller", "drain", "rollover", "liveness", "telemetry"}


@pytest.mark.parametrize("inline", [True, False])
def test_relay_inline_decides_whether_trios_loop_runs_the_rounds_of_the_front_and_the_data_pool(inline):
    config = parse_config(CONFIG.format(policy="saturate"))
    config = msgspec.structs.replace(config, serving=msgspec.structs.replace(config.serving, relay_inline=inline))
    plane = Router(config).data_plane
    assert isinstance(plane, LocalDataPlane)
    hubs = [plane.data_pool._readiness, plane.server._context.readiness]
    assert [hub._early_wanted for hub in hubs] == [inline, inline]


@pytest.mark.parametrize(("policy", "queues"), [("saturate", False), ("bounded", True)])
async def test_only_bounded_serving_queues_for_a_data_connection(autojump_clock, policy, queues):
    pool = router(policy).data_plane.data_pool
    limiter = trio.CapacityLimiter(1)
    await limiter.acquire()
    with trio.move_on_after(10):
        with pytest.raises(PoolSaturated):
            async with pool_slot(limiter, "data", wait=pool._wait):
                pass
    # The default policy reports saturation at once; bounded waits until its deadline.
    assert trio.current_time() == (pytest.approx(10 - 0.05) if queues else 0)



@pytest.mark.parametrize(("workers", "plane", "capacity"), [(1, LocalDataPlane, 7), (2, WorkerDataPlane, 14)])
async def test_one_data_plane_in_this_process_or_in_workers_and_every_reader_counts_its_in_flight(
        workers, plane, capacity):
    built = Router(parse_config(CONFIG.format(policy="saturate").replace(
        "[serving]\n", f"[serving]\nworkers = {workers}\n")))
    assert isinstance(built.data_plane, plane)
    # Drains, readmission and the admin view read the plane's counts (the hub's sums with workers).
    assert built.in_flight is built.data_plane.in_flight
    assert built.readmitter.in_flight is built.stages.drain.in_flight is built.engine_view.in_flight is built.in_flight
    # The pool gauge sums every data pool: max_connections per process.
    assert f'narwhal_pool_connections{{pool="data",state="capacity"}} {capacity}' in built.metrics.render()
    assert ('narwhal_worker_up{worker="1"}' in built.metrics.render()) is (workers == 2)


def test_the_handoff_defaults_to_the_state_directory_and_persistence_and_resume_use_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    built = router()
    # Named after the serving address (default serving.listen): no two routers on a host share it.
    expected = tmp_path / "state" / "narwhal" / "narwhal-handoff-127.0.0.1-8000.json"
    assert built.handoff_path == expected
    assert built.persistence.path == str(expected)
    preflight(built.config, "127.0.0.1:0", built.handoff_path)  # creates the state directory
    assert expected.parent.is_dir()


def test_a_state_directory_that_cannot_be_created_is_a_startup_error_naming_it(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("XDG_STATE_HOME", str(blocker))
    built = router()
    with pytest.raises(StartupError, match=r"handoff \(default .*\): cannot create the state directory .*file/narwhal"):
        preflight(built.config, "127.0.0.1:0", built.handoff_path)


async def test_health_checks_and_suspect_verification_use_the_control_pool(nursery, tmp_path):
    # The spec: health checks and suspect verification use the control pool, so a
    # saturated data pool never starves them. The router's only data connection is
    # held by "traffic" here: every control-plane call must still reach the engines.
    mocks = await start_mock_fleet(nursery)
    config = fleet_config(mocks, tmp_path)
    config = msgspec.structs.replace(config, serving=msgspec.structs.replace(config.serving, max_connections=1))
    built = Router(config)
    traffic = object()
    data_pool = built.data_plane.data_pool
    await data_pool._limiter.acquire_on_behalf_of(traffic)
    try:
        assert data_pool.statistics().in_use == data_pool.statistics().max_connections == 1
        with trio.fail_after(30):
            async with trio.open_nursery() as running:
                await running.start(built.supervisor.run)
                # A health probe (the action for connection/timeout/overload evidence).
                assert await built.supervisor.health_probe("d1") is True
                # Suspect verification: an inference probe through the suspect and a peer.
                assert await built.supervisor.inference_probe("d1") == "success"
                # The monitor's health sweep.
                await built.stages.health.run(1)
                assert built.stages.health.sweep is not None
                assert built.stages.health.sweep.results == {"p1": True, "d1": True, "d2": True}
                # Readmission's checks (health, identity, attestation, models, health).
                assert (await built.readmitter.readmit("d1", operator=True)).readmitted
                running.cancel_scope.cancel()
        d1 = mocks.services["d1"].engine.stats
        assert d1.requests["/health"] >= 4 and d1.decode == 1
        assert mocks.services["p1"].engine.stats.prefill == 1
        # None of it took a data connection: ours is still the only one in use.
        assert built.data_plane.data_pool.statistics().in_use == 1
    finally:
        built.data_plane.data_pool._limiter.release_on_behalf_of(traffic)
        await built.control_pool.aclose()
        await built.data_plane.data_pool.aclose()
        mocks.stop_all()
