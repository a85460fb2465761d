"""``Codec`` and ``Encoded``: one gradient transform plus its optional zstd layer.

A codec turns a 1-D float32 chunk into a small msgpack-able ``params`` dict and a payload
(``Encoded``), and turns ``params`` + payload back into floats written into a caller's
array. The transforms (fp16, bf16, int8, top-k) live in their own modules; this one owns
what they share: input checks, the strict params schema, the zstd layer and its limits.

Failure behaviour: a payload or params that a peer sent and that do not validate raise
``CodecError`` and nothing else. A bad argument from our own caller (``x`` or ``out`` of
the wrong dtype or shape, or a chunk a lossy codec cannot represent: NaN, inf or
``|x| > 2**127``) raises ``ConfigError`` (that last, its ``NotFiniteError``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import numpy as np
import zstandard

from p2ptrain.errors import CodecError, ConfigError, NotFiniteError

F32 = np.dtype("<f4")
# Largest |x| a lossy codec accepts. Keeping a power of two of headroom below float32's
# max means no decoded value of an honest payload can round up to inf.
MAX_ABS = 2.0**127
# zstd is kept for a chunk only when it saves at least 10%; otherwise the raw bytes go.
# Level 1 costs ~1.4 ns per raw byte per hop (compress at the sender, decompress at the
# receiver; one 2020s x86 core) and a 1 Gbit/s link takes 8 ns per byte, so a smaller
# saving costs more CPU than it saves wire time, and the peers' cores (training, or shared
# by several peers) are the scarcer resource. Measured: int8 of dense layers' gradients
# or of Gaussian values saves 6-7% (skipped), of sparse ones (embedding rows) ~80%;
# top-k:0.01 payloads 15-30%.
ZSTD_PAYS = 0.90
# Payloads above _PROBE_OVER bytes first compress a _PROBE-byte slice from their middle;
# if that does not pay, the whole payload is not tried (a pure function of the payload, so
# encoding stays deterministic). Saves ~90% of the compress cost where zstd cannot pay.
# The caller may also skip zstd for a chunk (``zstd=False``): the ring does where its link
# keeps up with it, so that the bytes zstd would save cost no time (see
# ``collective.allreduce``). Either way the decoded values are the same.
_PROBE, _PROBE_OVER = 8192, 65536
# Levels 1..19 never use a window above 8 MiB; refusing larger windows bounds the memory
# a hostile frame header can make the decompressor ask for.
_MAX_WINDOW = 1 << 25


@dataclasses.dataclass(frozen=True, slots=True)
class Encoded:
    """One encoded chunk: header ``params`` and a payload split into ``buffers``.

    ``buffers`` are 1-D byte memoryviews; their concatenation is the payload and
    ``nbytes`` its length. For the identity codec the one buffer is a view of the input
    array itself (no copy): do not modify the input until the payload is sent.
    """

    params: dict[str, Any]
    buffers: list[memoryview]
    nbytes: int

    def tobytes(self) -> bytes:
        """The payload as one ``bytes`` (a copy; for tests and simple callers)."""
        return b"".join(self.buffers)


class Transform(Protocol):
    """What a codec's transform provides (private; see _dense, _int8, _topk)."""

    name: str
    params: dict[str, type]  # its own params and their exact types ("z" is added here)

    def max_raw(self, n: int) -> int: ...
    def raw_size(self, n: int, params: dict) -> int: ...  # validates params, raises CodecError
    def encode_raw(self, x: np.ndarray) -> tuple[dict, np.ndarray]: ...  # uint8 payload
    def decode_raw(self, n: int, params: dict, raw, out: np.ndarray) -> None: ...


def encodable(x: np.ndarray) -> bool:
    """Whether every codec can carry ``x``: no NaN or inf, nothing above 2**127 in magnitude
    (one pass and a copy: for the rare check, not for every chunk)."""
    return x.size == 0 or bool(np.abs(x).max() <= MAX_ABS)


def tensor_of(a: np.ndarray):
    """``a`` as a CPU tensor on the same memory, for torch's kernels: on the passes the
    codecs make (a per-block max, a multiply, a cast to int8 or fp16) they run 1.5-12x
    numpy's, with the same IEEE float32 results. A read-only array is copied (torch warns
    on one). torch is imported here, at first use: naming a codec (join's flags) stays
    free of its import."""
    import torch

    return torch.from_numpy(a if a.flags.writeable else a.copy())


class Scratch:
    """A float32 work array kept between calls (a codec instance serves one thread at a time)."""

    def __init__(self) -> None:
        self._a = np.empty(0, np.float32)

    def take(self, n: int) -> np.ndarray:
        if self._a.size < n:
            self._a = np.empty(n, np.float32)
        return self._a[:n]


def check_domain(name: str, absmax: float) -> None:
    """Refuse a chunk a lossy codec cannot carry (NaN compares false, so it is refused too)."""
    if not absmax <= MAX_ABS:
        raise NotFiniteError(
            f"cannot encode with {name}: the chunk holds NaN, inf or a value above 2**127 "
            "in magnitude; skip this step's gradient"
        )


def check_finite(x: np.ndarray) -> None:
    """Refuse NaN and inf in float32 values that go out as they are (``none``, a raw chunk),
    so that no peer's parameters take them: the round is left out everywhere, as with a lossy
    codec. One read (a dot product: NaN and inf propagate; finite values whose squares
    overflow are then looked at one by one)."""
    if x.size and not math.isfinite(float(np.dot(x, x))) and not bool(np.isfinite(x).all()):
        raise NotFiniteError("cannot send the chunk: it holds NaN or inf; skip this step's gradient")


def check_received(values: np.ndarray) -> None:
    """Refuse received float32 values that hold NaN or inf (``CodecError``): an honest sender's
    encode refuses them, so a peer that sends them is at fault (``check_finite``)."""
    try:
        check_finite(values)
    except NotFiniteError:
        raise CodecError("values with NaN or inf, which no honest peer sends") from None


def _check_array(x: Any, what: str) -> None:
    if not (isinstance(x, np.ndarray) and x.dtype == F32 and x.ndim == 1 and x.flags.c_contiguous):
        got = f"{type(x).__name__} {getattr(x, 'dtype', '')} {getattr(x, 'shape', '')}".strip()
        raise ConfigError(f"codec {what} must be a 1-D C-contiguous float32 numpy array, got {got}")


def _check_residual(x: np.ndarray, residual: Any, caller: str) -> None:
    _check_array(residual, "output")
    if residual.shape != x.shape or not residual.flags.writeable or (
            residual is x or np.may_share_memory(residual, x)):
        raise ConfigError(f"{caller} needs residual writeable, as long as x, and apart from it")


def _byte_view(payload: Any) -> memoryview:
    try:
        mv = memoryview(payload)
        if mv.ndim != 1 or mv.itemsize != 1:
            mv = mv.cast("B")
    except (TypeError, ValueError):
        mv = None
    if mv is None or not mv.contiguous:
        raise ConfigError("codec payload must be a contiguous bytes-like object")
    return mv


class Codec:
    """A gradient codec. Build one with ``parse_codec``; compare and print by ``spec``.

    Call order: the sender calls ``encode(x)`` (or ``encode_decoded(x, out)`` when it
    needs the decoded values itself) and ships ``params`` in the frame header and the
    buffers as the payload; the receiver checks the payload length against
    ``max_payload(n)`` before reading it, then calls ``decode(params, payload, out)``.
    Decoding the same bytes gives bit-identical floats on every machine (IEEE float32
    arithmetic only, no platform maths), provided no one enables flush-to-zero
    (``torch.set_flush_denormal(True)``), which changes results below 2**-126.

    A Codec instance holds zstd contexts and its transform's scratch arrays, which are
    not thread-safe: use one instance from one thread at a time (one per worker thread
    if several encode concurrently).
    Any instance decodes the payloads of any other with the same transform, whatever
    its zstd setting: whether zstd was applied travels in ``params["z"]``.
    """

    __slots__ = ("spec", "lossless", "is_identity", "_t", "_keys", "_cctx", "_dctx")

    def __init__(self, spec: str, transform: Transform | None, zstd_level: int | None = None):
        self.spec = spec
        self.is_identity = transform is None
        self.lossless = self.is_identity
        self._t = transform
        self._keys = {} if transform is None else {"z": bool, **transform.params}
        self._cctx = None if not zstd_level else zstandard.ZstdCompressor(level=zstd_level)
        self._dctx = None if transform is None else zstandard.ZstdDecompressor(max_window_size=_MAX_WINDOW)

    def __repr__(self) -> str:
        return f"parse_codec({self.spec!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    @property
    def name(self) -> str:
        """The transform's name (``int8``, ``topk``, ...; ``none``), as its errors say it."""
        return "none" if self._t is None else self._t.name

    @property
    def compiled(self) -> bool:
        """Whether its transform's passes run as compiled loops (``p2ptrain.jit``): a chunk's
        work then costs about what handing it to a thread and back does."""
        return bool(getattr(self._t, "compiled", False))

    @property
    def compresses(self) -> bool:
        """Whether it has a zstd layer (``+zstd``), which ``encode(..., zstd=False)`` may skip."""
        return self._cctx is not None

    def max_payload(self, n: int) -> int:
        """Upper bound on the payload length of an ``n``-value chunk (zstd only ever shrinks it)."""
        return 4 * n if self._t is None else self._t.max_raw(n)

    def encode(self, x: np.ndarray, zstd: bool = True) -> Encoded:
        """Encode one chunk. Pure and deterministic: the same ``x`` gives the same bytes.
        ``zstd=False``: no zstd layer for this chunk, whatever the codec's setting."""
        return self.encode_decoded(x, None, zstd)

    def encode_decoded(self, x: np.ndarray, out: np.ndarray | None, zstd: bool = True) -> Encoded:
        """``encode(x)``, and, unless ``out`` is None, ``decode(enc)`` written into ``out``.

        For the sender's own use (error feedback, the owner adopting its final sum): the
        floats are those every receiver decodes from these bytes, computed from the
        transform's raw payload without a zstd round trip or re-validation. ``out`` (1-D
        float32, the length of ``x``) may be ``x`` itself; any other overlap is refused.
        """
        _check_array(x, "input")
        if out is not None:
            _check_array(out, "output")
            if out.shape != x.shape or not out.flags.writeable or (
                    out is not x and np.may_share_memory(out, x)):
                raise ConfigError("encode_decoded needs out writeable, as long as x, and x itself or apart from it")
        if self._t is None:
            check_finite(x)
            if out is not None and out is not x:
                np.copyto(out, x)
            return Encoded({}, [memoryview(x).cast("B")], x.nbytes)
        params, raw, enc = self._encode_raw(x, zstd)
        if out is not None:
            with np.errstate(all="ignore"):
                self._t.decode_raw(x.shape[0], params, raw, out)
        return enc

    def _encode_raw(self, x: np.ndarray, zstd: bool, residual: np.ndarray | None = None
                    ) -> tuple[dict, np.ndarray, Encoded]:
        """The transform's (params, raw payload), and the chunk as sent (zstd where it pays).
        With ``residual``: ``x - decode`` written there (by the transform as it encodes, where
        it can: ``encodes_residual``; else afterwards, ``_residual``)."""
        if residual is not None and getattr(self._t, "encodes_residual", False):
            with np.errstate(all="ignore"):
                params, raw = self._t.encode_raw(x, residual)
        else:
            params, raw = self._t.encode_raw(x)
            if residual is not None:
                self._residual(params, raw, x, residual)
        return params, raw, self._sent(params, raw, zstd)

    def _sent(self, params: dict, raw: np.ndarray, zstd: bool) -> Encoded:
        """The transform's payload as it goes: zstd'd where asked and where that pays."""
        buf: Any = raw
        applied = False
        if zstd and self._cctx is not None and raw.nbytes and self._probe_pays(raw):
            packed = self._cctx.compress(raw)
            if len(packed) < ZSTD_PAYS * raw.nbytes:
                buf, applied = packed, True
        mv = memoryview(buf).cast("B")
        return Encoded({"z": applied, **params}, [mv], mv.nbytes)

    def encode_residual(self, x: np.ndarray, residual: np.ndarray, zstd: bool = True) -> Encoded:
        """``encode(x)``, and what it drops, ``x - decode(encode(x))``, written into
        ``residual`` (as long as ``x``, apart from it): what error feedback keeps. The same
        floats as decoding and subtracting; a sparse codec copies ``x`` and zeroes the kept
        values instead (one pass over the chunk, not three)."""
        return self._encode_keeping(x, residual, zstd, "encode_residual")[2]

    def encode_final(self, x: np.ndarray, residual: np.ndarray, zstd: bool = True) -> Encoded:
        """``encode_residual(x, residual)``, then ``x`` replaced by ``decode`` of the chunk: a
        segment's owner with error feedback, keeping what its final sum dropped and adopting
        the values every receiver decodes. The same floats as decoding into a scratch array,
        subtracting and copying back, in two passes over the chunk instead of four (the residual
        from ``x``, then the decode into ``x`` itself)."""
        params, raw, enc = self._encode_keeping(x, residual, zstd, "encode_final", writes_x=True)
        if self._t is not None:  # (the identity's decode is x itself)
            with np.errstate(all="ignore"):
                self._t.decode_raw(x.shape[0], params, raw, x)  # (raw is apart from x: its own buffer)
        return enc

    def _encode_keeping(self, x: np.ndarray, residual: np.ndarray, zstd: bool, caller: str, writes_x: bool = False
                        ) -> tuple[dict, Any, Encoded]:
        """``_encode_raw`` with the residual written, after the checks both callers share (the
        identity drops nothing: its residual is zeros). ``writes_x``: the caller writes x too."""
        _check_array(x, "input")
        if writes_x and not x.flags.writeable:
            raise ConfigError(f"{caller} writes the decoded values into x: it must be writeable")
        _check_residual(x, residual, caller)
        if self._t is None:
            residual.fill(0)
            return {}, None, self.encode_decoded(x, None)
        return self._encode_raw(x, zstd, residual)

    @property
    def fuses_add_encode(self) -> bool:
        """Whether ``add_encode`` is one pass over the chunk (int8's kernels)."""
        return bool(getattr(self._t, "fuses_add_encode", False))

    def add_encode(self, params: Any, payload: Any, dst: np.ndarray, residual: np.ndarray | None,
                   final: bool, zstd: bool = True) -> Encoded:
        """A reduce-scatter hop: ``dst`` plus ``decode(params, payload)`` encoded, with
        ``residual`` (as ``encode_residual``) what that drops written there. ``final`` (the sum
        is one of the caller's own segments'): ``dst`` then holds the decoded sum, as
        ``encode_final`` (or ``encode_decoded(dst, dst)``) leaves it; else ``dst`` is only read.
        One pass over ``dst`` where the transform fuses it (``fuses_add_encode``), three or four
        elsewhere; the same floats either way. A bad payload raises CodecError as ``decode_add``
        does (where fused, before anything is written); a sum that cannot be encoded raises as
        ``encode`` does."""
        if not self.fuses_add_encode:
            total = dst if final else dst.copy()
            self.decode_add(params, payload, total, np.empty_like(dst))
            if residual is None:
                return self.encode_decoded(total, total, zstd) if final else self.encode(total, zstd)
            return self.encode_final(total, residual, zstd) if final else self.encode_residual(total, residual, zstd)
        raw = self._validated_raw(params, payload, dst)
        if residual is not None:
            _check_residual(dst, residual, "add_encode")
        with np.errstate(all="ignore"):
            sum_params, sum_raw = self._t.add_encode_raw(dst.shape[0], params, raw, dst, residual, final)
        return self._sent(sum_params, sum_raw, zstd)

    def _residual(self, params: dict, raw, x: np.ndarray, residual: np.ndarray) -> None:
        """``residual = x - decode(raw)``, in one pass where the transform has one (``residual_raw``)."""
        with np.errstate(all="ignore"):
            residual_raw = getattr(self._t, "residual_raw", None)
            if residual_raw is not None:
                residual_raw(params, raw, x, residual)
            else:
                self._t.decode_raw(x.shape[0], params, raw, residual)
                np.subtract(x, residual, out=residual)

    def _probe_pays(self, raw: np.ndarray) -> bool:
        """False when a slice of a large payload shows zstd will not pay (see ``_PROBE``)."""
        if raw.nbytes <= _PROBE_OVER:
            return True
        mid = raw.nbytes // 2 - _PROBE // 2
        return len(self._cctx.compress(raw[mid : mid + _PROBE])) < ZSTD_PAYS * _PROBE

    def decode(self, params: Any, payload: Any, out: np.ndarray) -> None:
        """Decode ``payload`` into ``out`` (whose length is the chunk's ``n``).

        Raises ``CodecError`` for any params or payload that an honest encoder of this
        transform cannot have produced for ``n`` values; ``out`` is then left undefined.
        """
        raw = self._validated_raw(params, payload, out)
        if self._t is None:
            np.copyto(out, np.frombuffer(raw, F32))
            return
        # Hostile values may overflow or make NaN; that is the sender's business, and it
        # must not become a FloatingPointError under a caller's np.seterr(all="raise").
        with np.errstate(all="ignore"):
            self._t.decode_raw(out.shape[0], params, raw, out)

    def decode_add(self, params: Any, payload: Any, dst: np.ndarray, scratch: np.ndarray) -> None:
        """``dst += decode(payload)``: what a reduce-scatter hop does with what it receives.

        Sparse codecs add their kept values in place (no dense decode, no dense add);
        others decode into ``scratch`` (same length as ``dst``) and add. Same errors as
        ``decode``; ``dst`` is then left undefined."""
        add_raw = getattr(self._t, "add_raw", None)
        if add_raw is None:
            self.decode(params, payload, scratch)
            with np.errstate(all="ignore"):  # (a signalling NaN sent on purpose: ``decode``'s words)
                np.add(dst, scratch, out=dst)
            return
        raw = self._validated_raw(params, payload, dst)
        with np.errstate(all="ignore"):
            add_raw(dst.shape[0], params, raw, dst)

    def _validated_raw(self, params: Any, payload: Any, out: np.ndarray):
        """The transform's raw bytes for ``out``'s length, after every size and params check."""
        _check_array(out, "output")
        if not out.flags.writeable:
            raise ConfigError("codec output array must be writeable")
        n = out.shape[0]
        mv = _byte_view(payload)
        self._check_params(params)
        if self._t is None:
            if mv.nbytes != 4 * n:
                raise CodecError(f"none payload of {mv.nbytes} bytes for {n} values")
            return mv
        raw_len = self._t.raw_size(n, params)
        if params["z"]:
            return self._unzstd(mv, raw_len)
        if mv.nbytes != raw_len:
            raise CodecError(f"{self._t.name} payload of {mv.nbytes} bytes, expected {raw_len}")
        return mv

    def _check_params(self, params: Any) -> None:
        if not isinstance(params, dict) or params.keys() != self._keys.keys():
            raise CodecError(f"codec params must be a dict with exactly the keys {sorted(self._keys)}")
        for key, typ in self._keys.items():
            if type(params[key]) is not typ:
                raise CodecError(f"codec param {key!r} must be of type {typ.__name__}")

    def _unzstd(self, mv: memoryview, raw_len: int) -> bytes:
        # An honest sender uses zstd only when it shrinks the payload; the frame must
        # announce exactly raw_len bytes, so nothing larger is ever allocated.
        if not 0 < mv.nbytes < raw_len:
            raise CodecError(f"zstd payload of {mv.nbytes} bytes for {raw_len} raw bytes")
        try:
            announced = zstandard.frame_content_size(mv)
            if announced != raw_len:
                raise CodecError(f"zstd frame announces {announced} bytes, expected {raw_len}")
            raw = self._dctx.decompress(mv, max_output_size=raw_len, allow_extra_data=False)
        except zstandard.ZstdError:
            raise CodecError("payload is not one valid zstd frame") from None
        if len(raw) != raw_len:
            raise CodecError(f"zstd frame gave {len(raw)} bytes, expected {raw_len}")
        return raw
