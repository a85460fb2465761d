"""The settings every peer of a cluster must share, and the one line that says which differs.
Pure code, no I/O.

Each peer states its own in its handshake (``info["settings"]``, from ``shared``), and each side
compares the other's with its own (``differences``) when the link is admitted, before any round.
A peer whose settings differ is refused as a peer of another model is: linked (so not dialed
again and again), never handed to the round machine, and said once. A peer that has applied
nothing yet and has no member of its own stops there (``SettingsError``: ``join`` exits 3 with
that line), since the mistake is most likely its own; one that trains with others goes on.
(Before, a ring between codecs failed, its leader stepped down, and the next took over, seven
times a second, forever.)

The rule for each (README, "Settings every peer shares"), all refused, none agreed: a setting
that followed the coordinator would depend on which peer has the smallest id, and the machine
whose flag was overridden would train otherwise than its command line says.

- ``compression``: every chunk of a ring is decoded with its sender's codec, and every peer
  applies the bytes its segment's owner encoded. (As its spec: ``int8`` is ``int8+zstd:1``.)
- ``staleness``: at 0 the cluster promises DDP's mathematics (every gradient applied to the
  parameters it was computed on); one member running ahead breaks it for all.
- ``target_batch_size``: the most samples one update averages, each member contributing its
  share; with another target on each peer an update's size would depend on who is in it.
- ``seed``: the model's initial parameters and, for a task like ``synthetic``, the data itself.
- ``sync_every``, ``outer_lr``, ``outer_momentum`` (local-steps mode): a ring of pseudo-gradients
  summed with gradients means nothing, and every peer must take the same outer step; so too
  ``outer_whole`` (``P2PTRAIN_OUTER_WHOLE``: what a round's sum is divided by, ``LocalSteps.divisor``).

The rest may differ per machine: batch size, device, ``min_peers``, ``reconcile_every``,
``weight_prediction``. The optimizer's settings (the learning rate) are not compared, since a
scheduler or a checkpoint may have moved them before the peer was built; a joiner takes them
with the cluster's state, and a member started with others on different ones drifts, which
``reconcile`` corrects and names.
"""

from __future__ import annotations

from p2ptrain.cluster.sync_every import parse_sync_every

FLAGS = {"compression": "--compression", "staleness": "--staleness", "target_batch_size": "--target-batch-size",
         "seed": "--seed", "sync_every": "--sync-every", "outer_lr": "--outer-lr",
         "outer_momentum": "--outer-momentum", "outer_whole": "P2PTRAIN_OUTER_WHOLE"}
MAX_SHOWN = 40  # characters of a peer's value quoted in a log line


def shared(*, compression: str, staleness: int, target_batch_size: int | None = None,
           seed: int | None = None, sync_every: int | str | None = None, outer_lr: float = 0.0,
           outer_momentum: float = 0.0, outer_whole: bool = False) -> dict:
    """This peer's settings as its handshake states them (``seed`` None: not compared;
    ``sync_every`` None: gradient mode, stated as 0; a count as an int, a window or ``auto`` as
    its canonical text, ``sync_every.SyncEvery.canonical``; ``outer_whole`` as 0 or 1)."""
    out = {"compression": compression, "staleness": staleness, "target_batch_size": target_batch_size or 0,
           "sync_every": parse_sync_every(sync_every).canonical() if sync_every else 0}
    if seed is not None:
        out["seed"] = seed
    if sync_every:
        out.update(outer_lr=float(outer_lr), outer_momentum=float(outer_momentum), outer_whole=int(outer_whole))
    return out


def _shown(value) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "..."


def differences(ours: dict, theirs) -> list[str]:
    """What differs, one phrase per setting, ``--compression 'int8+zstd:1' there, 'none' here``;
    empty if nothing does. A setting either side does not state is not compared (an older
    peer); ``theirs`` is a peer's, so anything that is not a dict states nothing."""
    if not isinstance(theirs, dict):
        return []
    found = []
    for name, flag in FLAGS.items():
        if name in ours and name in theirs and theirs[name] != ours[name]:
            found.append(f"{flag} {_shown(theirs[name])} there, {_shown(ours[name])} here")
    return found


def refusal(peer: str, diffs: list[str]) -> str:
    """The one line for a peer refused for its settings."""
    flags = sorted({d.split()[0] for d in diffs})
    return (f"peer {peer} runs with other settings ({'; '.join(diffs)}); it is not admitted: start every peer "
            f"with the same {', '.join(flags)}")
