"""The check of tuner.rewrite.unwindow, by running: greedy rollouts at batch 1 of the
windowed graph, fed buffers of its own capacity, against the rewritten graph, fed the whole
past (tuner.gate.decode_step builds its steps, as the server's runner does); the logits of
every position of every step compared (tuner.gate.verify.Stats), the rewritten graph fed
the windowed graph's greedy tokens.

The rollouts cross what the windowed buffer does (W the window, C the capacity):

    prompt W - 2, then decode steps past W           the window fills during decoding
    prompt W + 3 (C = W), then decode steps          a prefill longer than its buffer, then
                                                     compaction at every step
    prompt W + 5 in 3 chunks (C = W + 3)             chunks after a past (the server's
                                                     chunked prefill), compaction every 4 steps

One session at a time: the windowed graph's logits are recorded and it is released before
the rewritten one loads. The check fails closed: nothing compared is a failure.

    result = check_unwindowed(load_windowed, load_full, record, found, vocab)
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from tuner.gate.decode_step import empty_past, step_feeds
from tuner.gate.verify import Stats, Tolerance, VerifyResult, tolerance_label
from tuner.graph.cache_record import CacheRecord
from tuner.graph.windowed import WindowedCache
from tuner.runtime.base import Runner

STEPS = 6  # decode steps after each prompt: past one compaction at C = W + 3 (every 4)


@dataclass(frozen=True)
class Rollout:
    pieces: tuple[tuple[int, ...], ...]  # the prompt, in the chunks it is fed in
    steps: int  # greedy decode steps after it
    capacity: int  # the windowed buffers' positions


def rollouts(window: int, vocab: int, positions: int | None = None,
             seed: int = 0) -> tuple[Rollout, ...]:
    """The three rollouts above, their prompts random ids below `vocab`; lengths kept within
    `positions` (the model's rotary table) where it is shorter."""
    rng = np.random.default_rng(seed)
    limit = (positions - STEPS) if positions else None

    def prompt(n: int) -> tuple[int, ...]:
        n = max(1, min(n, limit) if limit else n)
        return tuple(int(t) for t in rng.integers(0, vocab, n))

    long = prompt(window + 5)
    third = -(-len(long) // 3)
    chunks = tuple(long[i:i + third] for i in range(0, len(long), third))
    return (Rollout((prompt(window - 2),), STEPS, window),
            Rollout((prompt(window + 3),), STEPS, window),
            Rollout(chunks, STEPS, window + 3))


def _windowed_logits(runner: Runner, record: CacheRecord, found: WindowedCache,
                     r: Rollout) -> tuple[list[np.ndarray], list[tuple[int, ...]]]:
    """The windowed graph's logits at every step of rollout `r` (greedy from its own), and
    each step's new tokens."""
    past, mask = empty_past(record, 1)
    for name in found.pasts:  # its windowed layers take their buffer, whatever the length
        past[name] = np.zeros(record.past_shape(1, r.capacity, name), past[name].dtype)
    logits, fed = [], []
    new: tuple[int, ...] = r.pieces[0]
    for step in range(len(r.pieces) + r.steps):
        feeds = step_feeds(record, [new], mask, past)  # the windowed buffers as they are
        out = runner.infer(feeds.arrays)
        logits.append(np.array(out[record.logits]))
        fed.append(new)
        past = {p: out[q] for p, q in record.past_to_present.items()}
        mask = feeds.mask
        nxt = step + 1
        new = r.pieces[nxt] if nxt < len(r.pieces) else (int(logits[-1][0, -1].argmax()),)
    return logits, fed


def _full_logits(runner: Runner, record: CacheRecord,
                 fed: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
    """The rewritten graph's logits fed the same tokens, its own whole past each step."""
    past, mask = empty_past(record, 1)
    logits = []
    for new in fed:
        feeds = step_feeds(record, [new], mask, past)
        out = runner.infer(feeds.arrays)
        logits.append(np.array(out[record.logits]))
        past = {p: out[q] for p, q in record.past_to_present.items()}
        mask = feeds.mask
    return logits


def check_unwindowed(load_windowed: Callable[[], Runner], load_full: Callable[[], Runner],
                     record: CacheRecord, found: WindowedCache, vocab: int,
                     tolerance: Tolerance = Tolerance(),
                     positions: int | None = None) -> VerifyResult:
    """The rewritten graph (`record` is its cache record) against the windowed one, over
    the rollouts above; a VerifyResult whose one output is the logits."""
    plans = rollouts(found.window, vocab, positions)
    runner = load_windowed()
    try:
        recorded = [_windowed_logits(runner, record, found, r) for r in plans]
    finally:
        runner.close()
        del runner
        gc.collect()
    stats = Stats()
    runner = load_full()
    try:
        for ref, fed in recorded:
            for want, got in zip(ref, _full_logits(runner, record, fed)):
                stats.add(record.logits, want, got, tolerance)
    finally:
        runner.close()
    return VerifyResult((stats.report(record.logits),), len(plans), tolerance_label(tolerance))
