"""Python calls per health check through the control pool, against one mock engine (cProfile).

Usage: python bench/health_check_calls.py [CHECKS]   (default 500; run from the tree to measure)

Each check is what the health stage makes: a GET /health on a kept-alive
connection under the caller's deadline. Call counts do not move with the
machine's load; times do.
"""

from __future__ import annotations

import cProfile
import json
import pstats
import subprocess
import sys
import tempfile
from pathlib import Path

import trio

from narwhal.config import EngineConfig, EngineSpec
from narwhal.pools.control import ControlPool


async def main(checks: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="narwhal-health-calls-"))
    fleet_file = work / "fleet.json"
    engine = subprocess.Popen([sys.executable, "-m", "narwhal", "mock-engine", "--engines", "1",
                               "--prefill-engines", "1", "--engines-file", str(fleet_file)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with trio.fail_after(30):
            while not fleet_file.exists():
                await trio.sleep(0.1)
            while True:
                try:
                    url = json.loads(fleet_file.read_text())["engines"][0]["url"]
                    break
                except (ValueError, KeyError, IndexError):
                    await trio.sleep(0.1)  # written but not yet whole
        spec = EngineSpec(name="p1", url=url, role="prefill")
        pool = ControlPool(control_connections=8, engine_config=EngineConfig())
        await pool.get(spec, "/health")  # the connection opened, outside the count
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(checks):
            deadline = trio.current_time() + 5.0
            with trio.move_on_at(deadline):
                await pool.get(spec, "/health", timeout_s=5.0, caller_deadline=deadline)
        profile.disable()
        await pool.aclose()
    finally:
        engine.terminate()
        engine.wait()
    # The loop's own deadline and scope (2 clock reads, a scope) are counted too, as in the health stage.
    calls = pstats.Stats(profile).total_calls  # type: ignore[attr-defined]
    print(f"Python calls per health check: {calls / checks:.1f}")


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 500)
