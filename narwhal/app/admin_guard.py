"""Who may call an admin API that has no token: the checks against cross-site requests and DNS rebinding.

Without ``[admin] token`` the admin API trusts whoever reaches it, and a web
page the operator opens reaches it too: a cross-site form POST needs no
preflight, and a page on a name rebound to 127.0.0.1 can read the answers. A
browser marks both: an ``Origin`` that is not the router's own (``null``
included), ``Sec-Fetch-Site: cross-site``/``same-site``, or a ``Host`` that
is a name the operator never gave. ``curl`` and ``narwhal admin`` send no
``Origin`` and a loopback or IP ``Host``, so they pass. With a token set the
token is the protection and these checks do not run (the app's choice).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Collection

__all__ = ["admin_refusal", "is_admin_api_path"]

_DEFAULT_PORTS = {"http": 80, "https": 443}
_REFUSED_FETCH_SITES = ("cross-site", "same-site")
# A DNS name or an IPv4 address as a Host header carries it (lower-cased, no trailing dot).
_HOST_NAME = re.compile(r"[a-z0-9_](?:[a-z0-9_.-]*[a-z0-9_])?")
_PORT = re.compile(r"[0-9]{1,5}")


def is_admin_api_path(path: str) -> bool:
    """``/admin`` or a path under it, leading slashes collapsed (as ``narwhal.serving.front`` reads it)."""
    path = "/" + path.lstrip("/")
    return path == "/admin" or path.startswith("/admin/")


def _split_host(value: str) -> tuple[str, int | None] | None:
    """``host[:port]`` as (lower-case host without a trailing dot, port); None when malformed.

    A bracketed IPv6 literal keeps its brackets off: ``[::1]:8000`` is ("::1", 8000).
    """
    value = value.strip().lower()
    if value.startswith("["):
        host, sep, rest = value[1:].partition("]")
        if not sep:
            return None
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return None
        port_text = rest[1:] if rest.startswith(":") else None
        if rest and port_text is None:
            return None
    else:
        host, sep, port_text_or_empty = value.partition(":")
        port_text = port_text_or_empty if sep else None
        host = host.removesuffix(".")
        if not _HOST_NAME.fullmatch(host):
            return None
    if port_text is None:
        return host, None
    if not _PORT.fullmatch(port_text) or int(port_text) > 65535:
        return None
    return host, int(port_text)


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _host_refusal(host: str, allowed_hosts: Collection[str]) -> str | None:
    split = _split_host(host)
    if split is None:
        return f"Host {host[:200]!r} is not a host name"
    name, _ = split
    if name == "localhost" or name.endswith(".localhost") or _is_ip_literal(name):
        return None
    if name in {entry.lower().removesuffix(".") for entry in allowed_hosts}:
        return None
    return (f"Host {host[:200]!r} is not a loopback name, an IP address or a name in [admin] allowed_hosts "
            "(a page on a name rebound to this address would read the API)")


def _origin_refusal(origin: str, scheme: str, host: str | None) -> str | None:
    own = None if host is None else _split_host(host)
    origin_scheme, sep, authority = origin.strip().lower().partition("://")
    split = _split_host(authority) if sep and origin_scheme in _DEFAULT_PORTS else None
    if own is not None and split is not None and origin_scheme == scheme:
        default = _DEFAULT_PORTS[scheme]
        if own[0] == split[0] and (own[1] or default) == (split[1] or default):
            return None
    return f"Origin {origin[:200]!r} is not this router's own (a page elsewhere may not call the API)"


def admin_refusal(*, method: str, path: str, scheme: str, hosts: list[str], origins: list[str],
                  fetch_sites: list[str], allowed_hosts: Collection[str]) -> str | None:
    """Why an admin request (to an API with no token) is refused, or None to serve it.

    ``hosts``, ``origins`` and ``fetch_sites`` are every value of those headers;
    ``scheme`` is the request's (``https`` on a TLS listener).
    """
    if len(hosts) > 1 or len(origins) > 1 or len(fetch_sites) > 1:
        return "more than one Host, Origin or Sec-Fetch-Site header"
    host = hosts[0] if hosts else None
    if host is not None:
        problem = _host_refusal(host, allowed_hosts)
        if problem is not None:
            return problem
    if "/" + path.lstrip("/") == "/admin/ui" and method in ("GET", "HEAD"):
        # The page holds no state; a link to it from another site (Sec-Fetch-Site: cross-site) may open it.
        return None
    if origins:
        problem = _origin_refusal(origins[0], scheme, host)
        if problem is not None:
            return problem
    if fetch_sites and fetch_sites[0].strip().lower() in _REFUSED_FETCH_SITES:
        return f"Sec-Fetch-Site: {fetch_sites[0][:40]} (a page on another site may not call the API)"
    return None
