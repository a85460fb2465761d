"""wait_set, and the receivers built on it: a cancellation that comes with a frame takes nothing."""

import asyncio
from types import SimpleNamespace

import pytest

from p2ptrain.errors import LinkError
from p2ptrain.net import wire
from p2ptrain.net.mesh import ChunkChannel
from p2ptrain.waiting import wait_set

pytestmark = pytest.mark.timeout(10)


async def test_wait_set_says_whether_the_event_was_set_in_time():
    event = asyncio.Event()
    assert await wait_set(event, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_set(event, 5) is True
    assert await wait_set(event, 0) is True  # (already set: no wait)


async def test_a_cancellation_that_comes_as_the_event_is_set_is_not_dropped():
    event = asyncio.Event()
    waiting = asyncio.ensure_future(wait_set(event, 5))
    await asyncio.sleep(0)
    event.set()
    waiting.cancel()  # (the same moment: asyncio.wait_for before 3.12 returned True here)
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_a_ring_receiver_cancelled_as_a_chunk_arrives_leaves_it_for_the_next_ring():
    """A round aborted, its receiver cancelled just as the next round's first chunk came: that
    receiver took the chunk and lost it, and the next round's ring found the chunks out of step."""
    channel = ChunkChannel(link=SimpleNamespace(name="b"))
    old_ring = asyncio.ensure_future(channel.recv(timeout=5))
    await asyncio.sleep(0)
    frame = wire.Frame({"t": wire.CHUNK, "op": 4}, memoryview(b""))
    channel._put(frame)
    old_ring.cancel()
    with pytest.raises(asyncio.CancelledError):
        await old_ring
    assert await channel.recv(timeout=1) is frame
    with pytest.raises(LinkError, match="b: no ring chunk for 0 s"):
        await channel.recv(timeout=0.01)
