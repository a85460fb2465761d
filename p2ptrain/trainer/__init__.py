"""The trainer: what a training loop holds, turning gradients into rounds and rounds into updates.

``peer`` (``AsyncPeer``: accumulate, contribute, apply, within the staleness bound) with
``options`` (its keywords checked), ``accumulator``, ``contributions``, ``apply`` (one update
to the model), ``updates`` (applying them), ``solo`` (a peer alone), ``progress`` (metrics and
log lines) and ``prediction``; ``sync_peer`` (``Peer``: the same for
ordinary loops, its event loop on a ``loopthread``); ``distributed_optimizer`` (Horovod's
shape); ``checkpoint`` (saving and resuming).

May import: every layer below it (base, ``codecs``, ``net``, ``collective``, ``cluster``).
"""
