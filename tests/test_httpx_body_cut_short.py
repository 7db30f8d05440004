"""A POST whose body send is cut short: httpx's abandoned body generator is no error (httpx issue 3686)."""

import gc
import warnings
from functools import partial

import httpx
import pytest
import trio

_BODY = b"x" * 50_000_000  # far beyond the socket buffers: the send blocks with the body half written


async def _post_cut_short_mid_body() -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    body_arriving = trio.Event()

    async def read_once_then_stall() -> None:
        async with listener, await listener.accept() as stream:
            # Until the body's bytes arrive (the head comes first); the sender never closes before.
            while b"xxxx" not in (data := await stream.receive_some(65536)):
                assert data, "the client closed before its body arrived"
            body_arriving.set()
            await trio.sleep_forever()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_once_then_stall)
            async with httpx.AsyncClient() as client, trio.open_nursery() as sender:
                sender.start_soon(partial(client.post, f"http://127.0.0.1:{port}/", content=_BODY))
                await body_arriving.wait()
                sender.cancel_scope.cancel()
            nursery.cancel_scope.cancel()
    gc.collect()
    await trio.sleep(0)


async def test_a_post_cancelled_while_its_body_is_sent_leaves_no_error() -> None:
    # The etcd watcher's POST met this when a proxy cut its connection mid-send (CI, 2026-12-05);
    # pyproject.toml's filter is what keeps it from failing the test it lands in.
    await _post_cut_short_mid_body()


async def test_httpx_still_abandons_the_body_generator() -> None:
    # The scenario above does meet the warning; an httpx that no longer abandons its body iterator skips here,
    # saying so (a dependency's fix must not fail our CI), and the filter in pyproject.toml can go.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        await _post_cut_short_mid_body()
    if not any("ByteStream.__aiter__" in str(w.message) for w in caught):
        pytest.skip(f"httpx {httpx.__version__} closes its request body's iterator: drop the filterwarnings entry")
