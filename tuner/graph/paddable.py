"""The dimensions an exact rewrite can pad, in one table, and the record of one rewrite.

A new padded dimension is a row here (its transform kind, the ModelShape / PadRequest field it
changes, the GEMMs of the probe it moves), its rewrite module, and that module's test.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Paddable:
    """One dimension an exact rewrite can pad."""

    kind: str  # the Transform kind, and the name's prefix of a variant ("ffn-640")
    field: str  # the tuner.graph.shape.ModelShape field, and the PadRequest field
    gemms: tuple[str, ...]  # the GEMM labels of tuner.plan.probe.model_gemms it changes


PADDABLE = (
    Paddable("ffn", "ffn_size", ("up", "gate", "down")),
    Paddable("vocab", "vocab_size", ("lm_head",)),
    Paddable("head_dim", "head_dim", ("qkv", "scores", "context", "out")),
    Paddable("heads", "num_heads", ("qkv", "scores", "context", "out")),
)
BY_KIND = {d.kind: d for d in PADDABLE}


def unpadded_kinds(shape) -> tuple[str, ...]:
    """The PADDABLE kinds no rewrite may pad in `shape` (a ModelShape): its heads, where
    unpadded_reason says why."""
    return ("head_dim", "heads") if unpadded_reason(shape) else ()


def unpadded_reason(shape) -> str | None:
    """Why the heads of `shape` (a ModelShape) keep their shape, or None where they may be
    padded: an encoder-decoder's decoder hands its cross-attention keys and values from one
    file to the next as a cache (decoder_model -> decoder_with_past_model); a fused attention
    op of ONNX Runtime's (GroupQueryAttention, MultiHeadAttention, Attention); multi-head latent
    attention's keys are a per-head part and a rotary part shared by the heads, its values
    the per-head width alone, a layout the head rewrites do not follow."""
    if shape.cross_attention:
        return (f"an encoder-decoder's decoder ({shape.cross_attention} cross-attention "
                "blocks) hands its cross-attention keys and values from one file to the next "
                "as a cache, so its heads are not padded")
    fused = next(((i, layer.attention) for i, layer in enumerate(shape.sites.layers)
                  if layer.attention and layer.attention.fused_op not in (None, "Attention")),
                 None)
    if fused is not None:  # ONNX's own Attention (opset 23) is rewritten; ORT's ops are not
        i, site = fused
        node = site.scale.nodes[0] if site.scale.nodes else site.o
        return (f"layer {i}: fused attention op {site.fused_op} (node {node!r}: its num_heads, "
                "packed layout, implicit scale and rotary caches are not rewritten); pad the "
                "unfused graph")
    cache = shape.cache
    if cache is not None and cache.value_head_dim is not None:
        return (f"keys and values have head dims of their own (keys {cache.head_dim}, values "
                f"{cache.value_head_dim}: multi-head latent attention), a layout the head "
                "rewrites do not follow")
    return None
# Every Transform kind, in the order a variant's name lists them: the paddable ones, the hidden
# size (never padded exactly; advice only), ONNX Runtime's fusions and the LM head cut to the
# positions a step reads (tuner.rewrite.logits_to_keep: the selected decoder's, when served).
# "positions": a graph that counts its positions from its cache's length takes them as an
# input (tuner.rewrite.position_ids), made beside the cut.
KINDS = (*BY_KIND, "hidden", "fuse", "last-logits", "positions")


@dataclass(frozen=True)
class Transform:
    """One rewrite applied to the source: kind in KINDS; `old`/`new` are the dimension
    before and after (None where no dimension changes)."""

    kind: str
    old: int | None = None
    new: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"transform kind must be {'|'.join(KINDS)}, not {self.kind!r}")
        for k in ("old", "new"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"transform {k} must be a positive integer or null, not {v!r}")

    def label(self) -> str:
        return self.kind if self.old is None else f"{self.kind} {self.old}->{self.new}"
