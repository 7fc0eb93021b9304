"""The decode batch's shared buffers and the prefill runs on onnxruntime-genai's own graph
(GroupQueryAttention: rows start at position 0, past and present one buffer): spare rows to
join without a gather, buffers allocated once where the byte budget holds them at full length
(a longer joiner widens the mask, an ended row takes the last one), and prefill chunks
grouped into runs by length. The engine-level exactness of the same paths (every stream equal
to a plain greedy loop) is in tests/test_genai_graphs.py."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from models import genai_builder
from tuner.graph.cache_record import cache_record
from tuner.graph.load import load_model

pytestmark = pytest.mark.venv(*genai_builder.VENV)  # built beside the first tests (conftest)


class _Row:
    """What the cache manager reads of a stream: its length, its slot and its own cache
    (random entries; `want` keeps a copy to compare with)."""

    def __init__(self, record, n: int, rng: np.random.Generator) -> None:
        self.computed, self.slot, self.prefix_counted = n, None, True
        self.cache = {name: rng.standard_normal(record.past_shape(1, n, name)).astype(np.float32)
                      for name in record.past}
        self.want = {k: v.copy() for k, v in self.cache.items()}


def test_a_stream_joins_shared_buffers_in_a_spare_row_without_a_gather():
    """Shared buffers hold rows to spare (the next batch bucket): a third stream joining a
    batch of two takes row 2 of the same storage (views grow, nothing else is copied), its
    entries written there from position 0 and its mask row keeping exactly them; the rows
    already there are untouched. With no spare row left, the rows are gathered anew."""
    from serving.generation.cache import CacheManager

    record = cache_record(load_model(genai_builder.cached("llama", "fp32")))
    cache = CacheManager(record, 10_000 * record.bytes_per_token, "longest", shared=True)
    rng = np.random.default_rng(0)
    Row = functools.partial(_Row, record, rng=rng)

    a, b, c = Row(5), Row(9), Row(7)
    batch = cache.decode_batch([a, b])
    name = record.past[0]
    storage = batch.storage[name]
    assert (len(batch.slots), batch.past, len(storage), cache.gathers) == (2, 9, 4, 1)
    before = storage[:2].copy()
    joined = c.cache[name]
    assert cache.decode_batch([a, b, c]) is batch and cache.gathers == 1
    assert np.shares_memory(batch.arrays[name], storage) and len(batch.arrays[name]) == 3
    assert np.array_equal(storage[:2], before)
    axis = record.layout.index("s")
    assert np.array_equal(np.take(storage[2:3], range(7), axis=axis), joined)
    assert batch.mask[2].tolist() == [1] * 7 + [0] * 2
    d, e = Row(3), Row(4)
    assert cache.decode_batch([a, b, c, d]) is batch  # the last spare row
    assert cache.decode_batch([a, b, c, d, e]) is not batch and cache.gathers == 2


def test_preallocated_shared_buffers_never_gather_as_streams_join_and_leave():
    """Where every stream that may decode fits at the model's full length within the byte
    budget, the shared buffers are allocated once (max rows x max positions): a joiner
    longer than the batch's past widens the mask in place, a stream that ends in the middle
    is replaced by the last row (that row's entries copied, from position 0) and the batch
    shrinks to its streams; every stream's entries stay what they were, with no gather.
    Past the budget, the buffers grow by gathers as before."""
    from serving.generation.cache import CacheManager

    record = cache_record(load_model(genai_builder.cached("llama", "fp32")))
    Row = functools.partial(_Row, record, rng=np.random.default_rng(1))

    def check(cache, *rows):
        for r in rows:
            got = cache.own(r)
            for name in record.past:
                np.testing.assert_array_equal(got[name], r.want[name])

    cache = CacheManager(record, 8 * 64 * record.bytes_per_token, "longest", shared=True,
                         max_past=64, max_rows=6)
    a, b, c, d = Row(5), Row(9), Row(7), Row(20)
    batch = cache.decode_batch([a, b, c])
    name, axis = record.past[0], record.layout.index("s")
    assert batch.storage[name].shape[0] == 8 and batch.storage[name].shape[axis] == 64
    assert (len(batch.slots), batch.past, batch.capacity, cache.gathers) == (3, 9, 64, 1)
    assert cache.decode_batch([a, b, c, d]) is batch and batch.past == 20  # widened in place
    assert d.slot == 3 and batch.mask[3].sum() == 20 and batch.mask[0].sum() == 5
    check(cache, a, b, c, d)
    cache.release(b)  # row 1 freed: d (the last) moves there, the batch is three rows
    assert cache.decode_batch([a, c, d]) is batch and cache.gathers == 1
    assert (len(batch.slots), d.slot, batch.mask.shape[0]) == (3, 1, 3)
    assert np.shares_memory(batch.arrays[name], batch.storage[name])
    check(cache, a, c, d)

    tight = CacheManager(record, 4 * 64 * record.bytes_per_token, "longest", shared=True,
                         max_past=64, max_rows=6)  # 8 rows x 64 positions do not fit
    first = tight.decode_batch([Row(5), Row(9)])
    assert first.storage[name].shape[0] == 4 and first.capacity == 16


def test_idle_shared_buffers_are_kept_for_the_next_batch():
    """Shared buffers allocated once are kept while nothing decodes (`clear()`): the next
    batch is placed into the same memory (pages already touched: a burst after an idle
    moment pays no page fault per page), each row holding exactly its new stream's entries
    and mask, whatever the old rows left beyond them (never read: the engine tests in
    tests/test_genai_graphs.py run a second burst through kept buffers and equal a plain
    greedy loop). Buffers of another shape (a tight budget's, grown by gathers) are dropped."""
    from serving.generation.cache import CacheManager

    record = cache_record(load_model(genai_builder.cached("llama", "fp32")))
    Row = functools.partial(_Row, record, rng=np.random.default_rng(2))
    name = record.past[0]
    cache = CacheManager(record, 8 * 64 * record.bytes_per_token, "longest", shared=True,
                         max_past=64, max_rows=6)
    old = cache.decode_batch([Row(20), Row(9)])
    cache.clear()
    assert cache.batch is None
    c, d = Row(5), Row(7)
    new = cache.decode_batch([c, d])
    assert new is not old and new.storage[name] is old.storage[name]
    assert new.mask.tolist() == [[1] * 5 + [0] * 2, [1] * 7]
    for r in (c, d):
        got = cache.own(r)
        for n in record.past:
            np.testing.assert_array_equal(got[n], r.want[n])
    axis = record.layout.index("s")  # the old row 0's entries 5..19 are still there, masked
    assert np.abs(np.take(new.storage[name][:1], range(5, 20), axis=axis)).sum() > 0

    tight = CacheManager(record, 4 * 64 * record.bytes_per_token, "longest", shared=True,
                         max_past=64, max_rows=6)  # grown buffers: not kept
    first = tight.decode_batch([Row(5), Row(9)])
    tight.clear()
    assert tight.decode_batch([Row(30), Row(3)]).storage[name] is not first.storage[name]


def test_prefill_runs_group_chunks_of_like_length():
    """A prefill run is padded to its longest chunk: chunks share a run only while the
    padding stays within PAD_SLACK of their tokens; on GroupQueryAttention's graphs each
    chunk after a past runs alone."""
    from serving.generation.runner import StepRunner

    record = cache_record(load_model(genai_builder.cached("llama", "fp32")))
    runner = StepRunner(None, record, 1003)

    class S:
        def __init__(self, computed: int) -> None:
            self.computed = computed

    fresh = [(S(0), n) for n in (157, 84, 15)]
    assert runner._groups(fresh) == [[fresh[0]], [fresh[1]], [fresh[2]]]
    alike = [(S(0), n) for n in (92, 100, 96)]
    assert runner._groups(alike) == [[alike[1], alike[2], alike[0]]]
    after = (S(30), 64)
    assert runner._groups(alike + [after]) == [[alike[1], alike[2], alike[0]], [after]]
