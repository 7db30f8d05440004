"""The router wires each config bound to the right part (no I/O: construction only)."""

import pytest
import trio

from narwhal.config import parse_config
from narwhal.errors import PoolSaturated, StartupError
from narwhal.pools.classify import pool_slot
from narwhal.router import Router, preflight

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


def test_data_pool_is_bounded_by_serving_max_connections_and_control_pool_by_control_connections():
    built = router()
    assert built.data_pool.statistics().max_connections == 7
    assert built.control_pool.statistics().control_connections == 3


@pytest.mark.parametrize(("policy", "queues"), [("saturate", False), ("bounded", True)])
async def test_only_bounded_serving_queues_for_a_data_connection(autojump_clock, policy, queues):
    pool = router(policy).data_pool
    limiter = trio.CapacityLimiter(1)
    await limiter.acquire()
    with trio.move_on_after(10):
        with pytest.raises(PoolSaturated):
            async with pool_slot(limiter, "data", wait=pool._wait):
                pass
    # The default policy reports saturation at once; bounded waits until its deadline.
    assert trio.current_time() == (pytest.approx(10 - 0.05) if queues else 0)



def test_the_handoff_defaults_to_the_state_directory_and_persistence_and_resume_use_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    built = router()
    expected = tmp_path / "state" / "narwhal" / "narwhal-handoff.json"
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
