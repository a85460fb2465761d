"""Who this process is on the network: a fresh random peer id. Pure code.

The id is drawn anew by every process and never derived from a host name, a settings
folder or a checkpoint, so two copies of one folder (or two peers on one host) can never
be taken for one peer. Ids are compared as strings: the coordinator is the smallest.
"""

from __future__ import annotations

import os

PEER_ID_BYTES = 8  # 16 hex characters: collisions are out of the question on a LAN


def new_peer_id() -> str:
    """A fresh id for this process, e.g. ``'3f9c0a51d2e4b817'``."""
    return os.urandom(PEER_ID_BYTES).hex()
