"""Client keys: the keys file (each key's sha256, never the key) and the lookup of an ``Authorization`` header.

The file is TOML, one ``[[keys]]`` table per tenant::

    [[keys]]
    name = "team-a"              # the tenant, in logs and metrics
    sha256 = "9f86d08..."        # hex of the key's UTF-8 bytes
    models = ["llama-3-8b"]      # optional: the models it may use (default every model)
    priority = "high"            # optional: "high", "normal" (default) or "low"
    requests_per_minute = 600    # optional limits, each > 0
    tokens_per_minute = 200000
    max_concurrent = 16

``read_keys_file`` turns every problem into one ``ConfigError`` naming the file, the key and the problem
(``keys.toml: keys[2].sha256: must be 64 hex digits``), as the config's are.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib
import re
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

from narwhal.files import FileRefused, read_regular_file

__all__ = ["KEY_PREFIX", "MAX_KEY_BYTES", "MAX_KEYS_FILE_BYTES", "PRIORITIES", "KeyEntry", "KeyStore", "KeysFile",
           "Priority", "hash_key", "new_key", "parse_keys_file", "read_keys_file"]

Priority = Literal["high", "normal", "low"]
PRIORITIES: tuple[Priority, ...] = ("high", "normal", "low")  # order of service

KEY_PREFIX = "nwk-"
# Longer keys are refused before hashing: a 10 KB header costs no sha256 of 10 KB.
MAX_KEY_BYTES = 512
MAX_KEYS_FILE_BYTES = 4 << 20
# Optional whitespace around a header value's parts (RFC 9110): space and tab, as byte values.
_OWS = (0x20, 0x09)

# A tenant name is a metric label value and a log field: short, no quoting needed anywhere.
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_SHA256 = re.compile(r"[0-9A-Fa-f]{64}")
_LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")


def _fast_sha256() -> Callable[[bytes], Any]:
    """CPython's own SHA-256 where it has one (``_sha2`` from 3.12, ``_sha256`` before), else hashlib's.

    Every request with keys on hashes its key: for a 50-byte key OpenSSL 3's sha256 (hashlib's) takes about
    1 us, most of it fetching the algorithm for each new hash object; CPython's own takes 0.3 us. Same digest.
    """
    for module in ("_sha2", "_sha256"):
        try:
            return importlib.import_module(module).sha256
        except (ImportError, AttributeError):
            continue
    return hashlib.sha256


_sha256 = _fast_sha256()


class KeyEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One client key: its tenant, the sha256 of the key, what it may use and how much."""

    name: str
    sha256: str
    models: list[str] | None = None
    priority: Priority = "normal"
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        # "field: problem": the config's _explain makes the field part of the key (keys[2].sha256: ...).
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"name: must be 1 to 64 letters, digits, '.', '_' or '-', got {self.name!r}")
        if not _SHA256.fullmatch(self.sha256):
            raise ValueError("sha256: must be 64 hex digits (the sha256 of the key, not the key)")
        # Frozen, but normalised once here so every lookup compares lowercase hex.
        msgspec.structs.force_setattr(self, "sha256", self.sha256.lower())
        if self.models is not None:
            if not self.models:
                raise ValueError("models: must not be empty (leave it out to allow every model)")
            if not all(self.models):
                raise ValueError("models: a model name must not be empty")
        for limit in _LIMITS:
            value = getattr(self, limit)
            if value is not None and value <= 0:
                raise ValueError(f"{limit}: must be > 0, got {value}")


class KeysFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The keys file: a list of ``[[keys]]`` tables, names and digests unique."""

    keys: list[KeyEntry] = []

    def __post_init__(self) -> None:
        for field in ("name", "sha256"):
            first: dict[str, int] = {}
            for index, entry in enumerate(self.keys):
                value = getattr(entry, field)
                if value in first:
                    problem = (f"{value!r} is also keys[{first[value]}]'s name" if field == "name" else
                               f"the same as keys[{first[value]}]'s (one key cannot be two tenants)")
                    raise ValueError(f"keys[{index}].{field}: {problem}")
                first[value] = index


def hash_key(key: str) -> str:
    """The sha256 hex of ``key``'s UTF-8 bytes: what the keys file stores."""
    return _sha256(key.encode()).hexdigest()


def new_key() -> str:
    """A new client key: ``nwk-`` and 43 URL-safe characters (256 random bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def parse_keys_file(data: bytes | str, source: str = "<keys file>") -> KeysFile:
    """Decode a keys file's TOML, raising ``ConfigError`` naming ``source``, the key and the problem."""
    # Imported here: narwhal.config may import this module (the [auth] section) without a cycle at import time.
    from narwhal.config import ConfigError, _explain

    try:
        return msgspec.toml.decode(data, type=KeysFile)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {_explain(exc, data, KeysFile)}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None


def read_keys_file(path: Path) -> KeysFile:
    """Read and check the keys file at ``path`` (a regular file of at most 4 MiB). Blocking file I/O."""
    from narwhal.config import ConfigError

    try:
        data = read_regular_file(path, MAX_KEYS_FILE_BYTES)
    except (OSError, FileRefused) as exc:
        raise ConfigError(f"{path}: cannot read keys file: {getattr(exc, 'strerror', None) or exc}") from None
    return parse_keys_file(data, source=str(path))


class KeyStore:
    """The keys by digest: an ``Authorization`` header's tenant in one sha256 and one dict lookup."""

    def __init__(self, keys: Sequence[KeyEntry]) -> None:
        self._by_digest = {entry.sha256: entry for entry in keys}

    def lookup(self, authorization: bytes | None) -> KeyEntry | None:
        """The entry of ``Bearer KEY`` (scheme in any case); None for a missing, malformed or unknown key."""
        if authorization is None:
            return None
        size = len(authorization)
        # What every OpenAI client sends, "Bearer KEY" without spaces around the key, tested without a method
        # call (this runs for every request with keys on); anything else takes the general path.
        if (size <= MAX_KEY_BYTES + 7 and authorization[:7] == b"Bearer " and authorization[-1] not in _OWS
                and authorization[7] not in _OWS):
            key = authorization[7:]
        else:
            found = _bearer_key(authorization, size)
            if found is None:
                return None
            key = found
        digest = _sha256(key).hexdigest()
        entry = self._by_digest.get(digest)
        # The dict found it by digest; the comparison that decides is constant time.
        if entry is None or not hmac.compare_digest(digest, entry.sha256):
            return None
        return entry

    def __len__(self) -> int:
        return len(self._by_digest)


def _bearer_key(authorization: bytes, size: int) -> bytes | None:
    """The key of a ``Bearer`` header in any case and spacing; None when malformed or longer than we hash."""
    # Bounded before any work: the scheme, spaces and the longest key we hash.
    if size > MAX_KEY_BYTES + 64:
        return None
    scheme, _, key = authorization.strip(b" \t").partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    key = key.lstrip(b" \t")
    if not key or len(key) > MAX_KEY_BYTES:
        return None
    return key
