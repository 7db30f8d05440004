"""The one place a request target becomes a path: for routing, the admin check and the ASGI scope.

RFC 9112 section 3.2: a server must accept the absolute form
(``POST http://host/admin/...``) as well as the origin form (``/admin/...``).
Both are reduced here to the origin form before anything routes on the path,
so a check on the path (``[admin] listen`` keeps ``/admin/`` off the traffic
port) sees what the app will route on. Other forms are refused: the
authority form belongs to CONNECT (refused anyway), a fragment is never part
of a request target, and ``*`` (OPTIONS) is kept as it is and routes nowhere.
"""

from __future__ import annotations

import urllib.parse

from narwhal.errors import NarwhalError

__all__ = ["InvalidTarget", "asgi_path", "split_target"]

_SCHEMES = (b"http", b"https")


class InvalidTarget(NarwhalError, ValueError):
    """A request target in neither origin nor absolute form (answered 400 ``invalid_request_target``)."""


def split_target(target: bytes) -> tuple[bytes, bytes, bytes]:
    """``(origin_target, raw_path, query)`` of a request target; the absolute form is reduced to its path.

    ``raw_path`` stays percent-encoded, as sent. Raises ``InvalidTarget`` for any other form.
    """
    if target[:1] != b"/":
        target = _origin_of(target)
    if b"#" in target:
        raise InvalidTarget("a request target has no fragment ('#')")
    raw_path, _, query = target.partition(b"?")
    return target, raw_path, query


def _origin_of(target: bytes) -> bytes:
    if target == b"*":
        return target
    scheme, sep, rest = target.partition(b"://")
    if not sep or scheme.lower() not in _SCHEMES:
        raise InvalidTarget("the request target must be a path (/...) or an absolute http(s) URL")
    end = len(rest)
    for mark in (b"/", b"?"):
        at = rest.find(mark)
        if at != -1:
            end = min(end, at)
    authority, rest = rest[:end], rest[end:]
    if not authority or b"@" in authority:
        # RFC 9110 section 4.2.4: http(s) URIs carry no userinfo; a host is required.
        raise InvalidTarget("an absolute request target needs a host and no user information")
    return rest if rest[:1] == b"/" else b"/" + rest


def asgi_path(raw_path: bytes) -> str:
    """The path as the ASGI app routes on it: percent-decoded, UTF-8 (invalid bytes replaced)."""
    return urllib.parse.unquote_to_bytes(raw_path).decode("utf-8", "replace") if b"%" in raw_path \
        else raw_path.decode("utf-8", "replace")
