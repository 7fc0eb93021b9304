"""One decode step of a KV-cache decoder, as pure functions: row states in, feeds out. The
gate's rollouts (tuner.gate.kv_feeds, kv_gate) and the server's runner
(serving.generation.runner) build every step here, so the gate proves the shapes the server
runs.

    past, mask = left_pad(record, [row_a, row_b], batch=4, past=16)   # rows' own caches
    feeds = step_feeds(record, [(5,), (7, 8, 9)], mask, past)          # a decode row + a chunk
    feeds = next_feeds(feeds, outputs, tokens)                         # present -> next past

How rows of different lengths share a step: the past is LEFT-padded to a common length P
(each row's L_i entries end at P; the mask is 0 before them), the new tokens are
RIGHT-aligned in the step's S slots (a decode row's one token at the last slot; a prompt
chunk of k fills the last k), and rows beyond the real ones (bucket padding) see only their
own last slot. Position ids count each row's kept mask entries (0, 1, ...), so a row's
positions are its own whatever the padding. The present (P + S long) is the next step's
past as it is, with the mask carried: no copy per step. A hole (the S - k unused slots of
a short row) stays masked out for the rest of the generation; the server compacts the rows
(`row_cache` + `left_pad`) when holes or freed rows cost more than a copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from tuner.errors import BadInput
from tuner.graph.cache_record import CacheRecord


@dataclass(frozen=True)
class StepFeeds:
    """One step's arrays, keyed by graph input name, with the record that built them. `mask`
    is (B, P + S) even when the graph takes none: the rollout and the comparison need it."""

    record: CacheRecord
    arrays: Mapping[str, np.ndarray]
    mask: np.ndarray

    @property
    def seq(self) -> int:
        return int(self.arrays[self.record.input_ids].shape[1])

    @property
    def past(self) -> int:
        return int(self.mask.shape[1]) - self.seq


def positions(mask: np.ndarray) -> np.ndarray:
    """Position ids from a (B, P + S) mask, as ONNX Runtime's HF integration and generate()
    derive them: kept tokens count 0, 1, ...; padded slots get 1 (the mask hides them)."""
    pos = mask.astype(np.int64).cumsum(-1) - 1
    return np.where(mask == 0, 1, pos)  # (B, P + S)


def seq_index(record: CacheRecord, row, span) -> tuple:
    """The index of (batch `row`, sequence `span`) in a past tensor of the record's layout."""
    index: list = [slice(None)] * 4
    index[record.layout.index("b")] = row
    index[record.layout.index("s")] = span
    return tuple(index)


def build_feeds(record: CacheRecord, ids: np.ndarray, mask: np.ndarray,
                past: Mapping[str, np.ndarray]) -> StepFeeds:
    """The graph's feeds from ids (B, S), mask (B, P + S) and every past (P long)."""
    batch, seq = ids.shape
    if record.batch is not None and batch != record.batch:
        raise BadInput(f"the graph's batch is fixed to {record.batch}; feeds of batch {batch} "
                       "would not run")
    dtypes = record.dtypes
    arrays = {record.input_ids: ids.astype(dtypes[record.input_ids], copy=False)}
    if record.attention_mask is not None:
        arrays[record.attention_mask] = mask.astype(dtypes[record.attention_mask], copy=False)
    if record.position_ids is not None:
        pos = positions(mask)[:, mask.shape[1] - seq:]  # (B, S): the new tokens' positions
        arrays[record.position_ids] = np.ascontiguousarray(
            pos.astype(dtypes[record.position_ids], copy=False))
    for name, arr in past.items():
        arrays[name] = np.ascontiguousarray(arr.astype(dtypes.get(name, arr.dtype), copy=False))
    return StepFeeds(record, arrays, mask)


def new_columns(rows: Sequence[Sequence[int] | None], batch: int, seq: int | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """ids (B, S) and the mask's new columns (B, S) for `rows` (each its new tokens),
    right-aligned; a None row and rows len(rows)..B-1 are padding (token 0, only their last
    slot kept: no fully masked row)."""
    real = [r for r in rows if r is not None]
    if not real or batch < len(rows) or any(len(r) < 1 for r in real):
        raise BadInput(f"a step needs 1..{batch} rows of >= 1 token each")
    seq = seq or max(len(r) for r in real)
    ids = np.zeros((batch, seq), np.int64)  # (B, S)
    mask = np.zeros((batch, seq), np.int64)  # (B, S)
    mask[:, -1] = 1
    for i, tokens in enumerate(rows):
        if tokens is not None:
            ids[i, seq - len(tokens):] = tokens
            mask[i, seq - len(tokens):] = 1
    return ids, mask


def step_feeds(record: CacheRecord, rows: Sequence[Sequence[int] | None], past_mask: np.ndarray,
               past: Mapping[str, np.ndarray], seq: int | None = None) -> StepFeeds:
    """A step of `rows` (each its new tokens: one to decode, k for a prompt chunk) against
    `past` (B, .., P, ..) whose kept entries `past_mask` (B, P) marks."""
    batch = int(past_mask.shape[0])
    ids, new = new_columns(rows, batch, seq)
    return build_feeds(record, ids, np.concatenate([past_mask, new], axis=1), past)


def empty_past(record: CacheRecord, batch: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Every past of length 0, and its (B, 0) mask: a first step."""
    shape = record.past_shape(batch, 0)
    return ({name: np.zeros(shape, record.dtypes.get(name, record.dtype))
             for name in record.past}, np.zeros((batch, 0), np.int64))


def left_pad(record: CacheRecord, caches: Sequence[Mapping[str, np.ndarray]],
             batch: int, past: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """A batch from rows' own caches (each past name -> (1, .., L_i, ..)): every past
    (B, .., P, ..) with row i's entries at [P - L_i, P), and the mask (B, P) keeping them."""
    lengths = [_length(record, c) for c in caches]
    if batch < len(caches) or past < max(lengths, default=0):
        raise BadInput(f"{len(caches)} rows of up to {max(lengths, default=0)} entries do not "
                       f"fit a batch of {batch} and a past of {past}")
    mask = np.zeros((batch, past), np.int64)  # (B, P)
    arrays = {}
    for name in record.past:
        buf = np.zeros(record.past_shape(batch, past), record.dtypes.get(name, record.dtype))
        for i, (cache, n) in enumerate(zip(caches, lengths)):
            if n:
                buf[seq_index(record, i, slice(past - n, past))] = cache[name][
                    seq_index(record, 0, slice(None))]
        arrays[name] = buf
    for i, n in enumerate(lengths):
        mask[i, past - n:] = 1
    return arrays, mask


def _length(record: CacheRecord, cache: Mapping[str, np.ndarray]) -> int:
    first = cache[record.past[0]] if cache else None
    return 0 if first is None else int(first.shape[record.layout.index("s")])


def row_cache(record: CacheRecord, arrays: Mapping[str, np.ndarray], mask_row: np.ndarray,
              row: int, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Row `row`'s kept entries of a batch's cache (past name -> (1, .., L, ..)): a view when
    they are contiguous (left padding only), else a copy of the kept ones (holes)."""
    kept = np.flatnonzero(mask_row)
    names = names or record.past
    if kept.size and kept[-1] - kept[0] + 1 == kept.size:
        span = slice(int(kept[0]), int(kept[-1]) + 1)
        return {p: arrays[n][seq_index(record, slice(row, row + 1), span)]
                for p, n in zip(record.past, names)}
    axis = record.layout.index("s")
    return {p: np.take(arrays[n][seq_index(record, slice(row, row + 1), slice(None))], kept,
                       axis=axis) for p, n in zip(record.past, names)}


def next_feeds(feeds: StepFeeds, outputs: Mapping[str, np.ndarray],
               tokens: np.ndarray) -> StepFeeds:
    """The step after `feeds`: `tokens` (B,) one per row, this step's presents as the pasts."""
    record = feeds.record
    ones = np.ones((len(tokens), 1), np.int64)
    mask = np.concatenate([feeds.mask, ones], axis=1)  # (B, P + S + 1)
    past = {p: outputs[q] for p, q in record.past_to_present.items()}
    return build_feeds(record, np.asarray(tokens).reshape(-1, 1), mask, past)
