"""The ``join`` processes running on this machine, counted so that they can share its cores.

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
import os
import tempfile
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None
    import msvcrt

STALE_AFTER = 10.0  # seconds: an unlocked file younger than this may be one whose owner has not locked it yet


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
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / f"{os.getpid()}-{os.urandom(4).hex()}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
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
            if path == self._path:
                continue
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError:  # (gone meanwhile)
                continue
            try:
                if not _lock(fd):
                    alive += 1
                elif time.time() - os.fstat(fd).st_mtime > STALE_AFTER:
                    os.close(fd)
                    fd = -1
                    os.unlink(path)  # (its process ended without removing it: killed)
            except OSError:
                pass
            finally:
                if fd >= 0:
                    os.close(fd)  # (releases a lock taken here)
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
