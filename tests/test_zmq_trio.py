"""pyzmq under trio: messages arrive whole, a waiting task wakes on close, nothing blocks the loop."""

from __future__ import annotations

import pytest
import trio
import trio.testing
import zmq

from narwhal.kv_events.zmq_trio import TrioSocket


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.term()


async def test_pub_sub_multipart_arrive_in_order(context) -> None:
    pub = TrioSocket.open(context, zmq.PUB)
    port = pub.socket.bind_to_random_port("tcp://127.0.0.1")
    sub = TrioSocket.open(context, zmq.SUB)
    sub.socket.setsockopt(zmq.SUBSCRIBE, b"")
    sub.socket.connect(f"tcp://127.0.0.1:{port}")
    try:
        # A SUB socket joins late (the slow-joiner): publish until the first message arrives.
        with trio.fail_after(10):
            got = None
            while got is None:
                pub.send_multipart_nowait([b"t", b"hello"])
                with trio.move_on_after(0.05):
                    got = await sub.recv_multipart()
            assert got == [b"t", b"hello"]
            for i in range(100):
                assert pub.send_multipart_nowait([b"t", str(i).encode()])
            seen = []
            while len(seen) < 100:
                frames = await sub.recv_multipart()
                if frames[1] != b"hello":
                    seen.append(int(frames[1]))
            assert seen == list(range(100))
    finally:
        sub.close()
        pub.close()


async def test_dealer_router_round_trip(context) -> None:
    router = TrioSocket.open(context, zmq.ROUTER)
    port = router.socket.bind_to_random_port("tcp://127.0.0.1")
    dealer = TrioSocket.open(context, zmq.DEALER)
    dealer.socket.connect(f"tcp://127.0.0.1:{port}")
    try:
        with trio.fail_after(10):
            await dealer.send_multipart([b"", b"ask"])
            identity, empty, body = await router.recv_multipart()
            assert (empty, body) == (b"", b"ask")
            await router.send_multipart([identity, b"", b"answer"])
            assert await dealer.recv_multipart() == [b"", b"answer"]
    finally:
        dealer.close()
        router.close()


async def test_close_wakes_a_waiting_receiver(context) -> None:
    sub = TrioSocket.open(context, zmq.SUB)
    sub.socket.setsockopt(zmq.SUBSCRIBE, b"")
    sub.socket.connect("tcp://127.0.0.1:9")
    woke = trio.Event()

    async def receive() -> None:
        with pytest.raises(trio.ClosedResourceError):
            await sub.recv_multipart()
        woke.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)
            await trio.testing.wait_all_tasks_blocked()
            sub.close()
            await woke.wait()
