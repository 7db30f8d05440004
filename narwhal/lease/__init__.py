"""Lease ownership for an active/standby pair: pure rules, two backends, the service.

``rules`` holds the roles and the fencing deadline with no I/O; ``file_backend``
and ``etcd_backend`` are the shared stores; ``service`` runs the loop in the
router, composed of one part per job (``term``: acquire and renew; ``follower``
and ``watcher``: follow the holder; ``fence``; ``handover``) over a shared
``context``. ``build_backend`` picks the backend the config names.
"""

from __future__ import annotations

from pathlib import Path

from narwhal.config import Config, resolve_config_path
from narwhal.lease.backend import LeaseBackend, LeaseBackendError
from narwhal.lease.etcd_backend import EtcdLeaseBackend
from narwhal.lease.file_backend import FileLeaseBackend
from narwhal.lease.rules import LeaseHolding, LeaseRecord, Role, TakeoverCounter, TakeoverRequest, standby_reason

__all__ = [
    "EtcdLeaseBackend",
    "FileLeaseBackend",
    "LeaseBackend",
    "LeaseBackendError",
    "LeaseHolding",
    "LeaseRecord",
    "Role",
    "TakeoverCounter",
    "TakeoverRequest",
    "build_backend",
    "standby_reason",
]


def build_backend(config: Config, handoff_path: Path, config_dir: Path | None = None) -> LeaseBackend | None:
    """The backend ``[lease] backend`` names, or None for "none"; a relative path is the config's."""
    lease = config.lease
    if lease.backend == "file":
        assert lease.path is not None  # the config requires it
        return FileLeaseBackend(path=resolve_config_path(lease.path, config_dir), handoff_path=handoff_path,
                                ttl_s=lease.ttl_s, lock_timeout_s=min(1.0, lease.renew_interval_s / 2))
    if lease.backend == "etcd":
        return EtcdLeaseBackend(endpoints=lease.endpoints, key=lease.key, ttl_s=lease.ttl_s,
                                timeout_s=min(lease.renew_interval_s, 2.0) / max(1, len(lease.endpoints)))
    return None
