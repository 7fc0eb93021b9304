"""Compose the exact rewrites: a pure graph edit (the `tuner pad` job is tuner.jobs.pad).

    req = PadRequest.from_multiples(shape, ffn_multiple=64, vocab_multiple=64)
    model, transforms = apply(model, shape, req)  # [Transform("vocab", 50257, 50304), ...]

The hidden size is never padded (LayerNorm/RMSNorm statistics would change); asking for it
is refused with that reason.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import onnx_ir as ir

from tuner.errors import BadInput, RewriteRefused
from tuner.graph.paddable import (BY_KIND, PADDABLE, Transform, unpadded_kinds,
                                  unpadded_reason)
from tuner.graph.shape import ModelShape
from tuner.rewrite.axis.cache import POLICIES as CACHE_POLICIES
from tuner.rewrite.common import remove_unused
from tuner.rewrite.ffn import pad_ffns
from tuner.rewrite.head_dim import pad_head_dim
from tuner.rewrite.heads import pad_heads
from tuner.rewrite.transposed_weights import fold_transposed_weights
from tuner.rewrite.vocab import pad_vocab

HIDDEN_REFUSAL = ("the hidden size is never padded: LayerNorm/RMSNorm statistics (mean and "
                  "variance over the hidden axis) would change, so the outputs would too")


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _check_positive(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise BadInput(f"{name} must be a positive integer, not {value!r}")


@dataclass(frozen=True)
class PadRequest:
    """Target sizes (None: leave as is). Each must be >= the model's own size."""

    ffn_size: int | None = None
    vocab_size: int | None = None
    head_dim: int | None = None
    num_heads: int | None = None
    # What head-dim / head-count padding does to a KV cache (docs/design.md): "keep" its shape
    # (padded inside the graph, present sliced back) or "widen" the cache interface.
    cache_policy: str = "keep"

    def __post_init__(self) -> None:
        for dim in BY_KIND.values():
            _check_positive(dim.field, getattr(self, dim.field))
        if self.cache_policy not in CACHE_POLICIES:
            raise BadInput(f"cache policy must be one of {'|'.join(CACHE_POLICIES)}, "
                           f"not {self.cache_policy!r}")

    @classmethod
    def from_multiples(cls, shape: ModelShape, ffn_multiple: int | None = None,
                       vocab_multiple: int | None = None, head_dim: int | None = None,
                       heads: int | None = None, hidden_multiple: int | None = None,
                       cache_policy: str = "keep") -> "PadRequest":
        """Round the model's FFN width and vocabulary up to multiples; head dim and head count
        are absolute targets. Sizes already aligned stay None (nothing to do)."""
        for name, v in (("ffn_multiple", ffn_multiple), ("vocab_multiple", vocab_multiple),
                        ("hidden_multiple", hidden_multiple), ("head_dim", head_dim),
                        ("heads", heads)):
            _check_positive(name, v)
        if hidden_multiple is not None and shape.hidden_size % hidden_multiple:
            raise RewriteRefused(f"hidden size {shape.hidden_size}: {HIDDEN_REFUSAL}")
        ffn = round_up(shape.ffn_size, ffn_multiple) if ffn_multiple and shape.ffn_size else None
        vocab = (round_up(shape.vocab_size, vocab_multiple)
                 if vocab_multiple and shape.vocab_size else None)
        if vocab_multiple and not shape.vocab_size:
            raise RewriteRefused("--vocab-multiple: the model has no LM head (an encoder?)")
        return cls(ffn_size=ffn if ffn and ffn != shape.ffn_size else None,
                   vocab_size=vocab if vocab and vocab != shape.vocab_size else None,
                   head_dim=head_dim if head_dim is not None and head_dim != shape.head_dim
                   else None,
                   num_heads=heads if heads is not None and heads != shape.num_heads else None,
                   cache_policy=cache_policy)

    @property
    def empty(self) -> bool:
        return all(getattr(self, dim.field) is None for dim in BY_KIND.values())

    @classmethod
    def from_pads(cls, pads: dict[str, int], cache_policy: str = "keep") -> "PadRequest":
        """From {transform kind: new size}, as a planned candidate carries them."""
        return cls(**{BY_KIND[kind].field: size for kind, size in pads.items()},
                   cache_policy=cache_policy)


def _vocab(model: ir.Model, shape: ModelShape, new: int, cache_policy: str) -> int:
    return pad_vocab(model.graph, shape.sites, new)  # the KV cache is not touched


def _ffn(model: ir.Model, shape: ModelShape, new: int, cache_policy: str) -> int:
    ffns = [(i, layer.ffn) for i, layer in enumerate(shape.sites.layers) if layer.ffn]
    if not ffns:
        raise RewriteRefused("no FFN block found to pad")
    olds = sorted(set(pad_ffns(model, ffns, new)))
    return new if olds == [new] else olds[0]  # the narrowest, if layers differ


# One exact rewrite per padded dimension (tuner.graph.paddable.PADDABLE), applied in that
# table's order: each takes the model, its shape so far, the new size and the KV-cache policy
# (tuner.rewrite.axis.cache), edits the model in place and returns the old size.
Rewrite = Callable[[ir.Model, ModelShape, int, str], int]
REWRITES: dict[str, Rewrite] = {"ffn": _ffn, "vocab": _vocab, "head_dim": pad_head_dim,
                                "heads": pad_heads}


def apply(model: ir.Model, shape: ModelShape, req: PadRequest) -> tuple[ir.Model, list[Transform]]:
    """Apply the requested rewrites to `model` (edited in place and returned) and list them.

    Raises RewriteRefused (naming the node) on a pattern a rewrite does not understand."""
    refused = [d for d in PADDABLE if d.kind in unpadded_kinds(shape)
               and getattr(req, d.field) is not None]
    if refused:
        raise RewriteRefused(f"{refused[0].kind}: {unpadded_reason(shape)}; its FFN width and "
                             "vocabulary are padded (--ffn-multiple, --vocab-multiple)")
    done: list[Transform] = []
    fold_transposed_weights(model)  # torch's unoptimized export: W stored (out, in)
    for dim in PADDABLE:
        new = getattr(req, dim.field)
        if new is None:
            continue
        old = REWRITES[dim.kind](model, shape, new, req.cache_policy)
        if old != new:
            done.append(Transform(dim.kind, old, new))
        # later rewrites see the padded size (node names are unchanged)
        shape = dataclasses.replace(shape, **{dim.field: new})
    remove_unused(model)
    return model, done
