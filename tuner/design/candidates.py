"""Candidate whole-model shapes near a parameter budget, pruned by the paper's rules.

Anthony et al. (arXiv 2401.14489) guidelines, applied here as construction rules so that only
shapes worth measuring are generated (docs/design.md notation):

1. v divisible by 64: every candidate pads the vocabulary to the next multiple of 64;
3. h and h/a divisible by a high power of two: h is a multiple of 64 and the head dim is 64
   or 128 (more powers of two help up to 64; 128 is what FlashAttention-class kernels like);
5. SwiGLU: the best width near 8/3 h, not 8/3 h itself: the multiples of 64, 128 and 256
   nearest 8h/3 are all tried; a plain FFN keeps f = 4h, as GPT-NeoX does.

The starting shape (the user's model), if any, is always a candidate, whatever its rules say.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from tuner.design.params import DesignShape, Family, count_params
from tuner.errors import BadInput
from tuner.hardware.facts import next_multiple

Origin = Literal["start", "search"]
MAX_TARGET = 10**12  # a trillion parameters: beyond it the enumeration is not worth its time


@dataclass(frozen=True)
class Candidate:
    name: str  # stable, human-readable: "start" or "L12-h768-a12-f3072"
    shape: DesignShape
    params: int
    origin: Origin

    def __post_init__(self) -> None:
        if self.origin not in ("start", "search"):
            raise ValueError(f"origin must be start or search, not {self.origin!r}")
        if self.params != count_params(self.shape):
            raise ValueError(f"{self.name}: params {self.params} do not match the shape")


@dataclass(frozen=True)
class SearchSpace:
    target: int  # parameters
    layers: tuple[int, ...]
    vocab: int  # the user's vocabulary; candidates pad it to a multiple of 64
    family: Family
    tolerance: float = 0.05
    head_dims: tuple[int, ...] = (64, 128)
    hidden_multiple: int = 64
    kv_group: int = 1  # query heads per kv head (1: multi-head attention)
    max_candidates: int = 24

    def __post_init__(self) -> None:
        if not 0 < self.target <= MAX_TARGET:
            raise BadInput(f"the parameter target must be in (0, {MAX_TARGET:.0e}], "
                           f"not {self.target:,}")
        if not 0 < self.tolerance <= 0.5:
            raise BadInput(f"tolerance must be in (0, 0.5], not {self.tolerance}")
        if not self.layers or any(n <= 0 for n in self.layers):
            raise BadInput(f"layer counts must be positive, not {self.layers}")
        if self.vocab <= 0:
            raise BadInput(f"the vocabulary size must be positive, not {self.vocab}")
        if self.kv_group <= 0 or self.max_candidates <= 0:
            raise BadInput("kv group and max candidates must be positive")
        if not self.head_dims or any(d <= 0 for d in self.head_dims):
            raise BadInput(f"head dims must be positive, not {self.head_dims}")


def natural_layers(target: int, vocab: int, family: Family) -> int:
    """The depth of a GPT-3-like aspect ratio (h about 64 L) for the non-embedding budget:
    12 L h^2 = P - v h, solved by a few fixed-point steps (125M -> 12, 2.7B -> 37)."""
    layers = 12
    for _ in range(20):
        h = 64 * layers
        body = max(target - (1 if family.tied else 2) * vocab * h, 12 * 64 * 64)
        layers = max(1, round((body / (12 * 64 * 64)) ** (1 / 3)))
    return layers


def default_layers(target: int, vocab: int, family: Family, spread: float = 0.25,
                   most: int = 17) -> tuple[int, ...]:
    """Depths within +-spread of the natural one (at most `most` of them, evenly spaced):
    the search varies width at each depth."""
    mid = natural_layers(target, vocab, family)
    lo, hi = max(1, math.floor(mid * (1 - spread))), max(1, math.ceil(mid * (1 + spread)))
    step = max(1, math.ceil((hi - lo + 1) / most))
    return tuple(range(lo, hi + 1, step))


def ffn_widths(hidden: int, gated: bool) -> tuple[int, ...]:
    """FFN widths to try for hidden size h: 4h (plain); the multiples of 64/128/256 nearest
    8h/3 (SwiGLU), below and above."""
    if not gated:
        return (4 * hidden,)
    exact = 8 * hidden / 3
    widths = set()
    for m in (64, 128, 256):
        widths.add(max(m, math.floor(exact / m) * m))
        widths.add(next_multiple(math.ceil(exact), m))
    return tuple(sorted(widths))


def _name(s: DesignShape) -> str:
    kv = f"-kv{s.num_kv_heads}" if s.num_kv_heads != s.num_heads else ""
    return f"L{s.num_layers}-h{s.hidden_size}-a{s.num_heads}{kv}-f{s.ffn_size}"


def _shapes_at_depth(space: SearchSpace, layers: int, vocab: int) -> list[DesignShape]:
    lo, hi = space.target * (1 - space.tolerance), space.target * (1 + space.tolerance)
    found = []
    h = space.hidden_multiple
    while True:
        smallest = DesignShape(layers, h, 1, 1, h, 1, vocab, space.family)
        if count_params(smallest) > hi:  # params grow with h: nothing wider can fit
            break
        for d in space.head_dims:
            if h % d or (h // d) % space.kv_group:
                continue
            a = h // d
            for f in ffn_widths(h, space.family.ffn_gated):
                s = DesignShape(layers, h, a, a // space.kv_group, d, f, vocab, space.family)
                if lo <= count_params(s) <= hi:
                    found.append(s)
        h += space.hidden_multiple
    return found


def enumerate_candidates(space: SearchSpace, start: DesignShape | None = None) -> list[Candidate]:
    """Shapes within the tolerance of the target, by the rules above; at most
    `max_candidates` of them (those nearest the target first), plus the start shape."""
    vocab = next_multiple(space.vocab, 64)
    shapes = [s for n in sorted(set(space.layers)) for s in _shapes_at_depth(space, n, vocab)]
    if start is not None:
        shapes = [s for s in shapes if s != start]
    if not shapes and start is None:
        raise BadInput(_nothing_fits(space, vocab))
    shapes.sort(key=lambda s: (abs(count_params(s) - space.target), s.num_layers, s.hidden_size,
                               s.head_dim, s.ffn_size))
    kept = shapes[:space.max_candidates]
    kept.sort(key=lambda s: (s.num_layers, s.hidden_size, s.head_dim, s.ffn_size))
    out = ([Candidate(f"start:{_name(start)}", start, count_params(start), "start")]
           if start is not None else [])
    out += [Candidate(_name(s), s, count_params(s), "search") for s in kept]
    return out


def _nothing_fits(space: SearchSpace, vocab: int) -> str:
    tol = f"+-{space.tolerance:.0%}"
    tiny = DesignShape(min(space.layers), space.hidden_multiple, 1, 1, space.hidden_multiple, 1,
                       vocab, space.family)
    layers = (f"{space.layers[0]}" if len(space.layers) == 1
              else f"{min(space.layers)}..{max(space.layers)}")
    if count_params(tiny) > space.target * (1 + space.tolerance):
        return (f"no shape fits {space.target:,} parameters {tol}: even h={space.hidden_multiple} "
                f"with {layers} layers and vocabulary {vocab} has {count_params(tiny):,}")
    return (f"no shape with {layers} layers, h a multiple of {space.hidden_multiple} and head dim "
            f"in {space.head_dims} has {space.target:,} parameters {tol}: widen --tolerance or "
            f"change --layers")
