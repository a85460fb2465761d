"""The cluster: numbered rounds over a changing view of peers, and state for joiners.

Sans-I/O: ``membership`` (peer table, views, liveness, chains), ``roundmsg`` (round
messages, typed as received, and the machine's actions), ``rounds`` holding its parts
``member``, ``leader`` (with ``refusals``), ``lineage`` and ``ending`` (the round state machine),
``snapshot`` (the state format), ``fingerprint`` (model identity, parameter checksums).
I/O: ``cluster`` (hosts the machine on a mesh; what it asks of its trainer: ``trainer_api``) with ``rings`` (``Round``, what one round
holds; each round's ring, its sum and error feedback's residual), ``records`` (rounds applied)
and ``reconcile`` (parameter checksums compared with the leader's), ``statesync`` (sends and
loads state snapshots).

May import: the base modules, ``p2ptrain.codecs``, ``p2ptrain.net`` and ``p2ptrain.collective``.
"""
