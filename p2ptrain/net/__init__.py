"""The network: frames, the handshake, TCP links, the mesh of links, beacons and discovery.

Sans-I/O: ``wire`` (frames, limits), ``auth`` (handshake, beacon tags), ``beacon`` (beacon
format and filter). I/O: ``transport`` (TCP listener and links), ``sender`` (how a link's
frames leave: ``sendmsg`` on the loop or a thread of the link), ``mesh`` (one link per pair of
peers that talk), ``discovery`` (UDP beacons, static peers), ``interfaces``.

May import: the base modules (``p2ptrain.errors``, ``identity``, ``trace``, ``device``, ``taskset``).
"""
