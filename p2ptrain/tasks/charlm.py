"""``charlm``, the default task: a small byte-level transformer language model (nanoGPT-style)
trained on text every machine already has, the Python standard library's own source.

``python -m p2ptrain join`` trains it; ``data=PATH`` trains on any text file or folder,
``model_size`` is ``tiny``, ``small`` (default, 0.86M parameters), ``medium``,
``large`` or a parameter count such as ``3m``.

Tokens are bytes (256 symbols), so every peer has the same vocabulary without exchanging
one. The last 5% of the corpus is held out for ``evaluate``; training windows are drawn at
random from the rest with a generator seeded by ``(seed, rank_seed)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from p2ptrain.errors import ConfigError
from p2ptrain.tasks._optim import fused_when_possible
from p2ptrain.tasks._task import Task, evaluating, parse_model_size, printable_text, seeded_generator
from p2ptrain.tasks._text import load_corpus

VOCAB = 256
HELD_OUT = 0.05
EVAL_WINDOWS = 32
SAMPLE_PROMPT = "def "
SAMPLE_CHARS = 200


@dataclass(frozen=True)
class CharLMConfig:
    context: int = 64
    width: int = 128
    layers: int = 4
    heads: int = 4


PRESETS = {  # (their names: ``_options.CHARLM_PRESETS``, checked before torch loads)
    "tiny": CharLMConfig(context=32, width=32, layers=2, heads=2),
    "small": CharLMConfig(),
    "medium": CharLMConfig(context=256, width=256, layers=6, heads=8),
    "large": CharLMConfig(context=256, width=512, layers=8, heads=8),
}
DEFAULT_PRESET = "small"


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then an MLP, each residual."""

    def __init__(self, cfg: CharLMConfig):
        super().__init__()
        self.heads = cfg.heads
        self.ln_attn = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=False)
        self.proj = nn.Linear(cfg.width, cfg.width, bias=False)
        self.ln_mlp = nn.LayerNorm(cfg.width)
        self.fc = nn.Linear(cfg.width, 4 * cfg.width, bias=False)
        self.fc_out = nn.Linear(4 * cfg.width, cfg.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).split(width, dim=2)
        q, k, v = (t.view(batch, time, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, time, width))
        return x + self.fc_out(F.gelu(self.fc(self.ln_mlp(x))))


class CharTransformer(nn.Module):
    """Bytes in, next-byte logits out: token + position embedding, blocks, LayerNorm, an untied head."""

    def __init__(self, cfg: CharLMConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(VOCAB, cfg.width)
        self.pos_emb = nn.Embedding(cfg.context, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, VOCAB, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                # GPT-2 init; residual projections scaled down so depth does not grow the stream
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("proj.weight", "fc_out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def config_for(model_size: str | int | None) -> CharLMConfig:
    """A preset by name, or 4 layers of the width that comes closest to a parameter count."""
    if model_size is None:
        return PRESETS[DEFAULT_PRESET]
    if str(model_size).lower() in PRESETS:
        return PRESETS[str(model_size).lower()]
    target = parse_model_size(model_size)
    context, layers = 256, 4
    # params ~ 12*layers*w^2 + (2*VOCAB + context)*w; solve for w, round to a multiple of 32
    linear = 2 * VOCAB + context
    width = (-linear + math.sqrt(linear ** 2 + 4 * 12 * layers * target)) / (2 * 12 * layers)
    width = max(32, int(round(width / 32)) * 32)
    return CharLMConfig(context=context, width=width, layers=layers, heads=width // 32)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> torch.Tensor:
    inputs, targets = (t.to(device, non_blocking=True) for t in batch)
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_task(options: dict) -> Task:
    """Build ``charlm`` from ``options`` (``seed``, ``data``, ``model_size``, ``batch_size``)."""
    cfg = config_for(options.get("model_size"))
    corpus = load_corpus(options.get("data"))
    tokens = torch.frombuffer(bytearray(corpus.text), dtype=torch.uint8)
    split = int(len(tokens) * (1 - HELD_OUT))
    train, held_out = tokens[:split], tokens[split:]
    if len(held_out) <= cfg.context + 1:
        need = int((cfg.context + 2) / HELD_OUT) + 1
        raise ConfigError(f"--data {options.get('data')}: {len(tokens)} bytes of text is too little for a context "
                          f"of {cfg.context}; give at least {need} bytes or a smaller --model-size (e.g. tiny)")
    seed = int(options.get("seed", 0))
    with torch.random.fork_rng(devices=[]):  # same initial weights on every peer, global RNG untouched
        torch.manual_seed(seed)
        model = CharTransformer(cfg)

    def windows(source: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = source[starts[:, None] + torch.arange(cfg.context + 1)].long()
        return rows[:, :-1], rows[:, 1:]

    def train_batches(rank_seed: int, world_hint: int, batch_size: int, seed: int) -> Iterator:
        gen = seeded_generator(seed, rank_seed, "charlm-train")
        while True:
            yield windows(train, torch.randint(0, len(train) - cfg.context, (batch_size,), generator=gen))

    # Evenly spaced windows over the held-out text: the same on every peer, no RNG needed.
    eval_starts = torch.linspace(0, len(held_out) - cfg.context - 1, EVAL_WINDOWS).long()
    eval_batch = windows(held_out, eval_starts)

    def evaluate(model: nn.Module, device: torch.device) -> float:
        with evaluating(model):
            total = sum(_loss(model, (x, y), device).item() * len(x)
                        for x, y in zip(eval_batch[0].split(16), eval_batch[1].split(16)))
        return total / EVAL_WINDOWS

    def sample(model: nn.Module, device: torch.device) -> str:
        gen = seeded_generator(seed, "charlm-sample")
        out = list(SAMPLE_PROMPT.encode())
        with evaluating(model):
            for _ in range(SAMPLE_CHARS):
                idx = torch.tensor([out[-cfg.context:]], device=device)
                # sample on the host with a CPU generator: the same text on every device kind
                probs = F.softmax(model(idx)[0, -1].float() / 0.8, dim=-1).cpu()
                out.append(int(torch.multinomial(probs, 1, generator=gen)))
        # (bytes that are not UTF-8 as \xNN, like control characters: printable, and telling)
        return printable_text(bytes(out).decode("utf-8", errors="backslashreplace"))

    count = sum(p.numel() for p in model.parameters())
    truncated = ", first part" if corpus.truncated else ""
    return Task(
        name="charlm",
        model=model,
        make_optimizer=lambda params, lr: fused_when_possible(torch.optim.AdamW, params, lr=lr, betas=(0.9, 0.99),
                                                             weight_decay=0.01),
        default_lr=1e-3,
        train_batches=train_batches,
        loss=_loss,
        batch_size=int(options.get("batch_size") or 32),
        batch_size_of=lambda batch: len(batch[0]),
        evaluate=evaluate,
        sample=sample,
        info=(f"charlm: byte-level transformer, {count:,} parameters ({cfg.layers} layers, width {cfg.width}, "
              f"context {cfg.context}); {len(tokens):,} bytes of {corpus.origin}{truncated} "
              f"(digest {corpus.digest}), 5% held out"),
    )
