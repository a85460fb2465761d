"""The frame format. Pure code: bytes in, frames out; no I/O.

A frame is a fixed 16-byte prefix, a msgpack header and a raw payload::

    prefix  = magic "P2PT" | version u8 | flags u8 | header_len u16 | payload_len u64   (little-endian)
    header  = msgpack map with at least {"t": message type}
    payload = payload_len raw bytes (tensor data, compressed chunks, snapshots)

Every length is checked against its limit before anything is allocated, and a bad frame
raises ``FrameError`` and nothing else. The decoder is built for ``asyncio.BufferedProtocol``:
the transport asks ``get_buffer()`` where to put the next bytes, and a payload is received
straight into the buffer its ``allocate`` callback hands out (zero copies in Python).

Call order: ``buf = dec.get_buffer()``; write n bytes into ``buf[:n]``; ``dec.buffer_updated(n)``;
then drain ``dec.pop_frames()``. ``feed(data)`` does the three steps for tests and fuzzers.
After a ``FrameError`` the decoder is dead: close the connection. A decoder made with
``admitted=False`` (a link whose handshake runs) takes frames without payload only; one that
announces a payload leaves it ``held`` (stop reading: ``get_buffer`` has no room) until
``admit()``, which a legitimate peer's first frame after the handshake may need.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import msgpack

from p2ptrain.errors import FrameError

MAGIC = b"P2PT"
PROTOCOL_VERSION = 8  # 2: a round's ring runs in buckets (ring.bucket_bounds), so 1 and 2 cannot share rings;
#                     3: small segments are cut into fewer chunks (ring.MIN_CHUNK_ELEMS 128 K values, was 16 K);
#                     4: a lossy codec's chunk may come raw (header "raw": collective.linkpace);
#                     5: DONE says why a ring failed with nobody at fault ("void", was "withdrawn")
#                     6: model fingerprints say which parameters train (four fields, were three)
#                     7: the handshake's proofs name their role; the listener proves after the dialer (auth)
#                     8: START and COMMIT carry the members' spread of samples (``roundmsg.spread_of``),
#                        by which rounds by time may scale their mean (``LocalSteps.divisor``)
PREFIX = struct.Struct("<4sBBHQ")
PREFIX_SIZE = PREFIX.size  # 16

# Security limits: a header is small metadata; a payload is at most one chunk or one snapshot part.
MAX_HEADER_BYTES = 16 * 1024
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 30
# Before the handshake admits a peer nothing it sends has a payload (the handshake has none): a
# frame that announces one is held at its 16-byte prefix, unread and unallocated, until the link
# is admitted (``FrameDecoder.admit``), and a stranger's is closed with its handshake.
PENDING_MAX_PAYLOAD_BYTES = 0

# Message types (the header's "t").
HELLO = "hello"
PROOF = "proof"
WELCOME = "welcome"
REJECT = "reject"
CHUNK = "chunk"
BYE = "bye"
STATE = "state"  # state transfer: see p2ptrain.cluster.statesync
PING = "ping"  # keepalive: a link that carries nothing else still shows its peer alive
KEEPALIVE = 0.5  # seconds between a link's pings (``net.mesh``): the longest a live peer is quiet (``cluster.silence``)
STARTTLS = "starttls"  # the first frame each way on a link with TLS, before the handshake: see p2ptrain.net.tls

Allocator = Callable[[dict, int], memoryview]


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded frame. ``payload`` is a view of the buffer the allocator gave out."""

    header: dict
    payload: memoryview

    @property
    def type(self) -> str:
        return self.header["t"]


def default_allocate(header: dict, size: int) -> memoryview:
    return memoryview(bytearray(size))


def pack_header(header: dict, payload_len: int = 0) -> bytes:
    """Prefix + header bytes of a frame whose payload (``payload_len`` bytes) follows separately."""
    body = msgpack.packb(header, use_bin_type=True)
    if len(body) > MAX_HEADER_BYTES:
        raise ValueError(f"frame header of {len(body)} bytes exceeds {MAX_HEADER_BYTES}")
    return PREFIX.pack(MAGIC, PROTOCOL_VERSION, 0, len(body), payload_len) + body


def encode_frame(header: dict, payload: Iterable[Any] = ()) -> list:
    """The buffers of one frame, payload buffers passed through uncopied (for ``writelines``)."""
    parts = [memoryview(p).cast("B") for p in payload]
    size = sum(p.nbytes for p in parts)
    return [pack_header(header, size), *[p for p in parts if p.nbytes]]


def frame_bytes(header: dict, payload: bytes = b"") -> bytes:
    """One frame as bytes (tests, small control messages)."""
    return b"".join(bytes(b) for b in encode_frame(header, [payload] if payload else []))


def unpack_header(body: bytes | memoryview) -> dict:
    """Decode and validate a msgpack header. Raises FrameError on anything else."""
    try:
        header = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_HEADER_BYTES,
            max_bin_len=MAX_HEADER_BYTES,
            max_array_len=4096,
            max_map_len=256,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises a zoo of types: all mean "not a header"
        raise FrameError(f"undecodable frame header ({type(exc).__name__})") from None
    if not isinstance(header, dict) or not isinstance(header.get("t"), str):
        raise FrameError("frame header is not a map with a message type")
    return header


class FrameDecoder:
    """Incremental frame parser. See the module docstring for the call order."""

    def __init__(self, max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES, allocate: Allocator = default_allocate, *,
                 admitted: bool = True):
        self.max_payload = max_payload
        self.allocate = allocate
        self._admitted = admitted
        self._held = False  # a prefix announcing a payload before admission: nothing more is read
        # Prefix and header are read into a scratch area; a payload goes to its own buffer.
        self._scratch = bytearray(PREFIX_SIZE + MAX_HEADER_BYTES)
        self._scratch_view = memoryview(self._scratch)
        self._have = 0  # valid bytes in scratch
        self._need = PREFIX_SIZE  # bytes scratch must hold before the next parse step
        self._header_len = -1
        self._header: dict | None = None
        self._payload: memoryview | None = None
        self._payload_have = 0
        self._frames: list[Frame] = []
        self._dead = False
        self.received = 0  # bytes taken in so far (a link that takes none for long is idle: ``mesh``)

    @property
    def held(self) -> bool:
        """A frame announced a payload before admission: stop reading until ``admit()``."""
        return self._held

    def admit(self) -> None:
        """The peer passed the handshake: payloads up to ``max_payload`` from now on, and the
        held frame (if any) goes on (its length was checked against ``max_payload`` already)."""
        self._admitted = True
        if self._held:
            self._held = False
            self._advance()

    # -- BufferedProtocol side ------------------------------------------------------------
    def get_buffer(self) -> memoryview:
        """Where the next received bytes go: the payload's remaining space, or scratch
        (no room while ``held``)."""
        if self._dead:
            raise FrameError("frame decoder used after a protocol error")
        if self._held:
            return self._scratch_view[self._have : self._have]
        if self._payload is not None:
            return self._payload[self._payload_have :]
        # Scratch: read only up to what the current step needs, so that no payload bytes
        # land here and need a copy (one recv per small step is cheap next to a copy of MBs).
        return self._scratch_view[self._have : self._need]

    def buffer_updated(self, nbytes: int) -> None:
        """Account for ``nbytes`` written into the last ``get_buffer()``; parse what is complete."""
        self.received += nbytes
        try:
            if self._payload is not None:
                self._payload_have += nbytes
                if self._payload_have == len(self._payload):
                    self._finish_frame()
                return
            self._have += nbytes
            self._advance()
        except FrameError:
            self._dead = True
            raise

    def pop_frames(self) -> list[Frame]:
        frames, self._frames = self._frames, []
        return frames

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Push bytes through get_buffer/buffer_updated; return the frames completed. A ``held``
        decoder takes nothing more (the rest of ``data`` is left, as a link stops reading)."""
        view = memoryview(data).cast("B")
        while view.nbytes and not self._held:
            buf = self.get_buffer()
            n = min(len(buf), view.nbytes)
            buf[:n] = view[:n]
            view = view[n:]
            self.buffer_updated(n)
        return self.pop_frames()

    @property
    def payload_left(self) -> int:
        """Bytes of the current frame's payload still to come (0 outside a payload)."""
        return 0 if self._payload is None else len(self._payload) - self._payload_have

    @property
    def idle(self) -> bool:
        """True between frames (nothing partial buffered): a clean place for the peer to stop."""
        return self._payload is None and self._have == 0

    # -- parsing --------------------------------------------------------------------------
    def _advance(self) -> None:
        while self._have >= self._need:
            if self._header_len < 0:
                self._parse_prefix()
                if self._held:
                    return
            elif self._header is None:
                self._parse_header()
                return
            else:  # unreachable: a header always moves to a payload or finishes the frame
                return

    def _parse_prefix(self) -> None:
        magic, version, flags, header_len, payload_len = PREFIX.unpack_from(self._scratch, 0)
        if magic != MAGIC:
            raise FrameError("not a p2ptrain peer (bad magic)")
        if version != PROTOCOL_VERSION:
            raise FrameError(
                f"peer speaks protocol version {version}, this peer speaks {PROTOCOL_VERSION}: "
                "run the same p2ptrain version everywhere", peer_version=version,
            )
        if flags != 0:
            raise FrameError(f"unknown frame flags {flags:#x}")
        if header_len == 0 or header_len > MAX_HEADER_BYTES:
            raise FrameError(f"frame header length {header_len} outside 1..{MAX_HEADER_BYTES}")
        if payload_len > self.max_payload:
            raise FrameError(f"frame payload of {payload_len} bytes exceeds the limit of {self.max_payload}")
        self._header_len = header_len
        self._payload_len = payload_len
        self._need = PREFIX_SIZE + header_len
        self._held = not self._admitted and payload_len > PENDING_MAX_PAYLOAD_BYTES

    def _parse_header(self) -> None:
        self._header = unpack_header(self._scratch_view[PREFIX_SIZE : self._need])
        size = self._payload_len
        if size == 0:
            self._payload = memoryview(b"")
            self._finish_frame()
            return
        buf = self.allocate(self._header, size)
        if buf.nbytes != size or buf.readonly:
            raise ValueError(f"allocator returned {buf.nbytes} bytes for a payload of {size}")  # our bug
        self._payload = buf.cast("B") if buf.format != "B" else buf
        self._payload_have = 0

    def _finish_frame(self) -> None:
        self._frames.append(Frame(self._header, self._payload))
        self._header = None
        self._payload = None
        self._payload_have = 0
        self._header_len = -1
        self._have = 0
        self._need = PREFIX_SIZE
