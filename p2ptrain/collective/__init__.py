"""The collective: the ring-allreduce, its schedule, and a static group of peers.

Sans-I/O: ``ring`` (which segment and chunk goes where at each step), ``chunk_header`` (what
a chunk's frame says and what a receiver accepts), ``digest`` (the result's 16 bytes, from its
chunks' hashes), ``linkpace`` (when a chunk goes raw). I/O: ``allreduce``
(runs one ring over links: encode, send, receive, decode, add), ``group`` (``p2ptrain.Group``:
a fixed set of peers and their ``allreduce``).

May import: the base modules, ``p2ptrain.codecs`` and ``p2ptrain.net``.
"""
