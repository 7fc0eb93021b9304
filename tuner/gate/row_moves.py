"""Whether rows may share a run: the check that lets a server batch streams. Two things must
hold for each stream to be what it is alone, and no structure is trusted for either; the
graph is run:

- a row's cached entries may move (`rows_move`): tuner.gate.decode_step left-pads a row that
  was computed alone when it joins a longer batch, so its entries move to later slots. Exact
  where the graph takes its positions from an input (the server feeds each row's own count)
  or from the mask; not where it counts them from the cache's length (Optimum's Gemma, Gemma
  2 and Gemma 3 take no position_ids: a moved row's new token gets its slot as its position
  while its keys kept the rotary angles they were computed at);
- a row is computed on its own (`rows_apart`): its logits beside another row are its logits
  alone. Not so where the activations are quantized with one range for the whole run
  (ONNX Runtime's quantize_dynamic: DynamicQuantizeLinear takes the min and max of every
  row's hidden states), so that each row's numbers depend on the others'.

- a chunk after a past may have masked slots before it (`holes_stay`): the server pads the
  prompt chunks of one run to the longest, so a shorter chunk after its cache has masked
  slots between the two. Not exact where the graph counts slots: ALiBi biased by slot index
  (Optimum's MPT), a sliding window (GPT-Neo's local layers, transformers' window masks),
  positions from the cache's length. There such a chunk runs apart from longer ones.

- a row may drop entries it wrote (`drafts_drop`): a speculative run feeds a token and its
  drafts after the row's cache, and the entries of drafts that were not accepted are then
  masked out (tuner.gate.decode_step.rewind). Exact where masked entries count for nothing;
  not where the graph counts slots or takes positions from the cache's length (as above).
  There the server does not speculate.

    probe = RowProbe(runner, record)   # the runs the checks share, made once
    exact = probe.rows_move() and probe.rows_apart()
    mixed = probe.holes_stay()         # chunks of different lengths may share a run
    speculate = probe.drafts_drop()    # a speculative run's rejected drafts may be dropped
"""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np

from tuner.gate.decode_step import (empty_past, last_only, next_feeds, pad_rows, rewind,
                                    row_cache, step_feeds)
from tuner.gate.verify import Tolerance
from tuner.graph.cache_record import CacheRecord

PROMPT = (5, 17, 9)  # token ids every vocabulary has, fed one per step (any graph takes seq 1)
OTHER = (11, 3, 23)  # another row's
MOVE = 16  # slots of left padding put before the moved row
# Moving a row, or running it beside another, changes nothing but how many masked entries a
# softmax sums and how a kernel tiles the batch: rounding (a few 1e-7 on the exports tried);
# where positions follow the cache's length, 1e-3 and more (Optimum's Gemma exports); where
# activations are quantized per run, the quantization step (1e-2 on a random Llama).
MOVED = Tolerance(atol=1e-5, rtol=1e-5)


def tolerance_for(backend: str, precision: str = "fp32", model: str = "fp32") -> Tolerance:
    """The checks' tolerance: MOVED for a float32 model on a CPU (measured there); else the
    gate's own at the half precision the model (`model`) or the backend (`precision`)
    computes in, or at float32's (a GPU library may pick another kernel for another batch:
    not measured, so not held to CPU rounding). A half-precision graph's rows round otherwise
    beside other rows: transformers.js' q4f16 GPT-2, Mistral and Phi moved 3e-5 to 5e-4 on a
    CPU (MatMulNBits' fp16 path runs one row and a batch apart), which MOVED took for a
    coupling and served one stream at a time; a dynamic-int8 graph's coupling is 0.2."""
    half = next((p for p in (model, precision) if p != "fp32"), None)
    if half is None and backend.endswith("cpu"):
        return MOVED
    return Tolerance().at_precision(half or "fp32")


def _logits(runner, record: CacheRecord, feeds) -> tuple[dict, np.ndarray]:
    out = runner.infer(feeds.arrays)
    return out, np.asarray(out[record.logits])[:, -1]  # (B, vocab): each row's last position


def _cached(runner, record: CacheRecord, tokens, batch: int) -> dict[str, np.ndarray]:
    """Row 0's own cache after `tokens`, fed one per step (the other rows are padding)."""
    arrays, mask = empty_past(record, batch)
    feeds = step_feeds(record, [[tokens[0]]], mask, arrays)
    for token in tokens[1:]:
        out, _ = _logits(runner, record, feeds)
        feeds = next_feeds(feeds, out, np.full(batch, token))
    out, _ = _logits(runner, record, feeds)
    presents = {p: out[q] for p, q in record.past_to_present.items()}
    return row_cache(record, presents, feeds.mask[0], 0)


def _next(runner, record: CacheRecord, rows, batch: int, past: int) -> np.ndarray:
    """Row 0's next logits (vocab,) with `rows` (their own caches) at a past of `past`."""
    arrays, mask = pad_rows(record, rows, batch, past)
    tokens = [[PROMPT[0]], [OTHER[0]]][:len(rows)]
    return _logits(runner, record, step_feeds(record, tokens, mask, arrays))[1][0]


class RowProbe:
    """The checks on one graph, sharing the runs they have in common (made once, when first
    needed): row 0's own cache, another row's, and row 0's next logits in place.
    `runner`: anything with `infer(feeds) -> {name: array}`; `batch`: the graph's smallest
    batch (the other rows are padding)."""

    def __init__(self, runner, record: CacheRecord, batch: int = 1,
                 tolerance: Tolerance = MOVED) -> None:
        self.runner, self.record, self.batch, self.tolerance = runner, record, batch, tolerance

    @functools.cached_property
    def row(self) -> dict[str, np.ndarray]:
        return _cached(self.runner, self.record, PROMPT, self.batch)

    @functools.cached_property
    def other(self) -> dict[str, np.ndarray]:
        return _cached(self.runner, self.record, OTHER, self.batch)

    @functools.cached_property
    def here(self) -> np.ndarray:
        """Row 0's next logits (vocab,), its cache in place, alone."""
        return _next(self.runner, self.record, [self.row], self.batch, len(PROMPT))

    def rows_move(self) -> bool:
        """True when row 0's next logits are the same (within the tolerance) with its cache
        in place and moved MOVE slots later; rows at the start (GroupQueryAttention) never
        move."""
        if self.record.rows_at_start:
            return True
        moved = _next(self.runner, self.record, [self.row], self.batch, len(PROMPT) + MOVE)
        return self.tolerance(self.record.logits, self.here, moved)

    def rows_apart(self) -> bool:
        """True when row 0's next logits are the same (within the tolerance) alone and
        beside another row of its length; True for a graph whose batch is fixed (its rows
        always meet)."""
        if self.record.batch is not None:
            return True
        beside = _next(self.runner, self.record, [self.row, self.other], max(self.batch, 2),
                       len(PROMPT))
        return self.tolerance(self.record.logits, self.here, beside)

    def holes_stay(self) -> bool:
        """True when row 0's chunk after its cache gets the same logits (within the
        tolerance) beside a row whose chunk is MOVE tokens longer, MOVE masked slots then
        lying between its cache and its chunk, as alone. Checked beside the other row's
        chunk, as the server runs it: ask it where `rows_apart` holds. True where no such run
        happens: a graph that takes no chunk after a past, whose batch is fixed at 1, or
        that keeps rows at the start (the server runs its chunks after a past alone)."""
        record = self.record
        if record.rows_at_start or not record.takes_chunks or record.batch == 1:
            return True
        chunk = list(OTHER[:2])
        longer = [OTHER[i % len(OTHER)] for i in range(len(chunk) + MOVE)]
        alone = _chunk(self.runner, record, [self.row], [chunk], self.batch)
        beside = _chunk(self.runner, record, [self.row, self.other], [chunk, longer],
                        max(self.batch, 2))
        return self.tolerance(record.logits, alone, beside)

    def drafts_drop(self) -> bool:
        """True when row 0's logits after a speculative run whose two drafts were dropped
        (OTHER[0] and two drafts fed after its cache, the drafts' entries masked out by
        `rewind`, then OTHER[1] fed) are the same (within the tolerance) as after OTHER[0]
        and OTHER[1] fed one per step. False for a graph that takes no chunk after a past,
        and for left padding under a sliding window: the window counts slots, so holes move
        its edge, which the probe's few entries never reach (GPT-Neo's local layers pass it)."""
        record, runner, batch = self.record, self.runner, self.batch
        if not record.takes_chunks or (record.window is not None and not record.rows_at_start):
            return False
        arrays, mask = pad_rows(record, [self.row], batch, len(PROMPT))
        then = np.full(batch, OTHER[1])

        def after(feeds, entries: int) -> np.ndarray:  # row 0's logits at OTHER[1]
            out, _ = _logits(runner, record, feeds)
            kept = replace(feeds, mask=rewind(feeds.mask, 0, entries))
            return _logits(runner, record, next_feeds(kept, out, then))[1][0]

        entries = len(PROMPT) + 1
        plain = after(step_feeds(record, [[OTHER[0]]], mask, arrays), entries)
        drafts = [OTHER[0], OTHER[2], PROMPT[1]]
        dropped = after(step_feeds(record, [drafts], mask, arrays), entries)
        return self.tolerance(record.logits, plain, dropped)


def rows_move(runner, record: CacheRecord, batch: int = 1, tolerance: Tolerance = MOVED) -> bool:
    """RowProbe.rows_move on its own."""
    return RowProbe(runner, record, batch, tolerance).rows_move()


def rows_apart(runner, record: CacheRecord, batch: int = 1, tolerance: Tolerance = MOVED) -> bool:
    """RowProbe.rows_apart on its own."""
    return RowProbe(runner, record, batch, tolerance).rows_apart()


def holes_stay(runner, record: CacheRecord, batch: int = 1, tolerance: Tolerance = MOVED) -> bool:
    """RowProbe.holes_stay on its own."""
    return RowProbe(runner, record, batch, tolerance).holes_stay()


def _chunk(runner, record: CacheRecord, rows, chunks, batch: int) -> np.ndarray:
    """Row 0's logits at its last token (vocab,): each row's chunk after its own cache (the
    head on the last position only, where the graph takes logits_to_keep, as served)."""
    arrays, mask = pad_rows(record, rows, batch, len(PROMPT))
    return _logits(runner, record, last_only(step_feeds(record, chunks, mask, arrays)))[1][0]
