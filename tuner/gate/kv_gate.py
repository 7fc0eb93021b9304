"""The accuracy gate for decoders exported with a KV cache (docs/design.md, "Decoders
with a KV cache"): short greedy generations, each model fed its own `present` as its next `past`,
logits compared at every step (kept positions only) and the cache on the original positions.

    feeds = gate_feeds(model, vocab)        # CacheFeeds for a cache model, plain feeds otherwise
    result = check(reference, candidate, feeds, Tolerance(), widened={})   # a VerifyResult

`check` is what the one entry to the gate (tuner.gate.entry.GateCheck) runs: plain feed
dicts go to tuner.gate.verify.verify, CacheFeeds to `verify_cache_model`; both compare
through tuner.gate.verify.Stats. A candidate whose
cache interface was widened (the `widen` policy) is fed the reference's pasts scattered into
its wider shape (zeros in the new entries; `widened` is the map the rewrite recorded, see
tuner.graph.kv_cache.widened_cache), and its presents are compared on the original entries.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import onnx_ir as ir

from tuner.errors import one_line
from tuner.gate.decode_step import last_only
from tuner.gate.feeds import DEFAULT_SHAPES, make_feeds
from tuner.gate.kv_feeds import (Rollout, StepFeeds, decode_feeds, greedy_rollout, prefill_feeds,
                                 served_feeds)
from tuner.gate.right_pad import adapted
from tuner.gate.verify import (REFERENCE_FAILED, Stats, Tolerance, TolerancePolicy, VerifyResult,
                               tolerance_label, verify)
from tuner.graph.cache_record import CacheRecord, cache_record
from tuner.graph.kv_cache import CachePads, find_kv_cache
from tuner.graph.lm_head import KEEP
from tuner.graph.role_names import ENCODER_ROLES, KV_CACHE
from tuner.graph.roles import InputSpec, input_specs

# (batch, seq, left-padded rows, steps) of the prefill rollouts; (batch, past, seq, steps) of
# the decode rollouts (seq 1: a decode step; seq 3: a chunk)
PREFILL = ((2, 6, 1, 4), (1, 3, 0, 3))
DECODE = ((2, 7, 1, 3), (2, 5, 3, 2))
# The server's shapes (tuner.gate.decode_step): (cache length of each row, new tokens of each
# row, batch, past, steps): rows of different lengths left-padded in one batch; a batch and a
# past padded to their buckets (padding rows); a prompt chunk beside decoding rows.
SERVED = (((3, 9), (1, 1), None, None, 3), ((2, 6), (1, 1), 4, 16, 2),
          ((0, 5, 8), (4, 1, 1), None, None, 2))
# An encoder-decoder's with-past decoder: (batch, seq, past) of its steps
SEQ2SEQ_STEPS = ((1, 1, 5), (2, 1, 12), (3, 3, 9))


@dataclass(frozen=True)
class CacheFeeds:
    """The gate's inputs for a cache model: first steps and how many steps to roll from each.
    `len()` is the number of rollouts (what the gate's table calls feeds)."""

    roles: CacheRecord
    starts: tuple[tuple[StepFeeds, int], ...]

    def __len__(self) -> int:
        return len(self.starts)

    def __post_init__(self) -> None:
        if not self.starts or any(steps < 1 for _, steps in self.starts):
            raise ValueError("CacheFeeds needs at least one start of >= 1 steps")


def has_cache(model: ir.Model) -> bool:
    return find_kv_cache(model.graph) is not None


def cache_feeds(roles: CacheRecord, vocab_size: int, seed: int = 0) -> CacheFeeds:
    """Prefill rollouts (past 0, one left-padded row), decode rollouts from a random cache
    of past P (seq 1 and seq 3), and the server's shapes (SERVED; graphs of a static batch
    or that take no chunk beside a past get only the shapes they run)."""
    rng = np.random.default_rng(seed)
    starts: list[tuple[StepFeeds, int]] = []
    for batch, seq, padded, steps in PREFILL:
        batch = roles.batch or batch
        ids = rng.integers(0, vocab_size, (batch, seq))
        mask = np.ones_like(ids)
        for row in range(1, min(1 + padded, batch)):
            mask[row, :seq // 3] = 0  # left padding: what generate() batches prompts with
        starts.append((prefill_feeds(roles, ids, mask), steps))
    for i, (batch, past, seq, steps) in enumerate(DECODE):
        if seq > 1 and roles.cache.mask == "lengths":
            batch = 1  # GroupQueryAttention runs a chunk against a past at batch 1 only
        starts.append((decode_feeds(roles, roles.batch or batch, past, seq, vocab_size,
                                    seed=seed + 1 + i), steps))
    if roles.batch is None and roles.takes_chunks:
        for i, (lengths, chunks, batch, past, steps) in enumerate(SERVED):
            if roles.cache.mask == "lengths" and max(chunks) > 1:
                continue  # GroupQueryAttention runs a chunk against a past at batch 1 only
            starts.append((served_feeds(roles, lengths, chunks, vocab_size, batch, past,
                                        seed=seed + 11 + i), steps))
    return CacheFeeds(roles, tuple(starts))


def gate_feeds(model: ir.Model, vocab_size: int, shapes: Sequence[tuple[int, int]] | None = None,
               seed: int = 0):
    """What the gate runs `model`'s variants on: CacheFeeds for a cache model, plain feed
    dicts for an encoder-decoder's decoder (`crossing_feeds`), else plain feed dicts
    (tuner.gate.feeds.make_feeds at `shapes`)."""
    specs = input_specs(model)
    if any(s.role in ENCODER_ROLES for s in specs):
        return crossing_feeds(specs, vocab_size, shapes or DEFAULT_SHAPES, seed)
    if has_cache(model):
        return cache_feeds(cache_record(model), vocab_size, seed)
    return make_feeds(specs, vocab_size, shapes or DEFAULT_SHAPES, seed=seed)


def crossing_feeds(specs: Sequence[InputSpec], vocab_size: int,
                   shapes: Sequence[tuple[int, int]], seed: int = 0) -> list[dict]:
    """An encoder-decoder's decoder, fed as one step at a time: each input from the encoder
    at the encoder's own length, its mask padded left and right. Without a cache, `shapes`;
    with one (the with-past file), decode steps and a chunk against random caches
    (SEQ2SEQ_STEPS). No rollout: its rows never differ in length (every row starts from the
    decoder's start token), so the server's row shapes do not arise."""
    if not any(s.role == KV_CACHE for s in specs):
        return make_feeds(specs, vocab_size, shapes, seed=seed)
    return [feed for i, (batch, seq, past) in enumerate(SEQ2SEQ_STEPS)
            for feed in make_feeds(specs, vocab_size, [(batch, seq)], seed=seed + i, past=past)]


def check(reference, candidate, feeds, tolerance: Tolerance | TolerancePolicy = Tolerance(),
          widened: CachePads | None = None, specs: Sequence[InputSpec] | None = None,
          min_compared: int = 1, kept: bool = False,
          positions: str | None = None) -> VerifyResult:
    """The gate: `verify_cache_model` for CacheFeeds (greedy rollouts), tuner.gate.verify.verify
    otherwise (`specs` say which input is the mask; fewer than `min_compared` compared elements
    in an output fail). `kept`: the candidate takes `logits_to_keep`; `positions`: its
    defaulted position input (cache models only)."""
    if isinstance(feeds, CacheFeeds):
        return verify_cache_model(reference, candidate, feeds, tolerance, widened or {},
                                  min_compared, kept, positions)
    return verify(reference, candidate, feeds, tolerance, specs, min_compared)


# ---------------------------------------------------------------------------------------------
# Widened caches


def _scatter(arr: np.ndarray, entries) -> np.ndarray:
    for axis, pos, new in entries:
        shape = list(arr.shape)
        shape[axis] = new
        out = np.zeros(shape, arr.dtype)
        index = [slice(None)] * arr.ndim
        index[axis] = list(pos)
        out[tuple(index)] = arr
        arr = out
    return arr


def narrow(arr: np.ndarray, entries) -> np.ndarray:
    for axis, pos, _ in entries:
        arr = np.take(arr, list(pos), axis=axis)
    return arr


def widen_feeds(step: StepFeeds, widened: CachePads) -> StepFeeds:
    """`step` for a model whose cache inputs are wider: pasts scattered, zeros elsewhere."""
    if not widened:
        return step
    arrays = {n: (_scatter(a, widened[n]) if n in widened else a) for n, a in step.arrays.items()}
    return replace(step, arrays=arrays)


class SlotPositions:
    """A candidate given a defaulted position input (tuner.rewrite.position_ids), fed the
    positions its original counts from the cache's length: past + 0 .. S - 1 on every row.
    Fed so, the rewrite must compute what the original computes, bit for bit; that rows may
    then move with their own positions fed is tuner.gate.row_moves' check, the server's."""

    def __init__(self, runner, name: str, record: CacheRecord) -> None:
        self.runner, self.name, self.record = runner, name, record

    def infer(self, feeds):
        ids = feeds[self.record.input_ids]  # (B, S)
        past = feeds[self.record.past[0]].shape[self.record.layout.index("s")]
        slots = np.arange(past, past + ids.shape[1], dtype=np.int64)  # (S,)
        return self.runner.infer({**feeds, self.name: np.tile(slots, (ids.shape[0], 1))})


# ---------------------------------------------------------------------------------------------
# The comparison


@dataclass(frozen=True)
class RecordedRollouts:
    """The reference's rollout of every start, run once and kept: a rollout of the reference
    never depends on the candidate's, so its session can be let go before a candidate loads
    (one model in memory at a time, as for plain feeds). Each entry is the Rollout, or the
    first line of the error that stopped it."""

    runs: tuple[Rollout | str, ...]

    @property
    def failure(self) -> str | None:
        """The first error that stopped one of the reference's rollouts, if any."""
        return next((run for run in self.runs if isinstance(run, str)), None)

    def close(self) -> None:
        pass


def record_rollouts(load, feeds: CacheFeeds) -> RecordedRollouts:
    """Load the reference (`load()`), roll it out from every start of `feeds`, and let its
    session go before returning."""
    runner, runs = load(), []
    try:
        for start, steps in feeds.starts:
            try:
                runs.append(rollout(runner, start, steps))
            except Exception as e:  # noqa: BLE001 - kept: the gate then fails closed on it
                runs.append(one_line(e))
    finally:
        # the runner drops its session: freed now, whatever still holds the runner (no
        # full collection: in a process with torch loaded one takes ~0.3 s, and the suite
        # gates hundreds of cache models)
        runner.close()
    return RecordedRollouts(tuple(runs))


def rollout(runner, start: StepFeeds, steps: int, forced: np.ndarray | None = None) -> Rollout:
    """The greedy rollout (tuner.gate.kv_feeds.greedy_rollout) of `runner` from `start`;
    `forced`: fed those tokens instead (teacher forced)."""
    # a graph that reads its mask as lengths (GroupQueryAttention) gets the left-padded rows
    # moved to the right and back (tuner.gate.right_pad)
    return greedy_rollout(adapted(runner, start.record).infer, start, steps, forced)


def compare_kept(stats: Stats, candidate, start: StepFeeds, ref_logits: np.ndarray,
                  served: StepFeeds, tolerance, errors: list[str], what: str) -> None:
    """The candidate's first step of `start` (`served`: as the server feeds it) run for each
    row's last logits only, as the server runs a prompt (tuner.gate.decode_step.last_only),
    against the reference's logits (B, S, vocab) at each row's last token."""
    feeds = last_only(replace(served, record=replace(served.record, keep_logits=KEEP)))
    try:
        cut = np.asarray(candidate.infer(feeds.arrays)[start.record.logits])
    except Exception as e:  # noqa: BLE001 - a candidate that cannot run fails the gate
        errors.append(f"{what}: the candidate failed to run with {KEEP}: {one_line(e)}")
        return
    if cut.shape[:2] != (start.mask.shape[0], feeds.keep):
        stats.fail(f"{KEEP}={feeds.keep} gave logits {cut.shape}")
        return
    rows = np.arange(len(cut))
    stats.add(start.record.logits, ref_logits[rows, start.last], cut[rows, feeds.logit_slots],
              tolerance)


def keeps(start: StepFeeds) -> bool:
    """Whether a start fits a check of the kept logits: more than one new position, run as
    the server runs it (a graph that reads its mask as lengths takes no left-padded rows
    there: tuner.gate.right_pad moves them, which a run of kept positions cannot follow)."""
    return start.seq > 1 and (start.record.cache.mask != "lengths"
                              or not (start.mask[:, 0] == 0).any())


def rollout_stats(roles: CacheRecord, kept: bool) -> tuple[dict[str, Stats], str]:
    """A Stats for each output a rollout compares (the logits, every present, and for a
    variant that keeps logits each row's last ones) and the name of that last one."""
    stats = {name: Stats() for name in [roles.logits, *roles.past_to_present.values()]}
    last = f"{roles.logits} (each row's last position, {KEEP})"
    if kept:
        stats[last] = Stats()
    return stats, last


def rollout_name(i: int, start: StepFeeds) -> str:
    return f"rollout {i} (batch {start.mask.shape[0]}, past {start.past}, seq {start.seq})"


def verify_cache_model(reference, candidate, feeds: CacheFeeds,
                       tolerance: Tolerance | TolerancePolicy = Tolerance(),
                       widened: CachePads | None = None, min_compared: int = 1,
                       kept: bool = False, positions: str | None = None) -> VerifyResult:
    """Roll both models greedily from every start in `feeds` and compare logits at every step
    (positions the mask keeps) and the final cache (on the original entries when `widened`).
    `kept` (a candidate that takes `logits_to_keep`): also its first step of every start of
    more than one new position run for the rows' last logits only, against the reference's
    logits there. `positions` (a candidate given a defaulted position input): the candidate
    is fed the positions the reference counts from its slots (SlotPositions). Fails closed:
    a model that does not run, a flipped greedy token, a missing output, an output with
    fewer than `min_compared` compared elements (so a `kept` check that found no start to
    run fails). The comparison is the plain gate's own
    (tuner.gate.verify.Stats)."""
    if min_compared < 1:
        raise ValueError(f"min_compared must be >= 1, not {min_compared}")
    widened = widened or {}
    label = (tolerance_label(tolerance)
             + f"; {len(feeds)} greedy rollouts, each model fed its own present"
             + (f"; the candidate fed {positions} as its slots" if positions else ""))
    roles = feeds.roles
    presents = list(roles.past_to_present.values())
    stats, last = rollout_stats(roles, kept)
    errors: list[str] = []
    fed = SlotPositions(candidate, positions, roles) if positions else candidate
    for i, (start, steps) in enumerate(feeds.starts):
        what = rollout_name(i, start)
        try:
            ref = reference.runs[i] if isinstance(reference, RecordedRollouts) else \
                rollout(reference, start, steps)
            if isinstance(ref, str):
                raise RuntimeError(ref)
        except Exception as e:  # noqa: BLE001 - nothing to compare against: the gate fails
            errors.append(f"{what}: {REFERENCE_FAILED}: {one_line(e)}")
            continue
        served = widen_feeds(start, widened)
        try:
            got = rollout(fed, served, steps)
        except Exception as e:  # noqa: BLE001 - a candidate that cannot run fails the gate
            errors.append(f"{what}: the candidate failed to run: {one_line(e)}")
            continue
        diverged = False
        for step, (r, g, m) in enumerate(zip(ref.logits, got.logits, ref.query_masks)):
            stats[roles.logits].add(roles.logits, r, g, tolerance, mask=m)
            if not np.array_equal(ref.tokens[:, step], got.tokens[:, step]):
                errors.append(f"{what}: step {step}: greedy tokens differ")
                diverged = True
                break
        if diverged:  # the caches now hold other tokens: comparing them says nothing more
            continue
        if kept and keeps(start):
            compare_kept(stats[last], fed, start, ref.logits[0], served, tolerance,
                          errors, what)
        for name in presents:
            if name not in got.cache:
                stats[name].fail("missing in the candidate")
                continue
            stats[name].add(name, ref.cache[name], narrow(got.cache[name], widened.get(name, ())),
                            tolerance, top1=False)
    reports = tuple(s.report(n, min_compared) for n, s in stats.items())
    return VerifyResult(reports, len(feeds), label, tuple(errors), min_compared)



class WidenedRunner:
    """A runner for a model whose cache interface was widened, fed feeds of the original
    cache shape (what the benchmark builds for every variant): pasts are scattered into the
    wider shape, zeros in the new entries, once per feeds object (timing repeats no copy).
    With `narrow`, presents come back on the original entries (a copy per call, so the
    benchmark leaves it off: a server that owns a wide cache never narrows it)."""

    def __init__(self, runner, widened: CachePads, narrow: bool = False) -> None:
        self.runner, self.widened, self.narrow = runner, widened, narrow
        self.name = getattr(runner, "name", "widened")
        self._memo: tuple[object, dict] | None = None

    def infer(self, feeds):
        if self._memo is None or self._memo[0] is not feeds:
            self._memo = (feeds, {n: (_scatter(a, self.widened[n]) if n in self.widened else a)
                                  for n, a in feeds.items()})
        out = self.runner.infer(self._memo[1])
        if not self.narrow:
            return out
        return {n: (narrow(a, self.widened[n]) if n in self.widened else a)
                for n, a in out.items()}

    def close(self) -> None:
        self.runner.close()
