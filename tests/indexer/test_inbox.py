"""The subscriber's SUB inbox on real ZMQ sockets: bursts in order, nothing lost while the reader is busy,
and a busy reader's descriptor does not keep the loop waking up."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio
from kvroute.indexer.sockets import MAX_BURST, Inbox, sub_socket


@pytest.fixture
async def pair(zctx: zmq.asyncio.Context) -> AsyncIterator[tuple[zmq.Socket[bytes], Inbox]]:
    pub: zmq.Socket[bytes] = zmq.Socket(zctx, zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = sub_socket(zctx)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    inbox = Inbox(sub)
    # PUB drops what it sends before the subscription arrives: send probes until one gets through.
    for _ in range(200):
        pub.send_multipart([b"probe"])
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(inbox.drain(), 0.05)
            break
    else:
        pytest.fail("the subscription never arrived")
    await asyncio.sleep(0.05)
    while sub.get(zmq.EVENTS) & zmq.POLLIN:  # late probes
        sub.recv_multipart()
    yield pub, inbox
    inbox.close()
    sub.close(0)
    pub.close(0)


async def test_a_burst_comes_whole_and_in_order(pair: tuple[zmq.Socket[bytes], Inbox]) -> None:
    pub, inbox = pair
    for i in range(MAX_BURST + 10):
        pub.send_multipart([b"t", str(i).encode()])
    got: list[int] = []
    while len(got) < MAX_BURST + 10:
        burst = await asyncio.wait_for(inbox.drain(), 5)
        assert len(burst) <= MAX_BURST
        got += [int(frames[1]) for frames in burst]
    assert got == list(range(MAX_BURST + 10))


async def test_messages_sent_while_the_reader_is_busy_are_all_read(pair: tuple[zmq.Socket[bytes], Inbox]) -> None:
    pub, inbox = pair
    pub.send_multipart([b"t", b"0"])
    assert [f[1] for f in await asyncio.wait_for(inbox.drain(), 5)] == [b"0"]
    # The reader is away (handling a burst, awaiting a Redis write): messages keep coming.
    for i in range(1, 50):
        pub.send_multipart([b"t", str(i).encode()])
        await asyncio.sleep(0.002)
    got: list[int] = []
    while len(got) < 49:
        got += [int(frames[1]) for frames in await asyncio.wait_for(inbox.drain(), 5)]
    assert got == list(range(1, 50))


async def test_a_busy_reader_does_not_spin_the_loop(
    pair: tuple[zmq.Socket[bytes], Inbox], monkeypatch: pytest.MonkeyPatch
) -> None:
    pub, inbox = pair
    wakes = 0
    wake = inbox._wake

    def counting() -> None:
        nonlocal wakes
        wakes += 1
        wake()

    # The loop holds the bound method given to add_reader: watch through a fresh registration.
    loop = asyncio.get_running_loop()
    loop.remove_reader(inbox.sock.FD)
    loop.add_reader(inbox.sock.FD, counting)
    pub.send_multipart([b"t", b"queued"])  # nobody waits: the wake-up must take ZeroMQ's commands
    await asyncio.sleep(0.3)
    # A descriptor left readable would wake a level-triggered loop on every turn: thousands in 0.3 s.
    assert 1 <= wakes <= 5
    assert [f[1] for f in await asyncio.wait_for(inbox.drain(), 5)] == [b"queued"]


async def test_a_burst_waits_for_what_is_ready_before_it(pair: tuple[zmq.Socket[bytes], Inbox]) -> None:
    """Events already queued still wait one turn of the loop: a callback ready before the burst (a
    response's first bytes, read in the same turn) runs first, and back-to-back bursts never hold the loop."""
    pub, inbox = pair
    pub.send_multipart([b"t", b"0"])
    sock = inbox.sock
    for _ in range(500):  # until the message sits in the socket, so drain() needs no wake-up
        if sock.get(zmq.EVENTS) & zmq.POLLIN:
            break
        await asyncio.sleep(0.01)
    else:
        pytest.fail("the message never arrived")
    order: list[str] = []
    asyncio.get_running_loop().call_soon(order.append, "ready before")
    burst = await inbox.drain()
    order.append("burst")
    assert [f[1] for f in burst] == [b"0"]
    assert order == ["ready before", "burst"]
