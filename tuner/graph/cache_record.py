"""The one record of a decoder's KV cache interface, found once per model and taken by the
gate (rollouts), optimize (the cache section, the decoder's feeds) and the server
(generation, checks of a client's own past).

    record = find_cache_record(model)       # None when the graph has no KV cache
    record.past_to_present                  # past input -> the present output feeding it
    record.past_shape(2, 7, "past_key_values.0.value")   # in the cache's own layout, e.g. bhsd

It joins what tuner.graph.kv_cache finds from the structure (layers, layout, kv heads,
head dim, dtype) with the roles tuner.graph.roles finds for every model (token ids, mask,
position ids), the logits output, and the widened entries a rewrite recorded (`widen`).
The dims are the served graph's own: a widened cache is wider here. Keys and values may
differ in width (multi-head latent attention: `value_head_dim`), so a past's shape is asked
for by the tensor's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import onnx_ir as ir

from tuner.errors import BadInput
from tuner.graph.kv_cache import CachePads, KvCache, find_kv_cache, widened_cache
from tuner.graph.lm_head import keep_input
from tuner.graph.positions import positions_input
from tuner.graph.role_names import ENCODER_ROLES
from tuner.graph.roles import ATTENTION_MASK, POSITION_IDS, TOKEN_IDS, input_specs, with_role
from tuner.graph.window import sliding_window
from tuner.graph.windowed import windowed_cache


@dataclass(frozen=True)
class CacheRecord:
    """The graph names of a cache model's inputs/outputs by role, its cache, its dtypes."""

    input_ids: str
    attention_mask: str | None  # None: the graph takes no mask
    position_ids: str | None  # None: positions come from inside the graph
    logits: str
    cache: KvCache
    dtypes: Mapping[str, str] = field(default_factory=dict)  # input name -> numpy dtype name
    batch: int | None = None  # the graph's batch when it is static (STYLE.md: static dims are real)
    vocab: int | None = None  # the logits' last dim when static
    widened: CachePads = field(default_factory=dict)  # {} unless a rewrite widened the cache
    seq: int | None = None  # the ids' sequence dim when static (1: decode steps only)
    # the input that keeps the logits of the last k positions only (0: all), with a default:
    # tuner.rewrite.logits_to_keep; None when the graph has none
    keep_logits: str | None = None
    # a sliding-window mask's width in slots (tuner.graph.window); None: no window found
    window: int | None = None

    @property
    def layout(self) -> str:
        return self.cache.layout

    @property
    def kv_heads(self) -> int | None:
        return self.cache.num_kv_heads

    @property
    def head_dim(self) -> int | None:
        """The keys' head dim (the values' too, unless value_head_dim says otherwise)."""
        return self.cache.head_dim

    @property
    def value_head_dim(self) -> int | None:
        """The values' own head dim where it is not the keys' (multi-head latent attention);
        None: the values are head_dim wide too."""
        return self.cache.value_head_dim

    @property
    def dtype(self) -> str:
        return self.cache.dtype

    @property
    def past(self) -> tuple[str, ...]:
        """Every past input, layer by layer, key before value."""
        return tuple(n for layer in self.cache.layers for n in (layer.past_key, layer.past_value))

    @property
    def past_to_present(self) -> dict[str, str]:
        """past input -> the present output that feeds it on the next step."""
        pairs: dict[str, str] = {}
        for layer in self.cache.layers:
            if layer.present_key is None or layer.present_value is None:
                raise BadInput(f"layer {layer.index}'s cache is not a graph output: "
                               "no present to feed back")
            pairs[layer.past_key] = layer.present_key
            pairs[layer.past_value] = layer.present_value
        return pairs

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position of every layer's K and V takes (the served, maybe wider, dims)."""
        if self.cache.bytes_per_token is None:
            raise BadInput("the cache's kv heads / head dim are not static in the graph")
        return self.cache.bytes_per_token

    @property
    def rows_at_start(self) -> bool:
        """Whether a batch keeps each row's entries from position 0 (right padding): a graph
        that reads its mask as lengths (GroupQueryAttention) writes a row's new keys right
        after its own entries, wherever the mask's ones are. Other graphs take left padding."""
        return self.cache.mask == "lengths"

    @property
    def takes_chunks(self) -> bool:
        """Whether the graph runs seq > 1 beside a past > 0 (chunked prefill, prefix hits)."""
        return self.seq is None or self.seq > 1

    def past_shape(self, batch: int, length: int, name: str | None = None) -> tuple[int, ...]:
        """The shape of the past (or present) tensor `name` holding `length` positions, in
        the cache's layout: a value's head dim is the values' own. `name` may be left out
        only where keys and values are one width."""
        if name is None and self.value_head_dim is not None:
            raise BadInput(f"keys ({self.head_dim}) and values ({self.value_head_dim}) differ "
                           "in head dim: a past's shape needs the tensor's name")
        dim = self.cache.dim_of(name) if name is not None else self.head_dim
        if self.kv_heads is None or dim is None:
            raise BadInput("the cache's kv heads / head dim are not static in the graph")
        size = {"b": batch, "h": self.kv_heads, "s": length, "d": dim}
        return tuple(size[letter] for letter in self.layout)  # e.g. bhsd: (B, kv_heads, P, d)


def _logits(graph: ir.Graph, cache: KvCache) -> ir.Value:
    presents = {n for layer in cache.layers for n in (layer.present_key, layer.present_value)}
    rest = [v for v in graph.outputs if v.name not in presents]
    if len(rest) != 1:
        raise BadInput(f"a cache model should return logits and the cache; it returns "
                       f"{len(rest)} other outputs: {[v.name for v in rest]}")
    return rest[0]


def _static_last(v: ir.Value) -> int | None:
    d = v.shape[-1] if v.shape is not None and len(v.shape) else None
    return d if isinstance(d, int) and d > 0 else None


def cache_record(model: ir.Model) -> CacheRecord:
    """The cache record of a cache model; BadInput when the model has no KV cache or its
    roles cannot be told apart."""
    graph = model.graph
    cache = find_kv_cache(graph)
    if cache is None:
        raise BadInput("the model has no KV cache (no past key/value input joined by a Concat)")
    windowed = windowed_cache(graph)
    if windowed is not None:  # one engine cache: every layer's past holds the whole sequence
        raise BadInput(f"{len(windowed.nodes)} layer(s) keep only a window of "
                       f"{windowed.window} positions in their cache (onnxruntime-genai's "
                       "windowed caches); `tuner optimize` makes them full-length first, "
                       "as `tuner unwindow MODEL -o OUT` does")
    lengths = _past_lengths(graph, cache)
    if len(lengths) > 1:  # one engine cache: every layer's past is as long as the others'
        raise BadInput(f"the layers' caches have lengths of their own ({', '.join(lengths)}); "
                       "a cache with per-layer lengths is not served")
    specs = input_specs(model)  # roles from the structure (tuner.graph.roles)
    crossing = [s.name for s in specs if s.role in ENCODER_ROLES]
    if crossing:  # the engine's steps carry no encoder: nothing would feed these
        raise BadInput(f"an encoder-decoder's with-past decoder (it takes "
                       f"{', '.join(crossing[:2])}... from its encoder): its generation is "
                       "not served, and its steps are one token against a cache, which "
                       "optimize's forward passes do not measure; `tuner pad FOLDER` pads the "
                       "export, and its decoder_model.onnx is optimized and served as a "
                       "tensor model")
    ids, mask = with_role(specs, TOKEN_IDS), with_role(specs, ATTENTION_MASK)
    pos = with_role(specs, POSITION_IDS)
    if ids is None:
        raise BadInput("no token-id input (one that reaches the token embedding) in the graph")
    batch = ids.dims[ids.batch_axis] if ids.batch_axis is not None else None
    seq = ids.dims[ids.seq_axis] if ids.seq_axis is not None else None
    logits = _logits(graph, cache)
    # a position input with a default (tuner.rewrite.position_ids): fed like any other
    own = positions_input(graph) if pos is None else None
    return CacheRecord(ids.name, mask.name if mask is not None else None,
                       pos.name if pos is not None else own, logits.name or "", cache,
                       {s.name: s.dtype for s in specs} | ({own: "int64"} if own else {}),
                       batch if isinstance(batch, int) else None, _static_last(logits),
                       widened_cache(model), seq if isinstance(seq, int) else None,
                       keep_input(graph), sliding_window(graph))


def _past_lengths(graph: ir.Graph, cache: KvCache) -> list[str]:
    """The distinct names of the past inputs' sequence axes (one, or none where static)."""
    axis = cache.layout.index("s")
    dims = [v.shape[axis] for v in graph.inputs if v.name in cache.pasts and v.shape is not None
            and len(v.shape) > axis]
    return sorted({d.value for d in dims if isinstance(d, ir.SymbolicDim) and d.value})


def find_cache_record(model: ir.Model) -> CacheRecord | None:
    """The record, or None for a model without a KV cache (or one whose roles are unclear)."""
    if find_kv_cache(model.graph) is None:
        return None
    try:
        return cache_record(model)
    except BadInput:
        return None
