"""A listening socket and the handshakes in progress on it (``transport.serve`` builds one).

``listen`` opens it so that a cancel midway (a waiter that stopped waiting for a peer's
opening: ``asyncio.wait_for``, Ctrl-C) leaves nothing listening: asyncio's ``create_server``
binds, then yields once to start serving, and a cancel at that yield would leave a server
accepting connections that no one owns, the peer's port taken.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from p2ptrain.taskset import TaskSet

log = logging.getLogger("p2ptrain.net.transport")  # (its lines are the transport's)


class Listener:
    """A listening socket and the handshakes in progress on it; owns both. ``close()`` ends them."""

    def __init__(self, server: asyncio.AbstractServer, admissions: TaskSet):
        self.server = server
        self._admissions = admissions

    @property
    def port(self) -> int:
        return self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        self.server.close()
        await self._admissions.close(timeout=5.0)
        try:  # from 3.12 this also waits for accepted connections: their owners close them
            await asyncio.wait_for(self.server.wait_closed(), 5.0)
        except asyncio.TimeoutError:
            log.debug("listener closed with connections still open")


async def listen(factory: Callable[[], asyncio.BaseProtocol], host: str, port: int, admissions: TaskSet) -> Listener:
    """Listen on ``host:port`` with ``factory``'s protocols; closed again if cancelled midway."""
    server = await asyncio.get_running_loop().create_server(factory, host, port, reuse_address=True,
                                                            start_serving=False)
    try:
        await server.start_serving()
    except BaseException:
        server.close()
        raise
    return Listener(server, admissions)
