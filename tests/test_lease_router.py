"""The lease inside a running router (in-process, real sockets on 127.0.0.1): shutdown and readiness."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import trio

from narwhal.config import LeaseConfig
from narwhal.fleet.model import HoldKind
from narwhal.lease.file_backend import FileLeaseBackend
from narwhal.lease.rules import LeaseRecord, Role
from narwhal.router import Router
from tests.test_admin_api import fleet_config, start_mock_fleet


def lease_router(mocks, tmp_path: Path) -> Router:
    config = fleet_config(mocks, tmp_path)
    config = msgspec.structs.replace(
        config,
        serving=msgspec.structs.replace(config.serving, listen="127.0.0.1:0"),
        lease=LeaseConfig(backend="file", path=str(tmp_path / "lease.json"), router_id="ra", ttl_s=10.0,
                          renew_interval_s=1.0, fence_margin_s=2.0))
    return Router(config)


async def test_a_shutdown_release_lands_before_the_router_returns(nursery, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    mocks = await start_mock_fleet(nursery)
    router = lease_router(mocks, tmp_path)
    real_release = FileLeaseBackend.release

    async def slow_release(self: FileLeaseBackend, record: LeaseRecord) -> bool:
        await trio.sleep(0.3)  # a slow disk or etcd: slower than an idle router's own shutdown
        return await real_release(self, record)

    monkeypatch.setattr(FileLeaseBackend, "release", slow_release)
    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as running:
                await running.start(router.run)
                assert router.lease is not None
                while router.lease.role is not Role.ACTIVE:
                    await trio.sleep(0.01)
                router.shutdown()  # what SIGTERM does
        # The router returned (the process would exit now): the release has landed, no temporary left.
        record = msgspec.json.decode((tmp_path / "lease.json").read_bytes(), type=LeaseRecord)
        assert (record.holder, record.epoch) == ("", 1)
        assert not [path.name for path in tmp_path.iterdir() if path.name.endswith(".tmp")]
    finally:
        mocks.stop_all()


async def test_own_readiness_weighs_capacity_so_a_holder_without_capacity_yields(nursery, tmp_path: Path) -> None:
    mocks = await start_mock_fleet(nursery)
    try:
        router = lease_router(mocks, tmp_path)
        assert router.own_readiness() is None
        now = trio.current_time()
        for view in router.fleet.views(now):
            if view.role == "decode":
                router.fleet.add_hold(view.name, HoldKind.OPERATOR_DRAIN, "operator drain", now)
        # No decode capacity left: a takeover request must find this holder unfit (issue 26, break 3).
        assert router.own_readiness() == router.supervisor.capacity_problem() is not None
    finally:
        mocks.stop_all()
