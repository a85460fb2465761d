"""The data path's on/off environment switches (``P2PTRAIN_IO_THREADS``, ``P2PTRAIN_RAW_CHUNKS``),
read where they take effect, each the same way: unset or empty is the default, ``0`` or ``1``
says it, anything else is a one-line ``ConfigError`` (``join`` reads each at its start)."""

from __future__ import annotations

import os

from p2ptrain.errors import ConfigError


def env_switch(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip()
    if value == "":
        return default
    if value in ("0", "1"):
        return value == "1"
    raise ConfigError(f"{name}={value!r}: expected 0 or 1")
