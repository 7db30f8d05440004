"""Fast readmission in front of real vLLM: a killed and restarted decode engine is back in placement soon after
its first ``/health`` 200.

The readmission tick (``recovery.probe_interval_s``) is set to a minute, so only the immediate start (the recheck
of out engines seeing the restarted engine's health, then the readmission chain: health, the plugin's attestation
and identity, final health) can bring it back within the bound. Each restart is measured twice: from outside
(this test polls the engine's ``/health`` and Narwhal's ``/admin/engines/{name}`` every 10 ms) and by the router
itself (the ``health_to_eligible_s`` of its ``engine_readmitted`` line and the
``narwhal_readmission_health_to_eligible_seconds`` histogram). The figures are printed (run with ``-s``) and kept
in docs/benchmarks.md; the bound asserted is the issue's target, 1 s.
"""

from __future__ import annotations

import os
import signal

import pytest
import trio

from tests.e2e.waiting import watch_restart
from tests.real_vllm.conftest import Narwhal, metric

pytestmark = pytest.mark.real_vllm

POLL_S = 0.01
RESTARTS = int(os.environ.get("NARWHAL_REAL_VLLM_RESTARTS", "3"))
# The issue's target, asserted: measured here at 0.01-0.07 s (docs/benchmarks.md, "Back in placement after a
# restart"), far inside it even with three vLLM engines and other work on 2 cores; the readmission tick alone (a
# minute here) could never meet it.
BOUND_S = 1.0
SECTIONS = {"recovery": {"probe_interval_s": 60.0}}


async def restart_and_measure(narwhal: Narwhal, name: str) -> tuple[float, float]:
    """Kill ``name``, wait for its ejection, restart it; (its restart's seconds to /health 200, health to eligible)."""
    engine = narwhal.fleet[name]
    engine.signal_group(signal.SIGKILL)
    await narwhal.wait_engine(name, lambda e: e["ejected"] and not e["eligible"], what="ejected after SIGKILL",
                              timeout_s=60)

    async def eligible() -> bool:
        return (await narwhal.engine(name))["eligible"]

    started = trio.current_time()
    # Blocking (spawn, /health, a warm-up P/D request) in a thread: the watchers run meanwhile.
    _, health_at, eligible_at = await watch_restart(
        lambda: trio.to_thread.run_sync(narwhal.fleet.restart, name), f"{engine.url}/health", eligible,
        poll_s=POLL_S, timeout_s=600.0)
    return health_at - started, eligible_at - health_at


async def test_a_restarted_decode_engine_is_back_in_placement_soon_after_its_health_returns(start_narwhal) -> None:
    narwhal: Narwhal = await start_narwhal(**SECTIONS)
    name = narwhal.fleet.of_role("decode")[0].name
    outside: list[float] = []
    for n in range(1, RESTARTS + 1):
        to_health, waited = await restart_and_measure(narwhal, name)
        events = await narwhal.process.wait_event("engine_readmitted", timeout_s=10, engine=name)
        assert len(events) == n, events
        router_s = events[-1]["health_to_eligible_s"]
        print(f"\nREAL-VLLM readmission {n}/{RESTARTS}: {name} /health 200 {to_health:.1f} s after restart; "
              f"eligible {waited:.3f} s after it (outside); router's health_to_eligible_s {router_s}", flush=True)
        outside.append(waited)
        assert 0 <= router_s < BOUND_S, f"router: eligible {router_s} s after the health it saw"
        assert waited < BOUND_S, f"outside: eligible {waited:.3f} s after its first /health 200"
        # Readmitted by the chain itself, not by an operator.
        last = (await narwhal.engine(name))["last_readmission"]
        assert (last["outcome"], last["operator"]) == ("readmitted", False), last
    # The histogram holds every automatic readmission, per engine.
    histogram = "narwhal_readmission_health_to_eligible_seconds"
    count = await metric(narwhal.client, narwhal.url, f"{histogram}_count", engine=name)
    total = await metric(narwhal.client, narwhal.url, f"{histogram}_sum", engine=name)
    print(f"REAL-VLLM readmission histogram: count {count:g}, mean {total / max(count, 1):.3f} s; outside "
          f"{min(outside):.3f}-{max(outside):.3f} s", flush=True)
    assert count == RESTARTS
    assert 0 <= total < BOUND_S * RESTARTS
