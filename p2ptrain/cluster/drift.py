"""How far apart two replicas' parameters are, from a sketch of a few numbers each.

Why. Every member applies bit-identical averaged gradients, but through its own optimizer,
whose arithmetic rounds differently on another device kind (CUDA, MPS, CPU: fused kernels,
FMA). Measured, CUDA against CPU with AdamW: a relative L2 difference of 2.7e-8 after 10
steps and 8.3e-8 after 1,000, at float32 rounding level and growing slowly. Loading the
leader's state whenever the bits differ reloaded it every round. Instead replicas compare
sketches every few updates and correct (parameters only) once the drift passes TOLERANCE.

TOLERANCE, 1e-5 relative L2 per group of parameters: about 100 times the drift measured
after 1,000 steps, so rounding alone takes a very long run to reach it and corrections stay
rare; and about 100 times below a single optimizer update (AdamW moves each weight by about
its learning rate, 1e-4 to 1e-3, against weights of order 1e-2: 1e-2 relative), so replicas
within it train the same model for every purpose but bit equality. A replica whose drift
passes it (a bug, a dropped update, a nondeterministic kernel gone wrong) is corrected.

The sketch (``param_sketch``), per group of consecutive parameters (at most MAX_GROUPS, so
that it fits a frame header), computed on the parameters' device so that only those numbers
reach the host (no copy of the parameters):
- ``bits``: the sum of the raw bit patterns (16- or 32-bit words) in int64: exact and
  order-independent, so equal on any device for bit-identical parameters, and changed by one
  for a one-ulp change of one weight. Equal bits: the replicas are identical (and say so).
- ``count`` and ``norm2``: the number of elements and the sum of squares, in float64.
- K projections on fixed pseudo-random signs (the same on every peer), in float64: for a
  difference d between two replicas, each projection difference is a sample whose square has
  mean ||d||^2 (Johnson-Lindenstrauss), so K of them estimate ||d|| within a factor of about
  2 (K = 8: an estimate under a tenth of the truth has odds below 1e-3; the next comparison
  tries again). Float64 sums of float32 values carry about 1e-13 relative error here, a
  million times below the drift they measure, and the same on any device kind.
A group's drift is relative to its norm, or to FLOOR_RMS per element if that is more: a bias
still near zero is not corrected for a drift that no weight of the model could notice.

``compare`` is pure (numpy): two sketches in, a ``Drift`` out.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass

import numpy as np
import torch

TOLERANCE = 1e-5  # relative L2 per group above which a replica is corrected (see the module docstring)
K = 8  # sign projections per group
FLOOR_RMS = 1e-3  # a group's scale is at least this root-mean-square per element
MAX_GROUPS = 64  # groups of consecutive parameters in a sketch: (K + 3) * 8 bytes each, 5.5 KiB at most
_L = 256  # the sign pattern's period (elements)
_CHUNK = 1 << 20  # elements converted to float64 at a time (8 MiB of scratch on the device)
_ROW = K + 3  # bits, count, norm2, K projections


def _splitmix(n: int, salt: int) -> np.ndarray:
    """n pseudo-random +-1.0 from splitmix64 of the index: the same on every machine and version."""
    x = np.arange(n, dtype=np.uint64) + np.uint64(salt)
    with np.errstate(over="ignore"):
        x = x * np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return np.where(x & np.uint64(1), 1.0, -1.0)


# An element's sign in projection j is the product of three table entries: by its place in a
# row of _L (_COLS), by its row in the chunk (_ROWS), by its chunk (_CHUNKS): periodic only
# every _CHUNK * _MAX_CHUNKS elements, so a systematic drift (every weight one ulp up) is not
# summed coherently. Each tensor's projections are signed again by its index (_TENSORS).
_MAX_CHUNKS = 4096
_COLS = _splitmix(_L * K, 1).reshape(_L, K)
_ROWS = _splitmix((_CHUNK // _L) * K, 2).reshape(-1, K)
_CHUNKS = _splitmix(_MAX_CHUNKS * K, 3).reshape(-1, K)
_TENSORS = _splitmix(_MAX_CHUNKS * K, 4).reshape(-1, K)
_tables: dict = {}
_local = threading.local()


def _words(flat: torch.Tensor) -> torch.Tensor:
    """The raw bits of a flat tensor as signed integer words (int16 for 2-byte dtypes, else int32)."""
    size = flat.element_size()
    if size == 2:
        return flat.view(torch.int16)
    if size == 1:
        return flat.view(torch.int8)
    return flat.view(torch.int32)  # (8-byte dtypes: two words each)


def _on(work: torch.device, dtype: torch.dtype) -> tuple:
    key = (work, dtype)
    if key not in _tables:
        _tables[key] = tuple(torch.from_numpy(t).to(work, dtype) for t in (_COLS, _ROWS, _CHUNKS))
    return _tables[key]


def _scratch(work: torch.device, n: int) -> torch.Tensor:
    """This thread's float64 buffer on ``work`` of at least n elements (each peer's trainer
    thread has its own: two peers in one process sketch at once)."""
    buffers = _local.__dict__.setdefault("buffers", {})
    buf = buffers.get(work)
    if buf is None or buf.numel() < n:
        buf = buffers[work] = torch.empty(max(n, 1 << 16), dtype=torch.float64, device=work)
    return buf


def _tensor_stats(t: torch.Tensor, work: torch.device) -> torch.Tensor:
    """One tensor's (norm2, K projections), float64 on ``work``, a chunk at a time."""
    cols, rows_s, chunks_s = _on(work, torch.float64)
    flat = t.detach().reshape(-1)
    stats = torch.zeros(K + 1, dtype=torch.float64, device=work)
    scratch = _scratch(work, min(flat.numel(), _CHUNK))
    for c, start in enumerate(range(0, flat.numel(), _CHUNK)):
        part = scratch[:min(_CHUNK, flat.numel() - start)]
        part.copy_(flat[start:start + _CHUNK])  # (into a buffer kept: a fresh 8 MiB each time faults its pages in)
        whole = part.numel() - part.numel() % _L
        proj = torch.zeros(K, dtype=torch.float64, device=work)
        if whole:
            rows = part[:whole].view(-1, _L)
            proj += ((rows @ cols) * rows_s[:len(rows)]).sum(0)
        if whole < part.numel():
            tail = part[whole:]
            proj += (tail @ cols[:len(tail)]) * rows_s[len(part) // _L]
        stats[0] += part.dot(part)
        stats[1:] += proj * chunks_s[c % _MAX_CHUNKS]
    return stats


def _bits(t: torch.Tensor) -> int:
    """The int64 sum of a tensor's raw words (wrapping past 2**63 alike everywhere), as an int."""
    words = _words(t.detach().reshape(-1))
    if words.device.type == "cpu":
        return int(words.numpy().sum(dtype=np.int64))
    return words.sum(dtype=torch.int64)  # (a device scalar: read with the others, once)


def param_sketch(tensors) -> bytes:
    """The sketch of ``tensors`` (a model's parameters, in registration order): MAX_GROUPS
    groups at most, (K + 3) little-endian 8-byte numbers each. Works on their device, in
    float64 (on MPS, which has none, a chunk at a time is copied to the host): two small
    reads from the device, no copy of the parameters. On a CPU, about 40 ms per 36 MB on one
    loaded core, four times an xxh3 checksum: hence a comparison every few updates."""
    return start_sketch(tensors).result()


class SketchRead:
    """A sketch on its way from the device (``start_sketch``): ``ready()`` without waiting,
    ``result()`` the bytes (waiting for the copy if it is not done). On a CPU it is done at once."""

    def __init__(self, host: torch.Tensor | None, counts: np.ndarray, event=None):
        self._host, self._counts, self._event = host, counts, event  # host: (tensors, K + 2) float64
        self._bytes: bytes | None = None if host is not None else b""

    def ready(self) -> bool:
        return self._bytes is not None or self._event is None or self._event.query()

    def result(self) -> bytes:
        if self._bytes is None:
            if self._event is not None:
                self._event.synchronize()
            table = self._host.numpy()  # [bits (int64 bits in a float64 slot), norm2, K projections]
            n = len(table)
            signs = _TENSORS[np.arange(n) % _MAX_CHUNKS]
            rows = np.concatenate([table[:, :1], self._counts, table[:, 1:2], table[:, 2:] * signs], axis=1)
            self._bytes = _group(rows).tobytes()
            self._host = None
        return self._bytes


def start_sketch(tensors) -> SketchRead:
    """``param_sketch``, its numbers computed on the parameters' device now and read later: on
    CUDA they go by a non-blocking copy into pinned host memory, ordered on the stream after
    the kernels that compute them (an update applied after this call does not change them), so
    the caller's thread does not wait for the device; elsewhere the read is done at once."""
    tensors = [t for t in tensors]
    counts = np.array([[t.numel()] for t in tensors], dtype=np.float64)
    if not tensors:
        return SketchRead(None, counts)
    device = tensors[0].device
    work = device if device.type != "mps" else torch.device("cpu")
    with torch.no_grad():
        stats = torch.stack([_tensor_stats(t, work) for t in tensors])
        bits = [_bits(t) for t in tensors]
        if device.type == "cuda":
            words = torch.stack([b.reshape(()) for b in bits]).view(torch.float64).to(work)
            table = torch.cat([words[:, None], stats], dim=1)
            host = torch.empty(table.shape, dtype=torch.float64, pin_memory=True)
            host.copy_(table, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            return SketchRead(host, counts, event)
        if device.type != "cpu":
            bits = torch.stack([torch.as_tensor(b, device=device) for b in bits]).cpu().tolist()
        words = torch.from_numpy(np.array(bits, dtype=np.int64).view(np.float64)[:, None])
        return SketchRead(torch.cat([words, stats.cpu()], dim=1), counts)


def _group(rows: np.ndarray) -> np.ndarray:
    """Per-tensor rows summed into at most MAX_GROUPS groups of consecutive tensors."""
    n = len(rows)
    edges = np.linspace(0, n, min(n, MAX_GROUPS) + 1).astype(int)
    out = np.zeros((len(edges) - 1, _ROW), dtype="<f8")
    bits = rows[:, 0].copy().view(np.int64).astype(np.uint64)
    for g, (a, b) in enumerate(zip(edges[:-1], edges[1:])):
        out[g, 1:] = rows[a:b, 1:].sum(0)
        with np.errstate(over="ignore"):
            out[g, 0:1] = np.array([bits[a:b].sum(dtype=np.uint64)]).view("<f8")
    return out


@dataclass(frozen=True)
class Drift:
    """Two sketches compared: ``identical`` (every bit sum equal), and ``relative``: the largest
    estimated relative L2 difference of a group (0.0 when identical), ``group`` its index."""
    identical: bool
    relative: float
    group: int = 0

    @property
    def beyond(self) -> bool:
        """Past TOLERANCE: the replica should be corrected."""
        return self.relative > TOLERANCE


def decode(blob: bytes) -> np.ndarray:
    """A sketch's bytes as a (groups, K + 3) float64 array; ``ValueError`` if malformed."""
    if not isinstance(blob, (bytes, bytearray)) or not blob or len(blob) % (_ROW * 8) \
            or len(blob) > MAX_GROUPS * _ROW * 8:
        raise ValueError(f"a sketch must be 1 to {MAX_GROUPS} rows of {_ROW} 8-byte numbers")
    return np.frombuffer(bytes(blob), dtype="<f8").reshape(-1, _ROW)


def compare(mine: bytes, theirs: bytes) -> Drift:
    """How far our parameters are from theirs (``ValueError`` if the sketches do not match in
    shape: another model, or malformed). The estimate per group is the larger of the
    projections' (mean squared difference) and the norms' difference (a lower bound of it)."""
    a, b = decode(mine), decode(theirs)
    if a.shape != b.shape or not np.array_equal(a[:, 1], b[:, 1]):
        raise ValueError(f"sketches of {len(a)} and {len(b)} groups, or of other sizes: not the same model")
    if np.array_equal(a[:, 0].view(np.int64), b[:, 0].view(np.int64)):
        return Drift(True, 0.0)
    with np.errstate(invalid="ignore", over="ignore"):  # (a peer's NaN, a signalling one too, is inf below)
        norm_a, norm_b = np.sqrt(np.maximum(a[:, 2], 0.0)), np.sqrt(np.maximum(b[:, 2], 0.0))
        est = np.sqrt(np.mean((a[:, 3:] - b[:, 3:]) ** 2, axis=1))
        est = np.maximum(est, np.abs(norm_a - norm_b))
        scale = np.maximum(np.maximum(norm_a, norm_b), FLOOR_RMS * np.sqrt(np.maximum(a[:, 1], 1.0)))
        rel = np.where(est == 0, 0.0, est / scale)
    rel = np.where(np.isfinite(rel), rel, np.inf)  # (NaN or inf parameters: as far as can be)
    g = int(np.argmax(rel))
    return Drift(False, float(rel[g]), g)


def sketch_finite(sketch: bytes) -> bool:
    """Whether the sketched parameters are all finite: a group's sum of squares (float64, which
    no float32 value's square overflows) is NaN or inf where one of its values is."""
    return not sketch or bool(np.isfinite(decode(sketch)[:, 2]).all())


def sketch_checksum(sketch: bytes) -> str:
    """A hex digest of a sketch's bit sums: equal for bit-identical parameters on any device
    (the metrics' ``param_checksum`` once compared), and different for almost any change."""
    return hashlib.blake2b(decode(sketch)[:, 0].tobytes(), digest_size=16).hexdigest() if sketch else ""
