"""What every command's arguments share: a listen address, an http(s) URL, one-line usage errors.

Each type is an argparse ``type=``: a wrong value is the command's usage
error, one line and exit 2, in the same words whichever command took it.
"""

from __future__ import annotations

import argparse
import typing
import urllib.parse

__all__ = ["OneLineParser", "http_url", "listen_address"]


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (``PROG: --opt: problem``), exit 2; subparsers too."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: {message.removeprefix('argument ')} (see {self.prog} --help)\n")


def listen_address(value: str) -> str:
    """``HOST:PORT`` (``[v6]:PORT`` too), as written; a URL or a malformed address is a usage error."""
    from narwhal.config import parse_listen

    scheme, sep, rest = value.partition("://")
    if sep:
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT without a scheme, got {value!r} (try {rest.rstrip('/')!r})")
    try:
        parse_listen(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def http_url(value: str) -> str:
    """An ``http://`` or ``https://`` URL with a host; anything else is a usage error."""
    parsed = urllib.parse.urlsplit(value)
    if parsed.scheme not in ("http", "https"):
        hint = f" (try 'http://{value}')" if "://" not in value else ""
        raise argparse.ArgumentTypeError(
            f"expected http://HOST:PORT or https://HOST:PORT, got {value!r}{hint}")
    try:
        parsed.port  # noqa: B018 - raises on a port that is not a number or out of range
    except ValueError:
        raise argparse.ArgumentTypeError(f"port out of range or not a number in {value!r}") from None
    if not parsed.hostname:
        raise argparse.ArgumentTypeError(f"no host in {value!r}")
    return value
