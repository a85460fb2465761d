"""Small helpers the tests share: waiting for a condition, and running peer processes."""

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys


# TCP ports for peers that must know each other's before they listen. Each xdist worker takes a
# block of its own, below the range Linux hands out to outgoing connections (32768 up): bases
# derived from each file's pid overlapped across workers, and two files running at once took the
# same port now and then ("address already in use").
PORT_FIRST, PORT_BLOCK, PORT_BLOCKS = 12000, 4000, 5


def _worker_block() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    return PORT_FIRST + (int(worker) if worker.isdigit() else 0) % PORT_BLOCKS * PORT_BLOCK


_next_port = [_worker_block()]


def ports(n: int) -> list[int]:
    """``n`` consecutive ports of this worker's block, not handed out before in this process
    (until the block wraps round, long after the tests that had them ended)."""
    block = _worker_block()
    if _next_port[0] + n >= block + PORT_BLOCK:
        _next_port[0] = block
    first = _next_port[0]
    _next_port[0] += n + 1
    return list(range(first, first + n))


async def until(cond, timeout=10.0, every=0.02):
    """Poll ``cond()`` until true; fail the test after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(every)


@contextlib.contextmanager
def reaped(*procs: subprocess.Popen):
    """Leaving, kill and wait for each of ``procs`` still running, whatever happened (a failed
    assertion, a timeout): no test leaves a process behind. A list passed in may grow inside."""
    try:
        yield
    finally:
        for p in (procs[0] if len(procs) == 1 and isinstance(procs[0], list) else procs):
            if p.poll() is None:
                p.kill()
                p.wait()


def finish(procs: list[subprocess.Popen], timeout: float = 150) -> list[tuple[str, str]]:
    """Wait for every process; kill any still running, whatever happens."""
    with reaped(procs):
        return [p.communicate(timeout=timeout) for p in procs]


@dataclasses.dataclass(frozen=True)
class Finished:
    returncode: int
    stdout: str
    stderr: str
    pid: int  # (its process group's id too)


def run_group(argv: list[str], timeout: float, **popen) -> Finished:
    """Run a command (a benchmark that starts workers) in a process group of its own, output
    captured as text. Past ``timeout``: SIGTERM to the group (a benchmark's parent then kills
    the workers it started in sessions of their own), SIGKILL to what is left 10 s later, and
    ``TimeoutExpired``: so that a hung run leaves nothing behind to eat the CI's time."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         **popen)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal_group(p.pid, signal.SIGTERM)
        try:
            out, err = p.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            out, err = "", ""
        _signal_group(p.pid, signal.SIGKILL)  # the workers left in its group
        raise subprocess.TimeoutExpired(argv, timeout, out, err) from None
    finally:
        if p.poll() is None:  # (pytest-timeout or ^C in the middle)
            _signal_group(p.pid, signal.SIGKILL)
            p.wait()
    return Finished(p.returncode, out, err, p.pid)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def pending_tasks() -> list:
    """The loop's tasks still pending, the caller's own aside: after ``close()``, what its owner
    left behind (STYLE rule 5: every task is kept, cancelled and awaited by its owner)."""
    me = asyncio.current_task()
    return [t for t in asyncio.all_tasks() if t is not me and not t.done()]


@contextlib.asynccontextmanager
async def async_peers_on_loopback(made: list, each: list[dict] | None = None, **options):
    """One ``AsyncPeer`` per ``(model, optimizer)`` in ``made``, on loopback, entered, each told
    the others' addresses (the ports are known only once entered); all closed on leaving.
    ``options`` go to every peer, ``each[i]`` to peer ``i`` alone (its certificate, say)."""
    from p2ptrain.trainer.peer import AsyncPeer

    each = each or [{}] * len(made)
    peers = [AsyncPeer(*m, listen="127.0.0.1:0", min_peers=len(made), secret="s", discovery=False, **options, **own)
             for m, own in zip(made, each)]
    entered = []
    try:
        for p in peers:
            await p.__aenter__()
            entered.append(p)
        for p in peers:
            p.discovery.static_addresses = [("127.0.0.1", q.cluster.port) for q in peers]
        yield peers
    finally:
        for p in entered:
            await p.__aexit__(None, None, None)


INTEGRATION_RUNS = os.path.join(os.path.dirname(__file__), "integration_runs.py")


def run_ranks(script: str, modes: str, out, port_count: int, timeout: float = 100, ranks: int = 2) -> list[dict]:
    """The ``ranks`` of ``integration_runs.py``'s ``script``, each in its own process (killed past
    ``timeout``); what each wrote, by mode (``"p2p,ddp"``: both, in that order, in one process)."""
    import torch

    chosen = [str(p) for p in ports(port_count)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen([sys.executable, INTEGRATION_RUNS, script, modes, str(rank), str(out), *chosen],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(ranks)]
    outputs = finish(procs, timeout=timeout)
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    return [{mode: torch.load(os.path.join(out, f"{mode}-{rank}.pt"), weights_only=True) for mode in modes.split(",")}
            for rank in range(ranks)]


def run_cli(capsys, *argv) -> tuple:
    """``python -m p2ptrain ARGV`` in this process: (exit code, stdout, stderr's lines)."""
    from p2ptrain.commands import cli

    try:
        code = cli.main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()
