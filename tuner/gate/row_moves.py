"""Whether a row's cached entries may move: the check that lets a server batch rows of
different lengths (tuner.gate.decode_step left-pads a row that was computed alone when it
joins a longer batch, so its entries move to later slots).

That is exact when the graph takes its positions from an input (the server feeds each row's
own count) or from the mask. Some exports compute them from the cache's length instead
(Optimum's Gemma, Gemma 2 and Gemma 3: no position_ids input, `cache_position` = past
length + arange): there a moved row's new token gets its slot as its position while its
keys kept the rotary angles they were computed at, and every stream that shares a batch
with a longer one generates something else than alone. No structure is trusted for this;
the graph is run:

    exact = rows_move(runner, record, batch=1)   # a row in place vs moved by MOVE slots
"""

from __future__ import annotations

import numpy as np

from tuner.gate.decode_step import (empty_past, next_feeds, pad_rows, row_cache, step_feeds)
from tuner.gate.verify import Tolerance
from tuner.graph.cache_record import CacheRecord

PROMPT = (5, 17, 9)  # token ids every vocabulary has, fed one per step (any graph takes seq 1)
MOVE = 16  # slots of left padding put before the moved row


def _logits(runner, record: CacheRecord, feeds) -> tuple[dict, np.ndarray]:
    out = runner.infer(feeds.arrays)
    return out, np.asarray(out[record.logits])[0, -1]  # (vocab,) the row's last position


# Moving a row changes nothing but how many masked entries a softmax sums: rounding (a few
# 1e-7 on the exports tried) where positions are the row's own; where they follow the
# cache's length, 1e-3 and more (Optimum's Gemma exports).
MOVED = Tolerance(atol=1e-5, rtol=1e-5)


def rows_move(runner, record: CacheRecord, batch: int = 1, tolerance: Tolerance = MOVED) -> bool:
    """True when row 0's next logits are the same (within `tolerance`) with its cache in
    place and moved MOVE slots later; rows at the start (GroupQueryAttention) never move.
    `runner`: anything with `infer(feeds) -> {name: array}`; `batch`: the graph's smallest
    batch (the other rows are padding)."""
    if record.rows_at_start:
        return True
    arrays, mask = empty_past(record, batch)
    feeds = step_feeds(record, [[PROMPT[0]]], mask, arrays)
    for token in PROMPT[1:]:
        out, _ = _logits(runner, record, feeds)
        feeds = next_feeds(feeds, out, np.full(batch, token))
    out, _ = _logits(runner, record, feeds)  # the row's cache: PROMPT's entries
    presents = {p: out[q] for p, q in record.past_to_present.items()}
    row = row_cache(record, presents, feeds.mask[0], 0)
    length = len(PROMPT)
    logits = []
    for past in (length, length + MOVE):  # in place, then moved
        arrays, mask = pad_rows(record, [row], batch, past)
        logits.append(_logits(runner, record, step_feeds(record, [[PROMPT[0]]], mask, arrays))[1])
    return tolerance(record.logits, logits[0], logits[1])
