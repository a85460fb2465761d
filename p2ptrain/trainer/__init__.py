"""The trainer: what a training loop holds, turning gradients into rounds and rounds into updates.

``peer`` (``AsyncPeer``: accumulate, contribute, apply, within the staleness bound) holding its
three parts, ``lifetime`` (its loop thread, open or closed: what both front ends drive),
``contributions`` (what the cluster calls, on its thread) and ``updates`` (applying
them, state loads, checkpoints), with ``options`` (its keywords checked), ``accumulator``,
``apply`` (one update to the model), ``step_checks`` (what ``step`` refuses), ``solo`` (a peer alone), ``progress`` (metrics and log
lines) and ``prediction``; ``sync_peer`` (``Peer``: the same for
ordinary loops, blocking on the same ``lifetime``; the event loop on a ``loopthread``); ``distributed_optimizer`` (Horovod's
shape); ``checkpoint`` (saving and resuming).

May import: every layer below it (base, ``codecs``, ``net``, ``collective``, ``cluster``).
"""
