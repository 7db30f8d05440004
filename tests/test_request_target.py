"""Request targets: the absolute form is reduced to the origin form before any route decision.

``[admin] listen`` keeps ``/admin/`` off the traffic port; a target such as
``POST http://x/admin/engines/d1/drain`` must not get past that check (issue
19 item 11). The property tests generate every form of a target for the same
path and require that each reaches the same route, or is refused with 400,
through the in-process front, the worker's front and the controller's answer
to a worker's forward.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from narwhal.config import parse_config
from narwhal.http1.asgi import ASGILifespan
from narwhal.http1.server import HTTPServer, Request, Responder
from narwhal.http1.target import InvalidTarget, asgi_path, split_target
from narwhal.router import Router
from narwhal.serving.data_plane import LocalDataPlane
from narwhal.serving.front import is_admin_path
from narwhal.workers.process import WorkerSet
from narwhal.workers.protocol import Forward, ForwardReply

CONFIG = """
{admin}
[[engines]]
name = "p1"
url = "http://127.0.0.1:9"
role = "prefill"
[[engines]]
name = "d1"
url = "http://127.0.0.1:9"
role = "decode"
"""
ADMIN_ELSEWHERE = '[admin]\nlisten = "127.0.0.1:1"\n'

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ADMIN_PATHS = ["/admin/engines/d1/drain", "/admin/engines/p1/maintenance", "/admin/engines", "/admin",
               "/%61dmin/engines/d1/drain", "//admin/engines/d1/drain", "/admin/engines/d1/drain/"]
_host = st.sampled_from(["x", "127.0.0.1", "127.0.0.1:8000", "localhost:1", "[::1]:80", "a.b.c"])
_scheme = st.sampled_from(["http", "https", "HTTP", "Https"])
_query = st.sampled_from(["", "?", "?a=1", "?x=%zz&y"])


@st.composite
def target_forms(draw: Any, paths: list[str]) -> tuple[str, str]:
    """(the origin form, the same request in origin or absolute form)."""
    path = draw(st.sampled_from(paths)) + draw(_query)
    if draw(st.booleans()):
        return path, path
    return path, f"{draw(_scheme)}://{draw(_host)}{path}"


# ---- the one function ----


@given(st.data())
def test_absolute_and_origin_forms_split_alike(data: Any) -> None:
    origin, target = data.draw(target_forms(ADMIN_PATHS + ["/v1/completions", "/health", "/", "/a%20b"]))
    assert split_target(target.encode()) == split_target(origin.encode())


@pytest.mark.parametrize(("target", "expected"), [
    (b"http://x", b"/"), (b"http://x?a=1", b"/?a=1"), (b"HTTPS://h:1/admin/x?q", b"/admin/x?q"), (b"*", b"*"),
])
def test_absolute_form_without_a_path_is_the_root(target: bytes, expected: bytes) -> None:
    assert split_target(target)[0] == expected


@pytest.mark.parametrize("target", [b"ftp://x/admin/engines", b"http://u@x/admin", b"http:///admin", b"/a#b",
                                    b"x/admin", b"http:/admin"])
def test_other_target_forms_are_invalid(target: bytes) -> None:
    with pytest.raises(InvalidTarget):
        split_target(target)


def test_the_asgi_path_and_the_admin_check_read_the_same_path() -> None:
    request = Request(b"POST", b"http://x/%61dmin/engines/d1/drain?x=1")
    assert request.target == b"/%61dmin/engines/d1/drain?x=1" and request.query == b"x=1"
    assert asgi_path(request.raw_path) == "/admin/engines/d1/drain"
    assert is_admin_path(request)


# ---- the fronts ----


async def _exchange(router: Router, data: bytes) -> bytes:
    assert isinstance(router.data_plane, LocalDataPlane)
    server = router.data_plane.server
    client, server_side = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve_stream, server_side)
        await client.send_all(data)
        await client.send_eof()
        raw = b""
        with trio.fail_after(20):
            while chunk := await client.receive_some(65536):
                raw += chunk
    return raw


def _status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


async def _front(admin: str, requests: list[bytes]) -> tuple[list[bytes], bool]:
    router = Router(parse_config(CONFIG.format(admin=admin)))
    async with ASGILifespan(router.app):
        answers = [await _exchange(router, data) for data in requests]
    return answers, router.readmitter.drained("d1") or router.readmitter.drained("p1")


@SETTINGS
@given(target_forms(ADMIN_PATHS))
def test_no_target_form_reaches_the_admin_api_on_the_traffic_port(forms: tuple[str, str]) -> None:
    _origin, target = forms
    data = b"POST %b HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n" % target.encode()
    (raw,), drained = trio.run(_front, ADMIN_ELSEWHERE, [data])
    assert _status(raw) == 404, raw[:300]
    assert not drained


@SETTINGS
@given(target_forms(["/admin/engines/d1/drain", "/health"]))
def test_without_admin_listen_every_form_routes_like_the_origin_form(forms: tuple[str, str]) -> None:
    origin, target = forms
    requests = [b"POST %b HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n" % form.encode()
                for form in (origin, target)]
    (by_origin, by_target), _drained = trio.run(_front, "", requests)
    assert _status(by_origin) == _status(by_target), (by_origin[:200], by_target[:200])


def test_an_absolute_form_drain_on_the_traffic_port_is_404_and_drains_nothing() -> None:
    data = b"POST http://x/admin/engines/d1/drain HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"
    (raw,), drained = trio.run(_front, ADMIN_ELSEWHERE, [data])
    assert _status(raw) == 404 and json.loads(raw.partition(b"\r\n\r\n")[2])["error"]["code"] == "not_found"
    assert not drained


@pytest.mark.parametrize("target", [b"ftp://x/admin/engines/d1/drain", b"http://u@x/admin/engines/d1/drain",
                                    b"/admin/engines/d1/drain#x"])
async def test_other_target_forms_get_400_before_any_handler(target: bytes) -> None:
    seen: list[str] = []

    async def handler(request: Request, responder: Responder) -> None:
        seen.append(request.path)
        await responder.respond(200, [], b"")

    server = HTTPServer(handler)
    client, server_side = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve_stream, server_side)
        await client.send_all(b"POST %b HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n" % target)
        await client.send_eof()
        raw = b""
        with trio.fail_after(10):
            while chunk := await client.receive_some(65536):
                raw += chunk
    assert _status(raw) == 400
    assert json.loads(raw.partition(b"\r\n\r\n")[2])["error"]["code"] == "invalid_request_target"
    assert seen == []


# ---- the controller's answer to a worker's forward ----


class _Link:
    def __init__(self) -> None:
        self.sent: list[ForwardReply] = []

    def send(self, message: ForwardReply) -> None:
        self.sent.append(message)


async def _forward(admin: str, target: bytes,
                   headers: tuple[tuple[bytes, bytes], ...] = ((b"host", b"127.0.0.1"),)) -> tuple[ForwardReply, bool]:
    router = Router(parse_config(CONFIG.format(admin=admin)))
    workers = WorkerSet.__new__(WorkerSet)
    workers.config, workers.app = router.config, router.app
    link = _Link()
    async with ASGILifespan(router.app):
        await workers._answer_forward(link, Forward(  # type: ignore[arg-type]
            id=1, method=b"POST", target=target, headers=list(headers), body=b"", client=None,
            secure=False, http_version="1.1"))
    (reply,) = link.sent
    return reply, router.readmitter.drained("d1")


@SETTINGS
@given(target_forms(ADMIN_PATHS))
def test_a_forwarded_request_never_reaches_the_admin_api_while_admin_listen_has_it(forms: tuple[str, str]) -> None:
    _origin, target = forms
    reply, drained = trio.run(_forward, ADMIN_ELSEWHERE, target.encode())
    assert reply.status == 404 and not drained


def test_a_forward_with_an_invalid_target_is_400_and_without_admin_listen_drains() -> None:
    reply, _ = trio.run(_forward, ADMIN_ELSEWHERE, b"ftp://x/admin/engines/d1/drain")
    assert reply.status == 400
    reply, drained = trio.run(_forward, "", b"http://x/admin/engines/d1/drain")
    assert reply.status == 200 and drained



def test_a_forwarded_cross_site_admin_request_is_refused_by_the_controller() -> None:
    """Without [admin] token, a worker's forward keeps the browser's headers and meets the same checks."""
    for headers in (((b"host", b"127.0.0.1"), (b"origin", b"http://evil.example")),
                    ((b"host", b"evil.example"),)):
        reply, drained = trio.run(_forward, "", b"/admin/engines/d1/drain", headers)
        assert reply.status == 403 and b"admin_request_refused" in reply.body and not drained
