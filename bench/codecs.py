"""Codec benchmark: compression ratio, error (one pass and through a ring), speed per core.

    python bench/codecs.py            # real transformer gradients (~5M values) + synthetic, ~1-2 min
    python bench/codecs.py --quick    # a few seconds; the CI smoke test

Prints one Markdown table per data set. Columns:

- ratio: fp32 bytes / payload bytes, over the whole vector cut into chunks.
- err 1 pass: relative L2 error ||decode(encode(x)) - x|| / ||x||.
- err ring N: a pure simulation of one segment through a ring of N peers: reduce-scatter
  hops (each peer decodes, adds its own contribution, re-encodes), then the owner's
  final encode that every peer decodes: N lossy passes in all. Relative L2 error against
  the exact float64 sum of the N contributions. No error feedback.
- enc / dec MB/s: float32 input bytes per second, one thread, best of several runs on
  one chunk of the given size (1 and 4 MiB); best-of because the machine may be shared,
  and the question is what one core can do.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np

from p2ptrain.codecs import Codec, parse_codec

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

BASES = ["fp16", "bf16", "int8", "topk:0.01", "topk:0.001"]
SPECS = ["none"] + [b + z for b in BASES for z in ("+zstd:1", "+nozstd")]
RINGS = (3, 8)


def real_gradients(count: int, quick: bool, seed: int) -> list[np.ndarray]:
    """Gradients of a small causal transformer LM, after some training, on `count` batches.

    The data is a sparse random Markov chain (each token has 4 likely successors), so the
    model has structure to learn and its gradients look like real ones: dense blocks,
    sparse embedding rows, LayerNorm parameters.
    """
    import torch
    from torch import nn

    torch.manual_seed(seed)
    vocab, d, layers, seq, batch, steps = (512, 64, 2, 32, 8, 3) if quick else (4096, 256, 4, 64, 16, 30)
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(vocab, (vocab, 4), generator=gen)

    def sample() -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.empty(batch, seq + 1, dtype=torch.long)
        t[:, 0] = torch.randint(vocab, (batch,), generator=gen)
        for i in range(seq):
            t[:, i + 1] = successors[t[:, i], torch.randint(4, (batch,), generator=gen)]
        return t[:, :-1], t[:, 1:]

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
            layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(d, vocab)

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            mask = nn.Transformer.generate_square_subsequent_mask(t.shape[1])
            return self.head(self.body(self.emb(t) + self.pos, mask=mask, is_causal=True))

    model = LM()

    def backward() -> None:
        x, y = sample()
        model.zero_grad()
        nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()

    for _ in range(steps):  # plain SGD by hand: torch.optim would import torch._dynamo (~2 s)
        backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    grads = []
    for _ in range(count):
        backward()
        flat = torch.cat([p.grad.flatten() for p in model.parameters()])
        grads.append(flat.numpy().astype(np.float32))
    return grads


def synthetic(kind: str, count: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if kind == "t":
        return [(rng.standard_t(2.5, n) * 1e-3).astype(np.float32) for _ in range(count)]
    if kind == "rows":  # an embedding's gradient: only the rows of the batch's tokens are non-zero
        out = []
        for _ in range(count):
            x = (rng.standard_normal((n // 256, 256)) * 1e-3).astype(np.float32)
            x[rng.random(n // 256) >= 1 / 64] = 0
            out.append(x.ravel())
        return out
    return [(rng.standard_normal(n) * 1e-3).astype(np.float32) for _ in range(count)]


def through(codec: Codec, x: np.ndarray, chunk: int) -> tuple[np.ndarray, int]:
    """decode(encode(x)) chunk by chunk, as the collective cuts a segment; and the bytes sent."""
    out = np.empty_like(x)
    sent = 0
    for lo in range(0, x.size, chunk):
        enc = codec.encode(x[lo : lo + chunk])
        payload = enc.buffers[0] if len(enc.buffers) == 1 else b"".join(enc.buffers)
        codec.decode(enc.params, payload, out[lo : lo + chunk])
        sent += enc.nbytes
    return out, sent


def rel_err(y: np.ndarray, exact: np.ndarray) -> float:
    exact = exact.astype(np.float64, copy=False)
    return float(np.linalg.norm(y - exact) / np.linalg.norm(exact))


def through_ring(codec: Codec, contributions: list[np.ndarray], exact: np.ndarray, chunk: int) -> float:
    """Relative error of one segment's sum after N-1 reduce-scatter hops and the owner's encode."""
    acc = contributions[0].copy()
    for g in contributions[1:]:
        acc, _ = through(codec, acc, chunk)
        acc += g
    final, _ = through(codec, acc, chunk)
    return rel_err(final, exact)


def exact_sum(contributions: list[np.ndarray]) -> np.ndarray:
    total = np.zeros(contributions[0].size)
    for g in contributions:
        total += g
    return total


def speed(codec: Codec, x: np.ndarray, reps: int) -> tuple[float, float]:
    """Encode and decode MB/s of float32 input for one chunk (best of reps, one thread)."""
    out = np.empty_like(x)
    enc = codec.encode(x)
    payload = enc.tobytes()
    t_enc, t_dec = [], []
    for _ in range(reps):
        start = time.perf_counter()
        codec.encode(x)
        t_enc.append(time.perf_counter() - start)
        start = time.perf_counter()
        codec.decode(enc.params, payload, out)
        t_dec.append(time.perf_counter() - start)
    return x.nbytes / min(t_enc) / 1e6, x.nbytes / min(t_dec) / 1e6


def fmt_speed(codec: Codec, mbs: float, encode: bool) -> str:
    return "zero-copy" if codec.is_identity and encode else f"{mbs:,.0f}"


def table(name: str, data: list[np.ndarray], chunks_mib: list[float], reps: int) -> str:
    x = data[0]
    chunk_values = [int(c * _common.MiB) // 4 for c in chunks_mib]
    big = max(chunk_values)
    speed_cols = [f"{w} MB/s @{c:g} MiB" for w in ("enc", "dec") for c in chunks_mib]
    header = ["codec", "ratio", "err 1 pass"] + [f"err ring N={n}" for n in RINGS] + speed_cols
    exacts = {n: exact_sum(data[:n]) for n in RINGS}
    rows = []
    for spec in SPECS:
        codec = parse_codec(spec)
        y, sent = through(codec, x, big)
        row = [f"`{spec}`", f"{x.nbytes / sent:.2f}", f"{rel_err(y, x):.2e}"]
        row += [f"{through_ring(codec, data[:n], exacts[n], big):.2e}" for n in RINGS]
        speeds = [speed(codec, np.ascontiguousarray(x[:c]), reps) for c in chunk_values]
        row += [fmt_speed(codec, s[0], True) for s in speeds] + [fmt_speed(codec, s[1], False) for s in speeds]
        rows.append(row)
    title = f"### {name}: {x.size:,} values, {len(data)} contributions, chunks of {_common.fmt_size(big * 4)}"
    return title + "\n\n" + _common.table(rows, header)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small data, few repeats (a few seconds)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)  # (fp16 and int8 run torch's kernels: one thread, as the columns say)
    count = max(RINGS)
    if args.quick:
        n, chunks, reps = 1 << 17, [0.5], 3
    else:
        n, chunks, reps = 1 << 22, [1.0, 4.0], 15
    started = time.perf_counter()
    sets = [
        ("real gradients (causal transformer LM, trained a few steps)", real_gradients(count, args.quick, args.seed)),
        ("synthetic heavy-tailed (Student-t, 2.5 dof, x1e-3)", synthetic("t", count, n, args.seed)),
        ("synthetic Gaussian (x1e-3)", synthetic("gauss", count, n, args.seed)),
        ("synthetic sparse rows (an embedding's gradient: 1 row of 256 in 64 non-zero)",
         synthetic("rows", count, n, args.seed)),
    ]
    print(f"# p2ptrain codec benchmark{' (--quick)' if args.quick else ''}\n")
    print(f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}, "
          f"{platform.processor() or platform.platform()}; one thread per measurement\n")
    for name, data in sets:
        print(table(name, data, chunks, reps) + "\n")
    print(f"_total {time.perf_counter() - started:.1f} s_")


if __name__ == "__main__":
    main()
