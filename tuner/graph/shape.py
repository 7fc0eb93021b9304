"""What inspect finds: the transformer's dimensions and where each one lives in the graph.

These dataclasses cross module borders (inspect -> plan -> rewrite -> artifact), so they are
frozen and carry only names (node and initializer names), never onnx_ir objects: a rewrite
looks the names up in its own copy of the graph. `ModelShape.to_json()` is docs/design.md's
`tuner inspect --json` contract.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from tuner.graph.kv_cache import KvCache

Severity = Literal["info", "warning", "error"]
ScaleKind = Literal["constant", "computed", "attribute", "none", "unknown"]


@dataclass(frozen=True)
class Finding:
    """One audit result: rule id (e.g. "vocab-multiple-64"), severity, one-line advice."""

    rule: str
    severity: Severity
    message: str

    def __post_init__(self) -> None:
        if self.severity not in ("info", "warning", "error"):
            raise ValueError(f"severity must be info|warning|error, not {self.severity!r}")


@dataclass(frozen=True)
class ScaleSite:
    """The attention softmax scale: a constant, computed from a shape at run time
    (TorchScript's Shape -> Sqrt -> Div), an attribute of a fused op, or absent."""

    kind: ScaleKind
    value: float | None = None  # the effective scale on the scores, when known
    nodes: tuple[str, ...] = ()  # the nodes that compute or apply it


@dataclass(frozen=True)
class AttentionSite:
    """One attention block. Projections are MatMul/Gemm node names; `qkv` is set instead of
    q/k/v when the exporter fused them (GPT-2's c_attn, GPT-NeoX's query_key_value)."""

    q: str | None
    k: str | None
    v: str | None
    o: str
    qkv: str | None = None
    reshapes: tuple[str, ...] = ()  # Reshape/Split/Slice nodes whose constants encode a or d
    scale: ScaleSite = ScaleSite("unknown")
    rotary: Literal["none", "full", "partial"] = "none"
    fused_op: str | None = None  # e.g. "com.microsoft.Attention" after ORT's optimizer
    rotary_dim: int | None = None  # dims per head that rotate (< head_dim: partial rotary)
    softmax: str | None = None  # the Softmax node (None when fused)


@dataclass(frozen=True)
class ExpertsSite:
    """A block's mixture of experts, reported, not padded: on batched weights
    (tuner.graph.experts), or one FFN per expert after one attention (tuner.graph.inspect)."""

    up: str  # the MatMul on the (E, h, F or 2F) weight; or expert 0's up projection
    down: str  # the MatMul on the (E, F, h) weight; or expert 0's down projection
    count: int  # E
    width: int  # F: each expert's FFN width


@dataclass(frozen=True)
class FfnSite:
    """One feed-forward block: up (and gate, for GLU variants) projections, then down."""

    up: str
    down: str
    gate: str | None = None
    activation: str = "unknown"  # gelu, gelu_tanh, relu, silu, ...
    # Set when one GEMM computes gate and up (Phi-3's gate_up_proj; then up == gate): the
    # order of the two halves of its output features, "gate,up" or "up,gate".
    fused_gate_up: str | None = None


@dataclass(frozen=True)
class LayerSites:
    attention: AttentionSite | None
    ffn: FfnSite | None


@dataclass(frozen=True)
class Sites:
    """Where every dimension lives: enough for a rewrite to find what it must touch."""

    layers: tuple[LayerSites, ...] = ()
    lm_head: str | None = None  # the MatMul/Gemm onto the vocabulary
    lm_head_weight: str | None = None  # its weight initializer
    embedding: str | None = None  # the token embedding initializer (Gather's data)
    tied: bool = False  # lm head and embedding share storage
    # the input that cuts the head to the last positions (tuner/rewrite/logits_to_keep.py)
    logits_to_keep: str | None = None
    # the rotary positions the graph counts from its cache's length, where it takes none
    # (tuner/graph/positions.py): what tuner/rewrite/position_ids.py makes an input
    slot_positions: str | None = None
    # each block's mixture of experts (batched weights, or an FFN per expert): reported only
    experts: tuple[ExpertsSite, ...] = ()


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of docs/design.md's contract, plus where they live."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    ffn_gated: bool
    vocab_size: int | None  # None: an encoder without an LM head
    activation: str = "unknown"
    kind: Literal["decoder", "encoder"] = "decoder"
    optimized: bool = False  # already run through ORT's transformer optimizer (fused ops)
    fused_ops: tuple[str, ...] = ()
    lengths_mask: str | None = None  # a fused Attention reading the mask as lengths (ort_fused)
    one_row_rotary: tuple[str, ...] = ()  # RotaryEmbedding nodes fed one-row caches (rotary_caches)
    findings: tuple[Finding, ...] = ()
    sites: Sites = field(default_factory=Sites)
    cache: KvCache | None = None  # the KV cache of a decoder exported with one (kv_cache.py)
    # an encoder-decoder's decoder (tuner/graph/encoder_side.py): its blocks that attend to
    # the encoder's output (not in `sites.layers`, not padded) and the input that carries it
    cross_attention: int = 0
    encoder_input: str | None = None

    def softmax_scale(self) -> float | None:
        """The scale every attention block applies to its scores, where the graph says so: a
        constant or a fused op's attribute, or 1/sqrt(head dim) where the export computes it
        from the query's shape; None where it is absent, unknown or differs between blocks."""
        found = set()
        for layer in self.sites.layers:
            s = layer.attention.scale if layer.attention is not None else None
            if s is None:
                continue
            if s.kind == "computed":
                found.add(round(self.head_dim ** -0.5, 12))
            elif s.kind in ("constant", "attribute") and s.value:
                found.add(round(s.value, 12))
            else:
                return None
        return found.pop() if len(found) == 1 else None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["findings"] = [asdict(f) for f in self.findings]
        d["fused_ops"] = list(self.fused_ops)
        return d
