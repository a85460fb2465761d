"""The ``join`` processes running on this machine, counted so that they share its cores.

Two ``join`` on one machine with discovery (no ``--peers``: nothing says that the other is
local) each ran torch with every core: torch's thread pools spin while they wait, and a
40-round run of the default task took 44-126 s on two cores where one thread each took 16 s.

Each ``join`` holds a lock on a file of its own in a folder of this user's temporary files,
as long as it runs; the operating system drops the lock when the process ends, however it
ends, so a file whose lock can be taken is left over and is deleted. Counting is a listing
and a lock try per file: ``join`` does it at its start and every few seconds.
"""

from __future__ import annotations

import getpass
import logging
import os
import re
import stat
import tempfile
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None
    import msvcrt

log = logging.getLogger("p2ptrain.join")  # (join's lines, under join's name)

CHECK_EVERY = 5.0  # seconds between two counts (a listing and a lock try a file)
STALE_AFTER = 10.0  # seconds: an unlocked file younger than this may be one whose owner has not locked it yet


_NAME = re.compile(r"^[0-9]+-[0-9a-f]{8}$")  # ours: "<pid>-<8 hex digits>"; nothing else is touched
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _private(folder: Path) -> bool:
    """The folder and its parent are real folders of this user that nobody else can write: in a
    shared temporary folder another user could have made them first, or made them links to a
    folder of ours, where the count deletes the files it takes for left over. (Windows: its
    temporary folder is the user's own.)"""
    if not hasattr(os, "getuid"):
        return True
    for part in (folder.parent, folder):
        try:
            st = os.lstat(part)
        except OSError:
            return False
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            return False
    return True


def _folder() -> Path:
    try:
        user = getpass.getuser()
    except Exception:  # (no user name in this environment: one folder for all)
        user = "any"
    return Path(tempfile.gettempdir()) / f"p2ptrain-{user}" / "joins"


def _lock(fd: int) -> bool:
    """Take the file's lock without waiting; False where another holds it."""
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
    except OSError:
        return False
    return True


class Neighbours:
    """This process's file among those of the machine's other ``join`` processes. Where the
    folder cannot be written, it counts this process alone (the split is an optimisation)."""

    def __init__(self, folder: Path | None = None):
        self.folder = folder if folder is not None else _folder()
        self._fd: int | None = None
        self._path: Path | None = None
        try:
            self.folder.parent.mkdir(mode=0o700, exist_ok=True)
            self.folder.mkdir(mode=0o700, exist_ok=True)
            if not _private(self.folder):
                return
            path = self.folder / f"{os.getpid()}-{os.urandom(4).hex()}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
        except OSError:
            return
        if _lock(fd):
            self._fd, self._path = fd, path
        else:
            os.close(fd)

    def count(self) -> int:
        """The ``join`` processes running here, this one included."""
        if self._fd is None:
            return 1
        alive = 1
        try:
            names = os.listdir(self.folder)
        except OSError:
            return 1
        for name in names:
            path = self.folder / name
            if path == self._path or not _NAME.match(name):
                continue
            try:
                fd = os.open(path, os.O_RDWR | _NOFOLLOW)
            except OSError:  # (gone meanwhile)
                continue
            try:
                held = not _lock(fd)
                stale = not held and time.time() - os.fstat(fd).st_mtime > STALE_AFTER
            except OSError:
                held = stale = False
            finally:
                os.close(fd)  # (releases a lock taken here; Windows deletes no open file)
            alive += held
            if stale:  # its process ended without removing it: killed
                try:
                    os.unlink(path)
                except OSError:
                    pass
        return alive

    def close(self) -> None:
        if self._fd is None:
            return
        os.close(self._fd)
        self._fd = None
        try:
            os.unlink(self._path)
        except OSError:
            pass


class CoreShare:
    """Torch's threads for this ``join``: its share of the machine's cores. Torch's thread pools
    spin while they wait, and two of them on the same cores stall each other for seconds.

    The peers here: the ``join`` processes running (``Neighbours``), or ``listed`` (the peers
    ``--peers`` names at this machine's addresses, which may not have started yet) and this one,
    where more. Counted again every ``CHECK_EVERY`` seconds: a peer alone again gets its threads
    back. An ``OMP_NUM_THREADS`` the user set is kept (as torchrun keeps it)."""

    def __init__(self, neighbours: Neighbours | None = None):
        self.neighbours = neighbours if neighbours is not None else Neighbours()
        self.listed = 0
        self._own = 0  # torch's threads before any split
        self._checked = float("-inf")

    def share_every(self, now: float) -> None:
        """``share()`` if the last count is ``CHECK_EVERY`` seconds old (``now``: monotonic)."""
        if now - self._checked >= CHECK_EVERY:
            self.share()

    def share(self) -> None:
        import torch

        self._checked = time.monotonic()
        if os.environ.get("OMP_NUM_THREADS"):
            return
        self._own = self._own or torch.get_num_threads()
        here = max(self.listed + 1, self.neighbours.count())
        threads = max(1, (os.cpu_count() or 1) // here) if here > 1 else self._own
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
            if here > 1:
                log.info("%d peers run on this machine: %d torch thread(s) each", here, threads)
            else:
                log.info("the only peer on this machine now: %d torch thread(s)", threads)

    def close(self) -> None:
        self.neighbours.close()
