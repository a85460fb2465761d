"""Text every peer can read without a download: the Python standard library's own source,
or the user's files. Read as bytes, so the vocabulary (256 byte values) needs no exchange.

Peers agree on the corpus only if they read the same bytes: files are taken in sorted
order of their relative path (``/``-separated, so Windows sorts like Linux) and
line endings are normalized. Two peers on different Python versions read different
stdlib sources; ``digest`` lets users compare.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from p2ptrain.errors import ConfigError

STDLIB_BYTES = 3 * 1024 * 1024
"""How much of the standard library to read: enough to learn from, quick to load."""
USER_BYTES = 256 * 1024 * 1024
"""Cap on a user's ``data=``: the corpus is held in memory as one byte per token."""
_STDLIB_SKIP = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


@dataclass(frozen=True)
class Corpus:
    text: bytes
    origin: str
    truncated: bool

    @property
    def digest(self) -> str:
        """Short hash of the text: equal on two peers means the same training data."""
        return hashlib.blake2b(self.text, digest_size=4).hexdigest()


def _sorted_files(root: Path, suffix: str | None, skip_dirs: set[str]) -> list[Path]:
    """Regular files under ``root`` (not hidden, not in skipped dirs) in a platform-independent order."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in skip_dirs]
        for name in files:
            if not name.startswith(".") and (suffix is None or name.endswith(suffix)):
                found.append(Path(folder, name))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _read_bounded(files: list[Path], limit: int, skip_binary: bool) -> tuple[bytes, bool]:
    parts, total = [], 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue  # unreadable files are skipped identically on peers with the same tree
        if skip_binary and b"\0" in data[:4096]:
            continue
        data = data.replace(b"\r\n", b"\n")
        parts.append(data)
        total += len(data)
        if total >= limit:
            return b"".join(parts)[:limit], True
    return b"".join(parts), False


@functools.lru_cache(maxsize=4)
def load_corpus(data: str | None) -> Corpus:
    """The stdlib's ``.py`` sources (``data=None``), or a text file, or a folder of text files.

    ConfigError when the path does not exist or holds no text."""
    if data is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        text, truncated = _read_bounded(_sorted_files(root, ".py", _STDLIB_SKIP), STDLIB_BYTES, skip_binary=False)
        if not text:
            raise ConfigError(f"charlm: found no .py sources in the standard library at {root} "
                              f"(an embedded Python?); give --data PATH, a text file or folder")
        return Corpus(text, f"Python {sysconfig.get_python_version()} standard library", truncated)
    path = Path(data).expanduser()
    if path.is_file():
        text, truncated = _read_bounded([path], USER_BYTES, skip_binary=True)
        if not text and path.stat().st_size:
            raise ConfigError(f"--data {data}: not a text file (it holds NUL bytes: an executable, an archive?); "
                              "give a text file or a folder of text files")
    elif path.is_dir():
        text, truncated = _read_bounded(_sorted_files(path, None, {"__pycache__"}), USER_BYTES, skip_binary=True)
    else:
        raise ConfigError(f"--data {data}: no such file or folder; give a text file or a folder of text files")
    if not text:
        raise ConfigError(f"--data {data}: holds no text; give a non-empty text file or a folder of text files")
    return Corpus(text, str(path), truncated)
