"""The engine contract's attestation signature and fleet-key loading, in one place.

The router's readmission, the mock engine, ``engine-check`` and the vLLM plugin
(``narwhal.engine_plugin``) all sign or verify with these functions. Standard
library only: the plugin imports this module inside vLLM's process.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping

from narwhal.errors import NarwhalError

__all__ = ["IDENTITY_FIELD_CHARS", "KEY_ENV", "KEY_FILE_ENV", "FleetKeyError", "key_from_environment",
           "read_key_file", "sign", "verify"]

# Where an engine (or engine-check) finds the fleet key: a file, or the key itself.
KEY_FILE_ENV = "NARWHAL_FLEET_KEY_FILE"
KEY_ENV = "NARWHAL_FLEET_KEY"

# The longest identity fields a router accepts (longer ones are refused, not cut: they are signed).
IDENTITY_FIELD_CHARS = {"engine_id": 256, "model": 1024, "generation": 256}

# A key file is a short secret; anything larger is a wrong path, not a key.
_MAX_KEY_FILE_BYTES = 64 * 1024


class FleetKeyError(NarwhalError):
    """The fleet key cannot be had; the message says why, fit to show an operator."""


def sign(key: bytes, engine_id: str, nonce: str, generation: str) -> str:
    """Hex HMAC-SHA256 over ``engine_id|nonce|generation`` with the fleet key."""
    return hmac.new(key, f"{engine_id}|{nonce}|{generation}".encode(), hashlib.sha256).hexdigest()


def verify(key: bytes, engine_id: str, nonce: str, generation: str, signature: str) -> bool:
    """Whether ``signature`` is ``sign(key, engine_id, nonce, generation)``, compared in constant time."""
    return hmac.compare_digest(signature.encode(), sign(key, engine_id, nonce, generation).encode())


def read_key_file(path: str) -> bytes:
    """The key in ``path``, surrounding whitespace stripped; FleetKeyError when unreadable, empty or too large."""
    try:
        with open(path, "rb") as file:
            raw = file.read(_MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise FleetKeyError(f"cannot read fleet key file {path!r}: {exc.strerror or exc}") from None
    if len(raw) > _MAX_KEY_FILE_BYTES:
        raise FleetKeyError(f"fleet key file {path!r} is larger than {_MAX_KEY_FILE_BYTES} bytes")
    key = raw.strip()
    if not key:
        raise FleetKeyError(f"fleet key file {path!r} is empty")
    return key


def key_from_environment(environ: Mapping[str, str] | None = None) -> bytes:
    """The fleet key from ``$NARWHAL_FLEET_KEY_FILE`` or ``$NARWHAL_FLEET_KEY``; FleetKeyError saying why not.

    Never an empty key: a signature over an empty key would prove nothing.
    """
    env = os.environ if environ is None else environ
    path = env.get(KEY_FILE_ENV)
    value = env.get(KEY_ENV)
    if path and value:
        raise FleetKeyError(f"both {KEY_FILE_ENV} and {KEY_ENV} are set: set one of them")
    if path:
        return read_key_file(path)
    if value is not None and value.strip():
        return value.strip().encode()
    if value is not None:
        raise FleetKeyError(f"{KEY_ENV} is empty")
    raise FleetKeyError(f"no fleet key: set {KEY_FILE_ENV} (a file holding the key) or {KEY_ENV}")
