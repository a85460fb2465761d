"""``P2PHook``: a ``DistributedDataParallel`` script whose gradients cross machines on p2ptrain.

    import torch.distributed as dist
    from p2ptrain.integrations.ddp import P2PHook, init_local_group

    init_local_group()                          # DDP's world: this machine only (or torchrun's, inside it)
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    hook = P2PHook(listen="0.0.0.0:7100", peers=["10.0.0.1:7100", "10.0.0.2:7100"])
    with hook:                                  # the ring between machines
        hook.register(ddp)
        for x, y in loader:                     # the loop as it was
            loss_fn(ddp(x), y).backward()
            optimizer.step(); optimizer.zero_grad()

DDP keeps doing what it does (buckets of gradients, launched while backward still runs,
``no_sync()`` for accumulation); the hook hands each bucket to a p2ptrain ``Group`` (the
ring-allreduce over TCP, any codec) on the hook's own event loop thread and returns a future
that loop completes: the autograd thread never waits on the network, and DDP waits for every
bucket at the end of backward, as it does for its own allreduce. The result is DDP's: the mean
over every rank of every machine (``batch_size`` set: weighted by samples instead).

DDP's world is one machine: one process (``init_local_group()``, a gloo group of one), or one
per GPU of a desktop (``torchrun --nproc-per-node 2``): then each bucket is first summed inside
the machine by DDP's process group, and the local rank ``k`` of every machine forms its own
ring with the local ranks ``k`` elsewhere (``listen``/``peers``: that rank's addresses).

Rules the peers must share, as with torch.distributed: the same model, DDP options and steps;
``find_unused_parameters=True`` (DDP then never rebuilds its buckets after the first step,
whose order would be each machine's own); the members are fixed (a ``Group``: a peer lost
fails the step with ``GroupError``; for an elastic cluster use ``Peer`` or the other
integrations). A parameter one machine did not use gets no gradient there (DDP's rule within
its world), so use every parameter in every step. Buffers (BatchNorm's statistics) are DDP's
business within the machine; ``average_buffers(module)`` averages them across machines
(between steps, blocking).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Sequence

import torch
import torch.distributed as dist

from p2ptrain.collective.group import Group
from p2ptrain.errors import ConfigError

START_TIMEOUT = 120.0  # seconds to wait for the other machines' rings


def init_local_group() -> None:
    """A gloo process group of one (this process alone), unless one is already set up: DDP's
    world when each machine runs one training process."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


class P2PHook:
    """A DDP communication hook over a p2ptrain ``Group`` (module docstring). Keywords: ``Group``'s.
    Use as a context manager; ``register(ddp)`` once, before the first backward."""

    def __init__(self, listen: str, peers: Sequence[str], *, secret: str | bytes | None = None,
                 cluster: str = "default", compression: str = "none", timeout: float = 120.0,
                 tls_cert: str | None = None, tls_key: str | None = None, tls_ca: str | None = None):
        self.group = Group(listen, peers, secret=secret, cluster=cluster, compression=compression, timeout=timeout,
                           tls_cert=tls_cert, tls_key=tls_key, tls_ca=tls_ca)
        self.batch_size: int | None = None  # samples behind this step's gradient, for a weighted mean
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._local: dist.ProcessGroup | None = None

    # -- lifetime ---------------------------------------------------------------------------
    def __enter__(self) -> P2PHook:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="p2ptrain-ddp-hook", daemon=True)
        self._thread.start()
        try:
            self._call(self.group.__aenter__(), START_TIMEOUT)
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Leave the ring (the other machines' next step fails with ``GroupError``)."""
        if self._loop is not None:
            try:
                self._call(self.group.close(), 30.0)
            finally:
                self._stop()

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)
        self._loop.close()
        self._loop = self._thread = None

    def _call(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # -- the hook ---------------------------------------------------------------------------
    def register(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """``ddp.register_comm_hook(self, P2PHook.hook)``, once the ring is formed."""
        if self._loop is None:
            raise ConfigError("enter the P2PHook (with hook:) before registering it: the ring must be formed")
        if not ddp.find_unused_parameters:
            raise ConfigError("build the DistributedDataParallel with find_unused_parameters=True: without it DDP "
                              "reorders its buckets after the first step, each machine its own way")
        self._local = ddp.process_group
        ddp.register_comm_hook(self, P2PHook.hook)

    @staticmethod
    def hook(state, bucket):  # (no annotations: DDP checks them as objects, and this module's are strings)
        """DDP calls this on its autograd thread with each bucket once its gradients are ready:
        the bucket goes to the ring on the hook's loop, and the future returned completes there."""
        local = state._local.size() if state._local is not None else 1
        n = state.batch_size
        if n is None:  # DDP's own arithmetic: each rank's gradient divided by the world, then summed
            work = [bucket.buffer().div(local * state.group.size)]
        else:
            work = [bucket.buffer().mul(float(n)), torch.tensor([float(n)])]
        result: torch.futures.Future = torch.futures.Future()
        if local > 1:  # (the desktop's ranks first, by DDP's process group)
            summed = dist.all_reduce(work[0], group=state._local, async_op=True).get_future()
            count = dist.all_reduce(work[1], group=state._local, async_op=True).get_future() if n is not None else None

            def cross(done: torch.futures.Future) -> None:
                try:
                    done.wait()
                    if count is not None:
                        count.wait()
                except Exception as exc:  # (DDP raises it from backward)
                    result.set_exception(exc)
                    return
                state._across(work, result)

            summed.add_done_callback(cross)
        else:
            state._across(work, result)
        return result

    def _across(self, work: list[torch.Tensor], result: torch.futures.Future) -> None:
        """The ring between machines, on the hook's loop; ``result`` gets the mean."""
        async def run() -> None:
            try:
                await self.group.allreduce(work)
                if len(work) == 2:
                    work[0].div_(work[1])
                result.set_result(work[0])
            except BaseException as exc:  # (DDP raises it from backward)
                result.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise

        asyncio.run_coroutine_threadsafe(run(), self._loop)

    # -- buffers ----------------------------------------------------------------------------
    def average_buffers(self, module: torch.nn.Module) -> None:
        """Every float buffer of ``module`` (BatchNorm's statistics) set to its mean over the
        machines, so that each evaluates alike. Between steps; blocks until the ring is done."""
        buffers = [b for b in module.buffers() if b.is_floating_point()]
        if buffers:
            self._call(self.group.allreduce(buffers, op="mean"), self.group.timeout + 10)
