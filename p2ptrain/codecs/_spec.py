"""The codec spec grammar and ``parse_codec``.

    SPEC  := BASE [ "+zstd" [":" LEVEL] | "+nozstd" ]
    BASE  := "none" | "fp16" | "bf16" | "int8" | "topk:" RATIO
    RATIO := a decimal number, 0 < RATIO <= 1 (e.g. 0.01, 1e-3), at least 1e-9
    LEVEL := 1..19

Case-insensitive; spaces around the whole spec and around each token are ignored.
zstd:1 is on by default for every BASE but none; "none" takes no zstd ("none+nozstd" is
accepted and means "none"). The canonical spec always names the zstd part, e.g.
"int8+zstd:1", "fp16+nozstd", "topk:0.01+zstd:1", "none".
"""

from __future__ import annotations

import re
from decimal import Decimal
from fractions import Fraction

from p2ptrain.codecs._codec import Codec
from p2ptrain.codecs._dense import BF16, FP16
from p2ptrain.codecs._int8 import Int8
from p2ptrain.codecs._topk import TopK
from p2ptrain.errors import ConfigError

CODEC_CHOICES = (
    "none, fp16, bf16, int8, topk:RATIO (0<RATIO<=1), optionally followed by "
    "+zstd[:LEVEL] (LEVEL 1..19, default +zstd:1) or +nozstd"
)
DEFAULT_ZSTD_LEVEL = 1
_LEVELS = range(1, 20)
_MIN_RATIO = Decimal("1e-9")
_RATIO = re.compile(r"(\d+\.?\d*|\.\d+)(e[+-]?\d+)?", re.ASCII)
_LEVEL = re.compile(r"\d{1,3}", re.ASCII)
_PLAIN = {"fp16": FP16, "bf16": BF16, "int8": Int8}


def _bad(spec: object, why: str = "") -> ConfigError:
    shown = repr(spec) if len(repr(spec)) <= 60 else repr(spec)[:57] + "..."
    why = f" ({why})" if why else ""
    return ConfigError(f"unknown compression {shown}{why}: choose one of {CODEC_CHOICES}")


def parse_codec(spec: str) -> Codec:
    """Build the codec a spec names; ``parse_codec(c.spec) == c``.

    Raises ``ConfigError`` (one line, listing the valid forms) for anything else.
    """
    if not isinstance(spec, str):
        raise _bad(spec, "a string is needed")
    base, plus, zpart = spec.strip().lower().partition("+")
    name, colon, arg = (part.strip() for part in base.partition(":"))
    zname, zcolon, zarg = (part.strip() for part in zpart.partition(":"))

    if plus and zname == "nozstd" and not zcolon:
        level = None
    elif plus and zname == "zstd":
        if zcolon and not (_LEVEL.fullmatch(zarg) and int(zarg) in _LEVELS):
            raise _bad(spec, "zstd LEVEL must be 1..19")
        level = int(zarg) if zcolon else DEFAULT_ZSTD_LEVEL
    elif plus:
        raise _bad(spec)
    else:
        level = DEFAULT_ZSTD_LEVEL

    if name == "none" and not colon:
        if plus and level is not None:
            raise _bad(spec, "none is raw float32 and takes no zstd")
        return Codec("none", None)
    if name in _PLAIN and not colon:
        transform = _PLAIN[name]()
        canonical = name
    elif name == "topk":
        ratio = _parse_ratio(arg) if colon else None
        if ratio is None:
            raise _bad(spec, "topk needs RATIO with 0<RATIO<=1, e.g. topk:0.01")
        transform = TopK(Fraction(ratio))
        canonical = f"topk:{ratio:f}"
    else:
        raise _bad(spec)
    zcanon = f"+zstd:{level}" if level else "+nozstd"
    return Codec(canonical + zcanon, transform, level)


def _parse_ratio(arg: str) -> Decimal | None:
    if not _RATIO.fullmatch(arg) or len(arg) > 32:
        return None
    ratio = Decimal(arg)
    if not _MIN_RATIO <= ratio <= 1:
        return None
    return ratio.normalize()
