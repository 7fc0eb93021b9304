"""A variant of a half-precision original that fails against the original itself is held to
the original's float model instead (tuner.gate.upcast), as the quantized seq2seq check holds
its decoders (tuner.gate.seq2seq_quantized): exact in float, and as served no further from
the float model than the original is.

A half-precision graph rounds between every op, and a variant that computes some of it in
float lands elsewhere. On the fp16 copy of the tests' Llama (onnxruntime.transformers'
float16 converter, what transformers.js ships as model_fp16.onnx), the prompt's logits of
the original are 0.268 max abs from its float model, those of ONNX Runtime's fused graph
0.012 (its SimplifiedLayerNormalization accumulates in float32), and the two 0.272 apart:
held to the original at fp16 tolerances the fused graph FAILS, though twenty times closer to
what the weights compute. So, where a variant fails against a half-precision original on
numbers alone, both of these must pass:

- exact in float: the variant's float32 copy against the original's, the gate's own rollouts
  (or feeds) at float32 tolerances. Both copies compute what the stored weights compute, so
  a changed weight FAILS here however small (a projection scaled by 1.01: 0.06 on the
  logits, 600x the tolerance), where half precision's rounding would hide it from the rule
  below;
- as served: the float model rolls out greedily from each start (its own tokens); the
  original and the variant, each in its own precision, are fed those tokens (teacher forced:
  the same context for all three, each fed its own cache) and compared with it at every
  step, the cache at the end and a kept-logits variant's last positions. The variant passes
  where, for every output, its max abs from the float model is at most MARGIN times the
  original's, and its top-1 agreement with the float model is no lower than the original's.

Fail closed: a float copy that does not load or run, a variant whose graph is not at hand,
nothing compared, an output the variant lacks.

    check = FloatCheck(model, load_original, feeds, specs, min_compared, "fp16", variant)
    result = check.check(candidate, failed, widened, kept, positions)   # a VerifyResult
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import onnx_ir as ir

from tuner.errors import one_line
from tuner.gate.kv_feeds import Rollout
from tuner.gate.kv_gate import (CacheFeeds, SlotPositions, check, compare_kept, keeps, narrow,
                                record_rollouts, rollout, rollout_name, rollout_stats,
                                widen_feeds)
from tuner.gate.upcast import as_float32, float_runner, upcast
from tuner.gate.verify import (OutputReport, Stats, Tolerance, VerifyResult,
                               record_then_release, verify)
from tuner.graph.kv_cache import CachePads
from tuner.graph.load import load_model
from tuner.graph.roles import InputSpec
from tuner.runtime.memory import mem_available

# How much further from the float model than the original a variant may land, as served.
# On the tests' fp16 Llama the fused graph lands at 0.04x the original's distance and copies
# with a projection scaled by 1.1 at 2.2-2.4x; a second rounding path of the same precision
# lands about as far as the first: 1.5x leaves it room and no more. (A weight changed by less
# than the original's own rounding is the float copies' comparison to find.)
MARGIN = 1.5
FLOAT = Tolerance()  # the float copies are compared as any float32 variant is
# the float copies are held beside the variant's session: at most this share of what is available
MEMORY_SHARE = 0.5

Graph = ir.Model | Path | str
# the rows of a float check's answer: the float copies', the variant's as served, and the
# original's own distance from the float model (the yardstick)
FLOAT_COPIES, SERVED, ORIGINAL = "float: ", "served: ", "original: "


def _always(name: str, ref: np.ndarray, cand: np.ndarray) -> bool:
    return True  # distances only: the rule is applied to them afterwards


class _Float32Outputs:
    """A runner whose half-precision outputs come back in float32 (compared with the float
    model's); its inputs are the half graph's own."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def infer(self, feeds):
        return {k: as_float32(np.asarray(v)) for k, v in self.runner.infer(feeds).items()}


class FloatCheck:
    """The float-model check of variants of one half-precision original (see the module's
    docstring); the float model's runs and the original's distances from them are made on
    the first call, then kept. `variant`: the graph checked when a call names none."""

    def __init__(self, model: ir.Model, load_original: Callable[[], object], feeds,
                 specs: Sequence[InputSpec], min_compared: int, precision: str,
                 variant: Graph | None = None, original_is_live: bool = False) -> None:
        self.model, self.load_original, self.feeds = model, load_original, feeds
        self.specs, self.min_compared, self.precision = tuple(specs), min_compared, precision
        self.variant, self.original_is_live = variant, original_is_live
        self._made: tuple[object, dict[str, OutputReport]] | str | None = None

    def close(self) -> None:
        self.model, self.variant, self._made = None, None, None

    def check(self, candidate, failed: VerifyResult, widened: CachePads | None = None,
              kept: bool = False, positions: str | None = None,
              variant: ir.Model | None = None) -> VerifyResult:
        """`candidate` (the variant's runner; `variant` its graph) held to the float model,
        given that it `failed` against the original: its label is kept in the answer's."""
        widened = widened or {}
        made = self._calibrate()
        graph = variant if variant is not None else self.variant
        why = made if isinstance(made, str) else (
            None if graph is not None else "the variant's graph is not at hand")
        if why:
            return replace(failed, errors=(*failed.errors, f"no float model to compare with: "
                                                           f"{why}"))
        recorded, original = made
        exact = self._exact(recorded, graph, widened, kept, positions)
        fed = SlotPositions(candidate, positions, self.feeds.roles) if positions else candidate
        served, errors = self._distances(fed, recorded, widened, kept)
        reports = [replace(r, name=f"{FLOAT_COPIES}{r.name}") for r in exact.outputs]
        for name, row in served.items():
            base = original.get(name) or original.get(self._logits_name)
            reports.append(replace(_judged(row, base), name=f"{SERVED}{name}"))
        # the yardstick, shown: the original's own distance from the float model
        reports += [replace(row, name=f"{ORIGINAL}{name}") for name, row in original.items()]
        against = ", ".join(f"{n} {s.max_abs:.3g}" for n, s in original.items())
        worst = max(failed.outputs, key=lambda o: o.max_abs, default=None)
        by = f" ({worst.name} max abs {worst.max_abs:.3g})" if worst is not None else ""
        label = (f"{failed.tolerance}: FAILED against the {self.precision} original{by}, so "
                 f"held to its float32 copy: the variant's float32 copy equal to it "
                 f"({exact.tolerance}), and as served, each model fed the copy's greedy "
                 f"tokens, within {MARGIN:g}x the original's own max abs from it ({against}), "
                 f"top-1 agreement no lower")
        return VerifyResult(tuple(reports), failed.feeds, label, (*exact.errors, *errors),
                            self.min_compared)

    @property
    def _logits_name(self) -> str | None:
        return self.feeds.roles.logits if isinstance(self.feeds, CacheFeeds) else None

    # -- the float model's runs and the original's distances from them, once

    def _calibrate(self) -> tuple[object, dict[str, OutputReport]] | str:
        if self._made is None:
            self._made = self._make()
        return self._made

    def _make(self) -> tuple[object, dict[str, OutputReport]] | str:
        too_big = _too_big(self.model)
        if too_big:
            return too_big
        try:
            recorded = self._record(lambda: float_runner(upcast(self.model)))
        except Exception as e:  # noqa: BLE001 - no float model: the variant stays refused
            return f"its float32 copy did not load ({one_line(e)})"
        failure = recorded.failure
        if failure:
            return f"its float32 copy failed to run ({failure})"
        original = self.load_original()
        try:
            distances, errors = self._distances(original, recorded, {}, False)
        finally:
            if not self.original_is_live:
                original.close()
        if errors:
            return f"the original, fed the copy's tokens: {errors[0]}"
        return recorded, distances

    def _record(self, load):
        if isinstance(self.feeds, CacheFeeds):
            return record_rollouts(load, self.feeds)
        return record_then_release(load, self.feeds)

    # -- exact in float

    def _exact(self, recorded, graph: Graph, widened: CachePads, kept: bool,
               positions: str | None) -> VerifyResult:
        """The variant's float32 copy against the original's recorded runs, at FLOAT."""
        try:
            model = graph if isinstance(graph, ir.Model) else load_model(graph)
            runner = float_runner(upcast(model))
        except Exception as e:  # noqa: BLE001 - no float copy of the variant: it fails
            return VerifyResult((), len(self.feeds), FLOAT.label(),
                                (f"the variant's float32 copy did not load: {one_line(e)}",),
                                self.min_compared)
        try:
            return check(recorded, runner, self.feeds, FLOAT, widened, self.specs,
                         self.min_compared, kept, positions)
        finally:
            runner.close()

    # -- distances from the float model, as served

    def _distances(self, runner, recorded, widened: CachePads, kept: bool
                   ) -> tuple[dict[str, OutputReport], list[str]]:
        """Each output's distances from the float model's recorded runs, `runner` fed its
        tokens (rollouts) or the same feeds (the gate's comparator, every output kept)."""
        if isinstance(self.feeds, CacheFeeds):
            stats, errors = _rollout_distances(runner, self.feeds, recorded.runs, widened, kept)
            return {n: s.report(n, self.min_compared) for n, s in stats.items()}, errors
        result = verify(recorded, _Float32Outputs(runner), self.feeds, _always, self.specs,
                        self.min_compared)
        return {o.name: o for o in result.outputs}, list(result.errors)


def _rollout_distances(runner, feeds: CacheFeeds, runs: Sequence[Rollout], widened: CachePads,
                       kept: bool) -> tuple[dict[str, Stats], list[str]]:
    """`runner` fed each float rollout's tokens from the same start: its logits at every step
    and its cache at the end, each against the float model's (float32)."""
    roles = feeds.roles
    presents = list(roles.past_to_present.values())
    stats, last = rollout_stats(roles, kept)
    errors: list[str] = []
    for i, ((start, steps), ref) in enumerate(zip(feeds.starts, runs)):
        what = rollout_name(i, start)
        served = widen_feeds(start, widened)
        try:
            got = rollout(runner, served, steps, forced=ref.tokens)
        except Exception as e:  # noqa: BLE001 - a model that cannot run fails
            errors.append(f"{what}: failed to run: {one_line(e)}")
            continue
        for r, g, m in zip(ref.logits, got.logits, ref.query_masks):
            stats[roles.logits].add(roles.logits, r, as_float32(g), _always, mask=m)
        if kept and keeps(start):
            compare_kept(stats[last], _Float32Outputs(runner), start, ref.logits[0], served,
                         _always, errors, what)
        for name in presents:
            if name not in got.cache:
                stats[name].fail("missing in the candidate")
                continue
            stats[name].add(name, ref.cache[name],
                            as_float32(narrow(got.cache[name], widened.get(name, ()))),
                            _always, top1=False)
    return stats, errors


def _judged(row: OutputReport, original: OutputReport | None) -> OutputReport:
    """The variant's row as served (its distances from the float model) passed by the rule."""
    reason = row.reason
    if row.passed and original is None:
        reason = "the original's distance from the float model was not measured"
    elif row.passed and row.max_abs > MARGIN * original.max_abs:
        reason = (f"max abs {row.max_abs:.3g} from the float model over {MARGIN:g} x the "
                  f"original's {original.max_abs:.3g}")
    elif row.passed and _top1(row) < _top1(original):
        reason = (f"top-1 agreement with the float model {row.top1:.2%} under the "
                  f"original's {original.top1:.2%}")
    return replace(row, passed=row.passed and not reason, reason=reason)


def _top1(row: OutputReport) -> float:
    return 1.0 if row.top1 is None else row.top1


def _too_big(model: ir.Model) -> str | None:
    """Why float copies of `model` should not be made here (None: they fit)."""
    half = sum(v.const_value.nbytes for v in model.graph.initializers.values()
               if v.const_value is not None)
    free = mem_available()
    if free is not None and 2 * half > MEMORY_SHARE * free:
        return (f"its float32 copy (~{2 * half / 2**30:.1f} GiB) would take over "
                f"{MEMORY_SHARE:.0%} of the available memory ({free / 2**30:.1f} GiB)")
    return None
