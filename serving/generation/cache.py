"""The KV cache of every running stream, in the graph's own layout (tuner.graph.cache_record):
a byte budget, the decode batch, each prefilling stream's own cache, and the prefix cache.

The decode batch is the last decode step's `present` (B, .., P, ..) and its mask (B, P):
the next step's past as it is (no copy per step; tuner.gate.decode_step). A stream joining
it is written IN PLACE into a free row (one that ended or was preempted, or a bucket's
padding row) when its entries fit the past (tuner.gate.decode_step.place_row: left-padded,
or from position 0 for a graph that reads its mask as lengths); only when no row is free, or when freed rows
and holes waste more than half of the batch, are the rows gathered into a new batch
(left-padded to the longest row, or to the buckets). Shared buffers (below) hold rows to
spare, up to the next batch bucket: the batch's arrays are views of their first rows, and a
joiner with no free row takes the next spare one (the views grow, nothing is copied), so a
stream that joins a batch of n costs its own row, not n rows (32 streams sharing a 512-token
prompt spent 4.4 s of 11 in gathers before). Where the byte budget holds every stream that
may decode at the model's full length, they are allocated so once (`_storage_shape`) and
never gathered: a longer joiner widens the mask, an ended stream's row takes the last row.

The byte budget counts the entries of running streams and of the prefix cache; a batch's
padding and freed rows come on top, at most as much again (the gather rule above).

The prefix cache keeps the keys/values of prompt prefixes in blocks of `block` tokens,
keyed by the exact tokens up to the block's end (a dict of token tuples: hashed, and
compared on a hit, so a collision can never serve another prompt's cache). A new stream
starts from the longest cached prefix (at most its prompt less one token: the last one must
run to give logits) and prefills only the rest. Least recently used blocks go first when
the byte budget runs out.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from serving.generation.options import next_bucket
from tuner.gate.decode_step import (cache_length, pad_rows, place_row, rewind, row_cache,
                                    seq_index)
from tuner.graph.cache_record import CacheRecord

Cache = dict[str, np.ndarray]  # past name -> (1, .., L, ..)


@dataclass
class DecodeBatch:
    """The decode rows: `slots[i]` is the stream of row i (None: free); arrays and mask are
    the next step's past, (B, .., P, ..) and (B, P)."""

    slots: list
    arrays: dict[str, np.ndarray]
    mask: np.ndarray
    capacity: int | None = None  # shared buffers: positions the arrays hold (>= past)
    storage: dict[str, np.ndarray] | None = None  # shared buffers: arrays are storage[:B]

    def grow(self, rows: int) -> bool:
        """`rows` more rows from the storage's spare ones (views: nothing copied; they were
        never written, so zeros, and their mask rows empty); False when too few are left."""
        new = len(self.slots) + rows
        if self.storage is None or new > len(next(iter(self.storage.values()))):
            return False
        self.arrays = {n: a[:new] for n, a in self.storage.items()}
        self.mask = np.concatenate([self.mask, np.zeros((rows, self.past), self.mask.dtype)])
        self.slots.extend([None] * rows)
        return True

    def shrink(self, rows: int) -> None:
        """Shared buffers: the batch ends after `rows` rows (the ones cut are free)."""
        if rows < len(self.slots):
            assert all(s is None for s in self.slots[rows:])
            self.slots = self.slots[:rows]
            self.arrays = {n: a[:rows] for n, a in self.storage.items()}
            self.mask = self.mask[:rows]

    def widen(self, past: int) -> None:
        """Shared buffers (rows at the start): a past of `past` positions (< capacity), every
        row's mask padded with empty columns; the buffers are the same."""
        extra = past - self.past
        if extra > 0:
            self.mask = np.concatenate(
                [self.mask, np.zeros((len(self.mask), extra), self.mask.dtype)], axis=1)

    @property
    def past(self) -> int:
        return int(self.mask.shape[1])

    @property
    def full(self) -> bool:
        """Shared buffers with no room for the next step's entry."""
        return self.capacity is not None and self.past >= self.capacity


@dataclass
class PrefixCache:
    """Blocks of prompt prefixes, least recently used first."""

    block: int
    bytes_per_token: int
    blocks: OrderedDict = field(default_factory=OrderedDict)  # tokens up to the end -> Cache
    hit_tokens: int = 0
    looked_up_tokens: int = 0

    @property
    def bytes(self) -> int:
        return len(self.blocks) * self.block * self.bytes_per_token

    def lookup(self, tokens: Sequence[int], start: int = 0) -> list[Cache]:
        """The cached blocks after the first `start` tokens (a multiple of the block) of
        the longest cached prefix of `tokens` less its last token."""
        found: list[Cache] = []
        end = start + self.block
        while end <= len(tokens) - 1:
            key = tuple(tokens[:end])
            if key not in self.blocks:
                break
            self.blocks.move_to_end(key)
            found.append(self.blocks[key])
            end += self.block
        return found

    def insert(self, record: CacheRecord, tokens: Sequence[int], cache: Cache) -> None:
        """The full blocks of `tokens` (whose entries `cache` holds), copied out."""
        for end in range(self.block, len(tokens) + 1, self.block):
            key = tuple(tokens[:end])
            if key in self.blocks:
                self.blocks.move_to_end(key)
                continue
            span = slice(end - self.block, end)
            # a copy always (a contiguous slice would otherwise stay a view of buffers
            # that compaction and reuse overwrite)
            self.blocks[key] = {n: a[seq_index(record, slice(None), span)].copy()
                                for n, a in cache.items()}

    def evict(self) -> bool:
        if not self.blocks:
            return False
        self.blocks.popitem(last=False)
        return True


class CacheManager:
    """`shared`: the decode batch's arrays are buffers that the graph writes its new entries
    into (past and present one buffer: GroupQueryAttention with IO binding), sized to the
    next cache bucket and gathered into a bigger one when full; else each step's present
    is the next past."""

    def __init__(self, record: CacheRecord, budget_bytes: int, pad_to: str,
                 batch_buckets: Sequence[int] = (), cache_buckets: Sequence[int] = (),
                 prefix_block: int | None = 16, max_past: int | None = None,
                 shared: bool = False, max_rows: int | None = None) -> None:
        self.record, self.pad_to, self.shared = record, pad_to, shared
        self.max_past = max_past  # a batch's past never grows beyond (the model's positions)
        self.max_rows = max_rows  # streams that may decode at once (shared buffers hold them)
        self.budget_bytes = budget_bytes
        self.bytes_per_token = record.bytes_per_token
        self.budget_tokens = max(1, budget_bytes // self.bytes_per_token)
        self.batch_buckets, self.cache_buckets = tuple(batch_buckets), tuple(cache_buckets)
        self.prefix = PrefixCache(prefix_block, self.bytes_per_token) if prefix_block else None
        self.batch: DecodeBatch | None = None
        self._idle: dict[str, np.ndarray] | None = None  # shared buffers kept while idle
        self.gathers = 0  # batches formed by copying (a join in place copies only its row)

    # ------------------------------------------------------------------------- bytes

    def fits(self, tokens: int) -> bool:
        """Whether `tokens` entries of running streams fit beside the prefix cache."""
        held = self.prefix.bytes // self.bytes_per_token if self.prefix is not None else 0
        return tokens + held <= self.budget_tokens

    def usage(self, entries: int) -> float:
        """The share of the byte budget that `entries` of running streams take (the prefix
        cache's blocks, evicted on demand, are free room as vLLM counts them)."""
        return min(1.0, entries / self.budget_tokens)

    def evict_prefix(self) -> bool:
        return self.prefix is not None and self.prefix.evict()

    def release(self, stream) -> None:
        """Free a stream's cache (it ended, or is preempted: recomputed from scratch)."""
        if stream.slot is not None and self.batch is not None:
            self.batch.slots[stream.slot] = None
        stream.slot, stream.cache, stream.computed = None, None, 0
        if not stream.prefix_counted:
            stream.prefix_hit = 0  # what it found is counted when its prompt completes

    # ------------------------------------------------------------------------- prefix

    def lookup_prefix(self, stream) -> None:
        """Extend a prefilling stream's cache with the cached blocks that follow what it has
        (at admission: from nothing; between chunks: blocks another stream with the same
        prefix computed meanwhile). Never for a stream that asked for its prompt's log-probs:
        those come from computing every prompt position."""
        p = self.prefix
        if (p is None or stream.computed % p.block or stream.decoding
                or stream.request.prompt_logprobs is not None):
            return
        blocks = p.lookup(stream.tokens, stream.computed)
        if not blocks:
            return
        axis = self.record.layout.index("s")
        own = self.own(stream)
        parts = ([own] if stream.computed else []) + blocks
        stream.cache = {n: np.concatenate([b[n] for b in parts], axis=axis)
                        for n in self.record.past}
        stream.computed += len(blocks) * p.block
        stream.prefix_hit += len(blocks) * p.block

    def store_prefix(self, stream, cache: Cache | None = None) -> None:
        """After a prefill chunk: the full blocks of the stream's prompt computed so far
        into the prefix cache (so that streams behind it find them at once). `cache`: the
        stream's entries after the chunk, when the stream may have ended meanwhile (its
        own are then released); by default its own."""
        p = self.prefix
        prompt = stream.request.prompt
        if p is None or stream.prefix_stored:
            return
        done = min(stream.computed if cache is None else cache_length(self.record, cache),
                   len(prompt))
        if done >= p.block:
            p.insert(self.record, prompt[:done - done % p.block],
                     self.own(stream) if cache is None else cache)
        stream.prefix_stored = done == len(prompt)

    # ------------------------------------------------------------------------- rows

    def own(self, stream) -> Cache:
        """A stream's entries (past name -> (1, .., L, ..)): a view where it can be."""
        b = self.batch
        if stream.slot is not None and b is not None:
            return row_cache(self.record, b.arrays, b.mask[stream.slot], stream.slot)
        return stream.cache or {}

    def padded(self, rows: int, longest: int) -> tuple[int, int]:
        """(batch, past) a new batch of `rows` rows of up to `longest` entries gets."""
        if self.pad_to == "bucket":
            past = next_bucket(longest, self.cache_buckets) if longest else 0
            return next_bucket(rows, self.batch_buckets), past
        return rows, longest

    def decode_batch(self, streams: Sequence) -> DecodeBatch:
        """The batch holding every stream of `streams` (each decoding): joiners written in
        place into free rows where they fit, else every row gathered anew."""
        b = self.batch
        joining = [s for s in streams if s.slot is None]
        if (b is not None and (self.max_past is None or b.past < self.max_past)
                and not b.full and self._in_place(b, joining)
                and not self._wasteful(b, streams)):
            return b
        caches = [self.own(s) for s in streams]
        batch, past = self.padded(len(streams), max(s.computed for s in streams))
        capacity, held, storage = None, batch, None
        if self.shared:
            held, capacity = self._storage_shape(batch, past)
        arrays, mask = pad_rows(self.record, caches, held, past, capacity,
                                self._reusable(held, capacity))
        if self.shared:
            storage, arrays, mask = arrays, {n: a[:batch] for n, a in arrays.items()}, mask[:batch]
        for i, s in enumerate(streams):
            s.slot, s.cache = i, None
        self.batch = DecodeBatch(list(streams) + [None] * (batch - len(streams)), arrays, mask,
                                 capacity, storage)
        self.gathers += 1
        return self.batch

    def _storage_shape(self, batch: int, past: int) -> tuple[int, int]:
        """Shared buffers' (rows, positions). Where every stream that may decode fits at the
        model's full length within the byte budget, that is allocated once: np.zeros maps
        untouched pages lazily, so memory follows the entries written, and the batch is
        never gathered again (streams join and leave by their own rows). Else rows to spare
        up to the next batch bucket and the next cache bucket above the next step's entry,
        gathered into bigger buffers when outgrown."""
        held = next_bucket(batch + 1, self.batch_buckets)  # > batch: rows to spare
        grown = next_bucket(past + 1, self.cache_buckets)
        if self.max_rows is None or self.max_past is None:
            return held, grown
        rows = max(held, next_bucket(self.max_rows, self.batch_buckets))
        if rows * self.max_past * self.bytes_per_token <= self.budget_bytes:
            return rows, max(self.max_past, grown)
        return held, grown

    def _in_place(self, b: DecodeBatch, joining: Sequence) -> bool:
        if b.storage is not None:
            self._compact(b)
            longest = max((s.computed for s in joining), default=0)
            if longest > b.past:
                if longest >= b.capacity:
                    return False
                b.widen(longest)
        elif any(s.computed > b.past for s in joining):
            return False
        short = len(joining) - sum(s is None for s in b.slots)
        if short > 0 and not b.grow(short):
            return False
        free = [i for i, s in enumerate(b.slots) if s is None]
        for slot, s in zip(free, joining):
            place_row(self.record, b.arrays, b.mask, slot, self.own(s))
            b.slots[slot], s.slot, s.cache = s, slot, None
        return True

    def _compact(self, b: DecodeBatch) -> None:
        """Shared buffers: each free row below the last stream's takes the last stream's
        row (a copy of that row's entries, from position 0), and the batch ends at its last
        stream (or that many rows' bucket): a stream that ends costs one row's copy, not a
        gather, and no step computes a hole."""
        while None in b.slots:
            used = [i for i, s in enumerate(b.slots) if s is not None]
            to = b.slots.index(None)
            if not used or to > used[-1]:
                break
            at = used[-1]
            n = int(b.mask[at].sum())
            for name in self.record.past:
                a = b.arrays[name]
                a[seq_index(self.record, to, slice(0, n))] = a[seq_index(self.record, at,
                                                                        slice(0, n))]
            b.mask[to], b.mask[at] = b.mask[at], 0
            b.slots[to], b.slots[at] = b.slots[at], None
            b.slots[to].slot = to
        used = sum(s is not None for s in b.slots)
        b.shrink(next_bucket(used, self.batch_buckets) if self.pad_to == "bucket" else used)

    def _wasteful(self, b: DecodeBatch, streams: Sequence) -> bool:
        """Freed rows and holes over half the batch's positions: a gather costs less
        (shared buffers compact instead)."""
        if b.storage is not None:
            return False
        kept = sum(s.computed for s in streams)
        return kept * 2 < len(b.slots) * b.past and self.padded(
            len(streams), max(s.computed for s in streams)) != (len(b.slots), b.past)

    def advance(self, b: DecodeBatch, mask: np.ndarray,
                presents: dict[str, np.ndarray] | None) -> None:
        """After a decode step: its mask and presents (None: written into the shared
        buffers) are the next past."""
        b.mask = mask
        if presents is not None:
            b.arrays = presents

    def rewind(self, stream, entries: int) -> None:
        """A decoding stream's row keeps its first `entries` entries: a speculative run wrote
        the entries of drafts that were not accepted after them (tuner.gate.decode_step.rewind).
        Shared buffers: the mask then ends at the longest row again, so that the buffers' room
        is not spent on entries nobody reads."""
        b = self.batch
        b.mask = rewind(b.mask, stream.slot, entries)
        if b.storage is not None:  # rows at the start: row i's entries are [0, sum of its mask)
            b.mask = b.mask[:, :int(b.mask.sum(1).max())]

    def _reusable(self, rows: int, capacity: int | None) -> dict[str, np.ndarray] | None:
        """The idle shared buffers, where the next batch's are of their shape. Writing into
        pages never touched costs a page fault each: placing a 128-entry row into new
        buffers took ~10 ms on 2 cores against ~0.1 ms into touched ones, so a burst after
        an idle moment paid ~0.35 s of 5 s (32 streams) re-faulting what it had just freed."""
        kept, self._idle = self._idle, None
        if kept is None or capacity is None:
            return None
        return kept if all(a.shape == self.record.past_shape(rows, capacity, n)
                           for n, a in kept.items()) else None

    def clear(self) -> None:
        """Nothing is decoding: drop the batch. Shared buffers that fit the byte budget at
        full length are kept for the next one (allocated once, as _storage_shape says);
        what they hold is never read again (each row's mask starts empty)."""
        b = self.batch
        if b is not None and b.storage is not None and self.max_rows is not None:
            self._idle = b.storage
        self.batch = None
