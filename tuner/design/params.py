"""Exact parameter counts of decoder-only transformers, the currency of the co-design search.

Two FFN kinds (docs/design.md notation: h hidden, a heads, k kv heads, d head dim, f FFN width,
v vocabulary, L layers):

- plain: up (h x f) -> GELU -> down (f x h), as in GPT-2 and GPT-NeoX (Pythia, the paper's
  models);
- swiglu: gate and up (h x f each) -> SiLU(gate) * up -> down (f x h), as in Llama.

The family presets fix what differs besides the shape: biases, LayerNorm (weight + bias) or
RMSNorm (weight only), learned position embeddings (GPT-2) or rotary (no parameters), and
whether the LM head is tied to the token embedding. Counts match `transformers`'
`num_parameters()` for models built from the same configs (tests/test_params.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

Norm = Literal["layernorm", "rmsnorm"]


@dataclass(frozen=True)
class Family:
    """What a decoder family adds around its GEMMs (not the shape itself)."""

    name: str
    ffn_gated: bool
    bias: bool  # biases on every projection (QKV, output, FFN), as GPT-2 / GPT-NeoX
    norm: Norm
    tied: bool  # LM head shares the token embedding
    positions: int = 0  # learned absolute position embeddings (GPT-2); 0 for rotary

    def __post_init__(self) -> None:
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"norm must be layernorm or rmsnorm, not {self.norm!r}")
        if self.positions < 0:
            raise ValueError(f"positions must be >= 0, not {self.positions}")


FAMILIES: dict[str, Family] = {
    "gpt2": Family("gpt2", ffn_gated=False, bias=True, norm="layernorm", tied=True, positions=1024),
    "gpt_neox": Family("gpt_neox", ffn_gated=False, bias=True, norm="layernorm", tied=False),
    "llama": Family("llama", ffn_gated=True, bias=False, norm="rmsnorm", tied=False),
}
# `--ffn plain|swiglu` picks the family the paper's experiments stand for.
FAMILY_FOR_FFN = {"plain": "gpt_neox", "swiglu": "llama"}


@dataclass(frozen=True)
class DesignShape:
    """One whole decoder shape. Field names follow tuner.graph.shape.ModelShape, so code that
    reads dims (the GEMM probe's `model_gemms`) takes either."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int
    family: Family = FAMILIES["gpt_neox"]

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "ffn_size", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")

    @property
    def ffn_gated(self) -> bool:
        return self.family.ffn_gated

    def with_(self, **changes) -> "DesignShape":
        return replace(self, **changes)

    def label(self) -> str:
        kv = f"/{self.num_kv_heads}kv" if self.num_kv_heads != self.num_heads else ""
        return (f"L{self.num_layers} h{self.hidden_size} a{self.num_heads}{kv} "
                f"d{self.head_dim} f{self.ffn_size} v{self.vocab_size}")

    def to_json(self) -> dict:
        return {"num_layers": self.num_layers, "hidden_size": self.hidden_size,
                "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "ffn_size": self.ffn_size,
                "ffn_gated": self.ffn_gated, "vocab_size": self.vocab_size,
                "family": self.family.name, "params": count_params(self)}


def layer_params(s: DesignShape) -> int:
    """Parameters of one decoder layer: attention, FFN and the two norms."""
    h, q, kv = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    fam = s.family
    attn = h * q + 2 * h * kv + q * h  # Wq, Wk, Wv (h x ...), Wo (a*d x h)
    if fam.bias:
        attn += q + 2 * kv + h
    n_up = 2 if fam.ffn_gated else 1  # gate and up for SwiGLU
    ffn = n_up * h * s.ffn_size + s.ffn_size * h
    if fam.bias:
        ffn += n_up * s.ffn_size + h
    return attn + ffn + 2 * norm_params(h, fam.norm)


def norm_params(h: int, norm: Norm) -> int:
    return 2 * h if norm == "layernorm" else h


def embedding_params(s: DesignShape) -> int:
    """Token (and learned position) embeddings, plus the LM head when it is not tied."""
    h, fam = s.hidden_size, s.family
    emb = s.vocab_size * h + fam.positions * h
    return emb if fam.tied else emb + s.vocab_size * h


def count_params(s: DesignShape) -> int:
    """All parameters: embeddings, L layers, the final norm, the (untied) LM head."""
    return (embedding_params(s) + s.num_layers * layer_params(s)
            + norm_params(s.hidden_size, s.family.norm))
