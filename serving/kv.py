"""A decoder with a KV cache served as a plain forward: the client passes `past` (empty on
the first step) and gets logits and `present` back. No grpc here.

    record = find_cache_record(onnx_ir_model)        # tuner.graph.cache_record; None: no cache
    check_cache_feeds(record, feeds, "gpt2-kv")      # InvalidArgument, Triton-style message

What is checked, beyond the tensor specs (dtype, rank, static dims): every past has the
cache's layout with the kv heads and head dim the served graph declares (a value's own where
keys and values differ in width), all pasts hold
the same number of positions P and the same batch as the ids, and the attention mask is
P + seq long. A request that breaks these would otherwise fail deep inside the runtime (an
out-of-bounds Gather) or, worse, run on a mask that hides the wrong positions.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from serving.errors import InvalidArgument
from tuner.graph.cache_record import CacheRecord


def check_cache_feeds(record: CacheRecord, feeds: Mapping[str, np.ndarray], model: str) -> None:
    """InvalidArgument unless the pasts agree with each other, the ids and the mask."""
    ids = feeds[record.input_ids]
    batch, seq = int(ids.shape[0]), int(ids.shape[1]) if ids.ndim > 1 else 0
    axis = {letter: i for i, letter in enumerate(record.layout)}
    lengths = set()
    for name in record.past:
        arr = feeds[name]
        if arr.ndim != 4:
            raise InvalidArgument(f"input '{name}' of model '{model}' must be 4-D "
                                  f"({record.layout}), not {list(arr.shape)}")
        for letter, want, what in (("b", batch, f"the batch of '{record.input_ids}'"),
                                   ("h", record.kv_heads, "the model's kv heads"),
                                   ("d", record.cache.dim_of(name), _dim_what(record, name))):
            got = int(arr.shape[axis[letter]])
            if want is not None and got != want:
                raise InvalidArgument(f"input '{name}' of model '{model}' has {got} on axis "
                                      f"{axis[letter]}, but {what} is {want} (cache layout "
                                      f"{record.layout}: {list(arr.shape)})")
        lengths.add(int(arr.shape[axis["s"]]))
    if len(lengths) > 1:
        raise InvalidArgument(f"the past inputs of model '{model}' disagree on the cache "
                              f"length: {sorted(lengths)}")
    past = lengths.pop() if lengths else 0
    if record.attention_mask is not None and record.attention_mask in feeds:
        mask = feeds[record.attention_mask]
        if mask.ndim != 2 or int(mask.shape[1]) != past + seq:
            raise InvalidArgument(
                f"input '{record.attention_mask}' of model '{model}' must be (batch, past + seq) "
                f"= ({batch}, {past + seq}) for a past of {past} and {seq} new token(s), not "
                f"{list(mask.shape)}")


def _dim_what(record: CacheRecord, name: str) -> str:
    """What the head-dim axis must match: the model's head dim, or the keys' or the values'
    own where they differ (multi-head latent attention)."""
    if record.value_head_dim is None:
        return "the model's head dim"
    return "the values' head dim" if name in record.cache.values else "the keys' head dim"
