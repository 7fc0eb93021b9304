"""One decode step of a KV-cache decoder, as pure functions: row states in, feeds out. The
gate's rollouts (tuner.gate.kv_feeds, kv_gate) and the server's runner
(serving.generation.runner) build every step here, so the gate proves the shapes the server
runs.

    past, mask = pad_rows(record, [row_a, row_b], batch=4, past=16)   # rows' own caches
    feeds = step_feeds(record, [(5,), (7, 8, 9)], mask, past)          # a decode row + a chunk
    feeds = last_only(feeds)             # each row's last logits only, where the graph can
    feeds = next_feeds(feeds, outputs, tokens)                         # present -> next past
    mask = rewind(feeds.mask, row=0, entries=20)   # a speculative run's rejected drafts dropped

How rows of different lengths share a step (the graph's mask says which way):
  - left padding (a graph that reads its mask entry by entry): the past is LEFT-padded to a
    common length P (each row's L_i entries end at P; the mask is 0 before them), the new
    tokens are RIGHT-aligned in the step's S slots (a decode row's one token at the last
    slot; a prompt chunk of k fills the last k), and rows beyond the real ones (bucket
    padding) see only their own last slot. Position ids count each row's kept mask entries
    (0, 1, ...), so a row's positions are its own whatever the padding. A hole (the S - k
    unused slots of a short row) stays masked out for the rest of the generation.
  - rows at the start (`record.rows_at_start`: a graph that reads its mask as lengths,
    GroupQueryAttention): row i's entries are [0, L_i), its k new tokens fill the first k
    slots and are written at [L_i, L_i + k) by the graph itself; the mask keeps
    [0, L_i + k). No hole can form; `StepFeeds.counts` says where each row's last token is.
Either way the present (P + S long) is the next step's past as it is, with the mask
carried: no copy per step; the server compacts the rows (`row_cache` + `pad_rows`) when
freed rows cost more than a copy.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, replace
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
    counts: np.ndarray | None = None  # (B,) new tokens per row when rows are at the start
    keep: int = 0  # the logits hold the last `keep` positions (0: all; `last_only`)

    @property
    def seq(self) -> int:
        return int(self.arrays[self.record.input_ids].shape[1])

    @property
    def past(self) -> int:
        return int(self.mask.shape[1]) - self.seq

    @property
    def last(self) -> np.ndarray:
        """(B,) the slot of each row's last new token: its logits give the next token."""
        if self.counts is None:
            return np.full(self.mask.shape[0], self.seq - 1)
        return self.counts - 1

    @property
    def logit_slots(self) -> np.ndarray:
        """(B,) where each row's last new token's logits sit in the run's logits, which
        hold the step's last `keep` positions (all of them when keep is 0)."""
        kept = min(self.keep, self.seq) if self.keep else self.seq
        return self.last - (self.seq - kept)

    @property
    def query_mask(self) -> np.ndarray:
        """(B, S) which of the step's slots hold a row's new tokens."""
        if self.counts is None:
            return self.mask[:, self.past:]
        return (np.arange(self.seq) < self.counts[:, None]).astype(np.int64)


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
                past: Mapping[str, np.ndarray], counts: np.ndarray | None = None) -> StepFeeds:
    """The graph's feeds from ids (B, S), mask (B, P + S) and every past (P long); `counts`
    (B,) when the rows are at the start (then row i's k_i new tokens are its first slots)."""
    batch, seq = ids.shape
    if record.batch is not None and batch != record.batch:
        raise BadInput(f"the graph's batch is fixed to {record.batch}; feeds of batch {batch} "
                       "would not run")
    dtypes = record.dtypes
    arrays = {record.input_ids: ids.astype(dtypes[record.input_ids], copy=False)}
    if record.attention_mask is not None:
        arrays[record.attention_mask] = mask.astype(dtypes[record.attention_mask], copy=False)
    if record.position_ids is not None:
        if counts is None:
            pos = positions(mask)[:, mask.shape[1] - seq:]  # (B, S): the new tokens' positions
        else:  # row i's new tokens follow its L_i = sum(mask) - k_i entries
            pos = (mask.sum(1) - counts)[:, None] + np.arange(seq)  # (B, S)
        arrays[record.position_ids] = np.ascontiguousarray(
            pos.astype(dtypes[record.position_ids], copy=False))
    for name, arr in past.items():
        arrays[name] = np.ascontiguousarray(arr.astype(dtypes.get(name, arr.dtype), copy=False))
    return StepFeeds(record, arrays, mask, counts)


def new_columns(rows: Sequence[Sequence[int] | None], batch: int, seq: int | None = None,
                at_start: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """ids (B, S) and the mask's new columns (B, S) for `rows` (each its new tokens),
    right-aligned (left-aligned `at_start`); a None row and rows len(rows)..B-1 are padding
    (token 0, only their last (first) slot kept: no fully masked row)."""
    real = [r for r in rows if r is not None]
    if not real or batch < len(rows) or any(len(r) < 1 for r in real):
        raise BadInput(f"a step needs 1..{batch} rows of >= 1 token each")
    seq = seq or max(len(r) for r in real)
    ids = np.zeros((batch, seq), np.int64)  # (B, S)
    mask = np.zeros((batch, seq), np.int64)  # (B, S)
    mask[:, 0 if at_start else -1] = 1
    for i, tokens in enumerate(rows):
        if tokens is not None:
            span = slice(0, len(tokens)) if at_start else slice(seq - len(tokens), seq)
            ids[i, span] = tokens
            mask[i, span] = 1
    return ids, mask


def step_feeds(record: CacheRecord, rows: Sequence[Sequence[int] | None], past_mask: np.ndarray,
               past: Mapping[str, np.ndarray], seq: int | None = None) -> StepFeeds:
    """A step of `rows` (each its new tokens: one to decode, k for a prompt chunk) against
    `past` (B, .., P, ..) whose kept entries `past_mask` (B, P) marks."""
    batch = int(past_mask.shape[0])
    if not record.rows_at_start:
        ids, new = new_columns(rows, batch, seq)
        return build_feeds(record, ids, np.concatenate([past_mask, new], axis=1), past)
    ids, new = new_columns(rows, batch, seq, at_start=True)
    counts = new.sum(1)  # (B,) k_i
    total = past_mask.sum(1) + counts  # (B,) L_i + k_i: the row's entries after the step
    mask = (np.arange(past_mask.shape[1] + ids.shape[1]) < total[:, None]).astype(np.int64)
    return build_feeds(record, ids, mask, past, counts)


def last_only(feeds: StepFeeds, rows: int | None = None) -> StepFeeds:
    """`feeds` asking for the logits of each row's last token only, where the graph takes
    `logits_to_keep` (tuner.rewrite.logits_to_keep): the fewest last positions that hold
    the last token of each of the first `rows` rows (default all; the rest, bucket padding,
    are never read), 1 unless rows at the start end at different slots. As they are
    otherwise; a step of one position has nothing to leave out."""
    name = feeds.record.keep_logits
    if name is None or feeds.seq == 1:
        return feeds
    keep = feeds.seq - int(feeds.last[:rows].min())
    return replace(feeds, arrays={**feeds.arrays, name: np.array(keep, np.int64)}, keep=keep)


def empty_past(record: CacheRecord, batch: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Every past of length 0, and its (B, 0) mask: a first step."""
    return ({name: np.zeros(record.past_shape(batch, 0, name),
                            record.dtypes.get(name, record.dtype))
             for name in record.past}, np.zeros((batch, 0), np.int64))


def pad_rows(record: CacheRecord, caches: Sequence[Mapping[str, np.ndarray]],
             batch: int, past: int, capacity: int | None = None,
             into: Mapping[str, np.ndarray] | None = None
             ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """A batch from rows' own caches (each past name -> (1, .., L_i, ..)): every past
    (B, .., P, ..) and the mask (B, P), row i's entries placed by `place_row`. `capacity`
    (rows at the start only): buffers (B, .., C, ..) of C >= P positions, the mask still
    (B, P): a graph that shares its past and present buffer writes the next ones there.
    `into`: such buffers to reuse (rows at the start only: what lies past a row's entries
    is never read, so old entries there need no clearing)."""
    lengths = [cache_length(record, c) for c in caches]
    if batch < len(caches) or past < max(lengths, default=0):
        raise BadInput(f"{len(caches)} rows of up to {max(lengths, default=0)} entries do not "
                       f"fit a batch of {batch} and a past of {past}")
    if capacity is not None and (capacity < past or not record.rows_at_start):
        raise BadInput(f"a buffer of {capacity} positions needs rows at the start and >= {past}")
    shapes = {name: record.past_shape(batch, capacity or past, name) for name in record.past}
    if into is not None and not (record.rows_at_start and capacity is not None and all(
            into[n].shape == shapes[n] for n in record.past)):
        raise BadInput(f"buffers to reuse must be {shapes[record.past[0]]} per past (a "
                       "value's head dim its own), rows at the start")
    mask = np.zeros((batch, past), np.int64)  # (B, P)
    zeros = lazy_zeros if capacity is not None else np.zeros
    arrays = dict(into) if into is not None else {
        name: zeros(shapes[name], record.dtypes.get(name, record.dtype))
        for name in record.past}
    for i, cache in enumerate(caches):
        place_row(record, arrays, mask, i, cache, fresh=into is None)
    return arrays, mask


def place_row(record: CacheRecord, arrays: Mapping[str, np.ndarray], mask: np.ndarray,
              row: int, cache: Mapping[str, np.ndarray], fresh: bool = False) -> None:
    """Write one row's own cache (past name -> (1, .., L, ..)) into row `row` of a batch
    (B, .., P, ..), in place: at [P - L, P) (left padding) or [0, L) (rows at the start);
    the mask row keeps exactly those entries. Left padding's masked slots [0, P - L) are
    zeroed: the graph reads them (masked), and a row that held a longer stream's entries
    would otherwise feed them to a graph whose numbers depend on every slot (activations
    quantized with one range per run), as the gate's zero-padded rows never do. (Rows at
    the start: nothing past a row's entries is read. `fresh`: the row holds zeros already.)"""
    n, past = cache_length(record, cache), int(mask.shape[1])
    span = slice(0, n) if record.rows_at_start else slice(past - n, past)
    for name in record.past:
        if n:
            arrays[name][seq_index(record, row, span)] = cache[name][
                seq_index(record, 0, slice(None))]
        if not (record.rows_at_start or fresh) and past > n:
            arrays[name][seq_index(record, row, slice(0, past - n))] = 0
    mask[row] = 0
    mask[row, span] = 1


def lazy_zeros(shape: Sequence[int], dtype) -> np.ndarray:
    """Zeros whose memory is taken a 4 KiB page at a time, as they are written: an anonymous
    mapping advised against huge pages. Cache buffers hold every row at its full length and
    are written from each row's start; numpy advises huge pages for arrays of 4 MiB and more,
    and then one entry written faults in a 2 MiB page per row, head span and tensor (an
    8-layer Llama's 32 rows of 2048 positions held 1 GB resident for 128 MB of entries)."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape)) * dtype.itemsize
    if size == 0:
        return np.zeros(shape, dtype)
    buffer = mmap.mmap(-1, size)  # zero-filled; a page is mapped when first touched
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # (Linux; elsewhere the system decides)
        buffer.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buffer, dtype).reshape(tuple(shape))


def cache_length(record: CacheRecord, cache: Mapping[str, np.ndarray]) -> int:
    """How many entries a row's own cache (past name -> (1, .., L, ..)) holds: L."""
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


def rewind(mask: np.ndarray, row: int, entries: int) -> np.ndarray:
    """`mask` (B, P) with row `row` keeping its first `entries` kept entries only: the ones
    after them (written by a speculative run for drafts that were not accepted,
    serving.generation.speculate) masked out. Left padding leaves them as masked holes, as a
    short chunk's slots are; rows at the start end at `entries`, and the next step writes
    its entry over them. A new array; the cache's arrays are not touched."""
    kept = np.flatnonzero(mask[row])
    if entries > kept.size:
        raise BadInput(f"row {row} holds {kept.size} entries; it cannot keep {entries}")
    out = mask.copy()
    out[row, kept[entries:]] = 0
    return out


def next_feeds(feeds: StepFeeds, outputs: Mapping[str, np.ndarray],
               tokens: np.ndarray) -> StepFeeds:
    """The step after `feeds`: `tokens` (B,) one per row, this step's presents as the pasts."""
    record = feeds.record
    past = {p: outputs[q] for p, q in record.past_to_present.items()}
    ids = np.asarray(tokens).reshape(-1, 1)  # (B, 1)
    if feeds.counts is None:
        ones = np.ones((len(tokens), 1), np.int64)
        mask = np.concatenate([feeds.mask, ones], axis=1)  # (B, P + S + 1)
        return build_feeds(record, ids, mask, past)
    total = feeds.mask.sum(1) + 1  # (B,) each row one entry longer
    mask = (np.arange(feeds.mask.shape[1] + 1) < total[:, None]).astype(np.int64)
    return build_feeds(record, ids, mask, past, np.ones(len(tokens), np.int64))
