"""A decoder with a KV cache served as a plain forward: the client passes `past` (empty on
the first step) and gets logits and `present` back. No grpc here.

    spec = cache_spec(onnx_ir_model)                 # None for a model without a cache
    check_cache_feeds(spec, feeds, "gpt2-kv")        # InvalidArgument, Triton-style message

What is checked, beyond the tensor specs (dtype, rank, static dims): every past has the
cache's layout with the kv heads and head dim the served graph declares, all pasts hold
the same number of positions P and the same batch as the ids, and the attention mask is
P + seq long. A request that breaks these would otherwise fail deep inside the runtime (an
out-of-bounds Gather) or, worse, run on a mask that hides the wrong positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import onnx_ir as ir

from serving.errors import InvalidArgument
from tuner.errors import BadInput
from tuner.gate.kv_feeds import CacheRoles, cache_roles
from tuner.graph.kv_cache import find_kv_cache


@dataclass(frozen=True)
class CacheSpec:
    """What a request to a cache model must satisfy (names from the served graph)."""

    roles: CacheRoles
    past: tuple[str, ...]
    layout: str  # e.g. "bhsd"
    kv_heads: int | None
    head_dim: int | None


def cache_spec(model: ir.Model) -> CacheSpec | None:
    """The served graph's cache, read from its structure (widened dims included)."""
    if find_kv_cache(model.graph) is None:
        return None
    try:
        roles = cache_roles(model)
    except BadInput:
        return None
    graph_inputs = {v.name: v for v in model.graph.inputs}
    cache = roles.cache
    first = graph_inputs[cache.layers[0].past_value]

    def static(letter: str) -> int | None:
        d = first.shape[cache.layout.index(letter)] if first.shape is not None else None
        return d if isinstance(d, int) else None

    past = tuple(n for layer in cache.layers for n in (layer.past_key, layer.past_value))
    return CacheSpec(roles, past, cache.layout, static("h") or cache.num_kv_heads,
                     static("d") or cache.head_dim)


def check_cache_feeds(spec: CacheSpec, feeds: Mapping[str, np.ndarray], model: str) -> None:
    """InvalidArgument unless the pasts agree with each other, the ids and the mask."""
    roles = spec.roles
    ids = feeds[roles.input_ids]
    batch, seq = int(ids.shape[0]), int(ids.shape[1]) if ids.ndim > 1 else 0
    axis = {letter: i for i, letter in enumerate(spec.layout)}
    lengths = set()
    for name in spec.past:
        arr = feeds[name]
        if arr.ndim != 4:
            raise InvalidArgument(f"input '{name}' of model '{model}' must be 4-D "
                                  f"({spec.layout}), not {list(arr.shape)}")
        for letter, want, what in (("b", batch, f"the batch of '{roles.input_ids}'"),
                                   ("h", spec.kv_heads, "the model's kv heads"),
                                   ("d", spec.head_dim, "the model's head dim")):
            got = int(arr.shape[axis[letter]])
            if want is not None and got != want:
                raise InvalidArgument(f"input '{name}' of model '{model}' has {got} on axis "
                                      f"{axis[letter]}, but {what} is {want} (cache layout "
                                      f"{spec.layout}: {list(arr.shape)})")
        lengths.add(int(arr.shape[axis["s"]]))
    if len(lengths) > 1:
        raise InvalidArgument(f"the past inputs of model '{model}' disagree on the cache "
                              f"length: {sorted(lengths)}")
    past = lengths.pop() if lengths else 0
    if roles.attention_mask is not None and roles.attention_mask in feeds:
        mask = feeds[roles.attention_mask]
        if mask.ndim != 2 or int(mask.shape[1]) != past + seq:
            raise InvalidArgument(
                f"input '{roles.attention_mask}' of model '{model}' must be (batch, past + seq) "
                f"= ({batch}, {past + seq}) for a past of {past} and {seq} new token(s), not "
                f"{list(mask.shape)}")


# ---------------------------------------------------------------------- for generation


@dataclass(frozen=True)
class DecoderSpec:
    """What generation needs to know about a cache export, found from its signature."""

    tokens: str  # input_ids
    mask: str  # attention_mask, (b, past + s)
    positions: str | None  # position_ids (b, s), where the family has them
    past: tuple[str, ...]  # past_key_values.{i}.key|value, (b, kv_heads, past, d)
    present: tuple[str, ...]  # the matching present.{i}.key|value, same order
    cache_dims: tuple[tuple[int, int], ...]  # (kv_heads, d) of each past input
    cache_dtype: str  # numpy dtype name of the cache
    logits: str
    vocab: int  # real token ids are [0, vocab): padded logits columns are cut off

    def __post_init__(self) -> None:
        if not self.past or len(self.past) != len(self.present) != len(self.cache_dims):
            raise ValueError("a decoder needs one present output per past input")
