"""Feeds for decoders exported with a KV cache, and a greedy rollout through them: the basis
of the cache-aware accuracy gate (docs/design.md, "Decoders with a KV cache").

    record = cache_record(model)                       # tuner.graph.cache_record
    first = prefill_feeds(record, ids, mask)           # past length 0
    step = decode_feeds(record, batch=2, past=7, seq=1, vocab_size=1003, seed=0)
    served = served_feeds(record, lengths=(3, 9), chunks=(1, 4), vocab_size=1003, batch=4)
    run = greedy_rollout(runner.infer, first, steps=4)   # each step fed its own present

Every step is built by tuner.gate.decode_step, the code the server's runner builds its
steps with: the gate proves the shapes the server runs (rows of different lengths, bucket
padding, a prompt chunk beside decoding rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from tuner.errors import BadInput
from tuner.gate.decode_step import (StepFeeds, build_feeds, empty_past, next_feeds, pad_rows,
                                    step_feeds)
from tuner.graph.cache_record import CacheRecord

Infer = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


def prefill_feeds(record: CacheRecord, ids: np.ndarray, mask: np.ndarray | None = None) -> StepFeeds:
    """The first step: ids (B, S), mask (B, S) (default all ones), every past of length 0."""
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.shape[1] < 1:
        raise BadInput(f"prompt ids must be (batch, seq >= 1), not {ids.shape}")
    mask = np.ones(ids.shape, np.int64) if mask is None else np.asarray(mask)
    if mask.shape != ids.shape:
        raise BadInput(f"prefill mask {mask.shape} must match the ids {ids.shape}")
    past, _ = empty_past(record, ids.shape[0])  # (B, kv_heads, 0, d) for bhsd
    return build_feeds(record, ids, mask.astype(np.int64), past)


def decode_feeds(record: CacheRecord, batch: int, past: int, seq: int, vocab_size: int,
                 seed: int = 0) -> StepFeeds:
    """A step against a cache of `past` positions (random values, all kept): ids (B, seq),
    mask (B, past + seq), position ids past .. past + seq - 1. seq 1 is a decode step, seq k
    a chunk (speculative or chunked prefill)."""
    if batch < 1 or past < 0 or seq < 1:
        raise BadInput(f"decode feeds need batch >= 1, past >= 0, seq >= 1; "
                       f"not ({batch}, {past}, {seq})")
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab_size, (batch, seq))
    cache = {name: rng.standard_normal(record.past_shape(batch, past, name))
             for name in record.past}
    return build_feeds(record, ids, np.ones((batch, past + seq), np.int64), cache)


def served_feeds(record: CacheRecord, lengths: Sequence[int], chunks: Sequence[int],
                 vocab_size: int, batch: int | None = None, past: int | None = None,
                 seed: int = 0) -> StepFeeds:
    """A step in the server's shapes (tuner.gate.decode_step): row i holds a random cache of
    lengths[i] entries, padded to `past` (default the longest), and feeds chunks[i] new
    tokens (1: decoding; k: a prompt chunk beside the decoding rows); rows past len(lengths)
    up to `batch` are bucket padding."""
    rng = np.random.default_rng(seed)
    caches = [{name: rng.standard_normal(record.past_shape(1, n, name)) for name in record.past}
              for n in lengths]
    size = batch or len(lengths)
    arrays, mask = pad_rows(record, caches, size, past or max(lengths))
    rows = [tuple(int(t) for t in rng.integers(0, vocab_size, k)) for k in chunks]
    return step_feeds(record, rows, mask, arrays)


# ---------------------------------------------------------------------------------------------
# Rollout and its comparison


@dataclass(frozen=True)
class Rollout:
    """What a greedy generation produced: per-step logits (B, S_step, vocab) and the step's
    query mask (B, S_step), the chosen tokens (B, steps), the cache after the last step."""

    logits: tuple[np.ndarray, ...]
    query_masks: tuple[np.ndarray, ...]
    tokens: np.ndarray
    cache: Mapping[str, np.ndarray]  # present output name -> array


def greedy_rollout(infer: Infer, feeds: StepFeeds, steps: int,
                   forced: np.ndarray | None = None) -> Rollout:
    """`steps` forward passes from `feeds`, each fed the argmax of the last position and its
    own `present` as the next `past`; a runner's `infer` is the model. `forced` (B, steps):
    fed these tokens instead of its own choices (another model's rollout, teacher forced;
    `tokens` are still its own)."""
    if steps < 1:
        raise BadInput(f"a rollout needs steps >= 1, not {steps}")
    if forced is not None and forced.shape[1] < steps:
        raise BadInput(f"{forced.shape[1]} forced tokens a row for {steps} steps")
    logits, query_masks, tokens = [], [], []
    outputs: Mapping[str, np.ndarray] = {}
    for step in range(steps):
        outputs = infer(feeds.arrays)
        out = np.asarray(outputs[feeds.record.logits])  # (B, S, vocab)
        logits.append(out)
        query_masks.append(feeds.query_mask)  # (B, S)
        tokens.append(out[np.arange(len(out)), feeds.logit_slots].argmax(-1))  # (B,)
        if step + 1 < steps:
            feeds = next_feeds(feeds, outputs, tokens[-1] if forced is None else forced[:, step])
    cache = {q: np.asarray(outputs[q]) for q in feeds.record.past_to_present.values()}
    return Rollout(tuple(logits), tuple(query_masks), np.stack(tokens, axis=1), cache)
