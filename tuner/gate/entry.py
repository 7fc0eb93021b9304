"""The one entry to the gate: how a variant is checked against its original, decided in one
place for every caller (`tuner verify`, `tuner pad`, optimize's variants and its backend
re-check, the server's check before it is ready).

    gate = prepare(original, lambda: backend.load(path), variant, vocab=vocab)
    result = gate.check(candidate_runner)        # a VerifyResult, truthy when it passes
    gate.close()

`prepare` settles, once:
- the feeds: the caller's own (`--inputs`), else greedy rollouts for a decoder exported with
  its KV cache (tuner.gate.kv_gate.cache_feeds), else random token ids at `shapes`;
- the reference: a loader is called once, the reference recorded on the feeds (its outputs,
  or a cache model's rollouts: a rollout of the reference never depends on the candidate's)
  and released, so that one session is held at a time (tuner.gate.verify.record_then_release,
  tuner.gate.kv_gate.record_rollouts); a runner already loaded is used as it is, live;
- the tolerances: widened to the original's own precision (fp16, bf16), cache models included;
- the cache policy: a variant whose cache interface was widened (`widen`) is fed wider pasts
  and compared on the original entries (tuner.graph.kv_cache.widened_cache of the variant);
- the kept logits: a variant that takes `logits_to_keep` (tuner.rewrite.logits_to_keep) is
  also run for each row's last logits only, as the server runs its prompts;
- the positions: a variant given a `position_ids` input with a default
  (tuner.rewrite.position_ids) is fed the positions its original counts, its slots: fed so,
  it must compute what the original does (tuner.gate.kv_gate.SlotPositions);
- a half-precision original's float model: a variant that fails against the original is
  held to the original's float32 copy instead, no further from it than the original is
  (tuner.gate.float_reference).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import onnx_ir as ir

from tuner.errors import BadInput
from tuner.gate.feeds import DEFAULT_SHAPES
from tuner.gate.float_reference import FloatCheck
from tuner.gate.kv_gate import CacheFeeds, RecordedRollouts, check, gate_feeds, record_rollouts
from tuner.gate.verify import Tolerance, TolerancePolicy, VerifyResult, record_then_release
from tuner.graph.inspect import inspect_model
from tuner.graph.io import model_precision, vocab_for_feeds
from tuner.graph.kv_cache import CachePads, widened_cache
from tuner.graph.lm_head import keep_input
from tuner.graph.load import load_model
from tuner.graph.positions import positions_input
from tuner.graph.roles import InputSpec, input_specs
from tuner.runtime.base import Runner

Feeds = Sequence[Mapping[str, np.ndarray]]
# a variant as the gate reads its cache policy: its graph, its file, or the recorded map
Variant = ir.Model | Path | str | Mapping


@dataclass(frozen=True)
class GateCheck:
    """A ready check: the reference (live or recorded), the feeds, the tolerances at the
    original's precision, the input specs (which input is the mask) and the floor of compared
    elements. `check(candidate, variant)` runs it; `close()` releases the reference."""

    reference: Runner | RecordedRollouts
    feeds: Feeds | CacheFeeds
    tolerance: Tolerance | TolerancePolicy
    specs: tuple[InputSpec, ...]
    min_compared: int = 1
    widened: CachePads = field(default_factory=dict)  # the variant given to prepare, if any
    kept: bool = False  # the variant given to prepare takes logits_to_keep
    positions: str | None = None  # its defaulted position input (tuner.graph.positions)
    float_check: FloatCheck | None = None  # a half-precision original's float model

    @property
    def rollouts(self) -> bool:
        """True for a cache model's gate: greedy rollouts, each model fed its own present."""
        return isinstance(self.feeds, CacheFeeds)

    def feed_dicts(self) -> list[Mapping[str, np.ndarray]]:
        """The first inputs the reference is run on (a rollout's first step)."""
        if isinstance(self.feeds, CacheFeeds):
            return [start.arrays for start, _ in self.feeds.starts]
        return list(self.feeds)

    def at_precision(self, precision: str) -> "GateCheck":
        """This check at a backend's own precision (an fp16 backend: fp16 tolerances)."""
        if not isinstance(self.tolerance, Tolerance):
            return self
        return replace(self, tolerance=self.tolerance.at_precision(precision))

    def widened_of(self, variant: Variant | None) -> CachePads:
        """The widened cache entries of `variant` (none for plain feeds)."""
        if variant is None:
            return self.widened
        if not self.rollouts:
            return {}
        if isinstance(variant, Mapping):
            return dict(variant)
        return widened_cache(variant if isinstance(variant, ir.Model) else load_model(variant))

    def kept_of(self, variant: Variant | None) -> bool:
        """Whether `variant` takes logits_to_keep (a widened map says nothing of it)."""
        if variant is None or isinstance(variant, Mapping):
            return self.kept
        if not self.rollouts:
            return False
        return keep_input(_model(variant).graph) is not None

    def positions_of(self, variant: Variant | None) -> str | None:
        """`variant`'s defaulted position input, fed as the server feeds it (or None)."""
        if variant is None or isinstance(variant, Mapping):
            return self.positions
        if not self.rollouts:
            return None
        return positions_input(_model(variant).graph)

    def check(self, candidate: Runner, variant: Variant | None = None) -> VerifyResult:
        """`candidate` against the reference; `variant` (its graph or file) says whether its
        cache interface was widened, whether it takes logits_to_keep and its own positions
        (default: the variant given to prepare; a widened map says the first only)."""
        if isinstance(variant, (str, Path)):
            variant = load_model(variant)  # read once for every question
        widened, kept = self.widened_of(variant), self.kept_of(variant)
        positions = self.positions_of(variant)
        result = check(self.reference, candidate, self.feeds, self.tolerance, widened,
                       self.specs, self.min_compared, kept, positions)
        if result or self.float_check is None or not _numbers_differ(result):
            return result
        return self.float_check.check(candidate, result, widened, kept, positions,
                                      variant if isinstance(variant, ir.Model) else None)

    def reference_failure(self) -> str | None:
        """The first error the reference met on the gate's feeds, in one line (None: it ran
        them all, or it is a live runner, not recorded by prepare)."""
        return getattr(self.reference, "failure", None)

    def close(self) -> None:
        self.reference.close()
        if self.float_check is not None:
            self.float_check.close()


def _numbers_differ(result: VerifyResult) -> bool:
    """Whether `result` failed on numbers alone (beyond tolerance, or a greedy token that
    flipped, after which a rollout's cache is not compared), both models having run and
    answered every output: what a float model can judge."""
    return all("greedy tokens differ" in e for e in result.errors) and not any(
        o.reason and not o.reason.startswith("nothing compared") for o in result.outputs)


def _model(m: ir.Model | Path | str) -> ir.Model:
    return m if isinstance(m, ir.Model) else load_model(m)


def model_vocab(model: ir.Model) -> int:
    """Token ids must stay inside the embedding: its row count as inspect finds it, else the
    smallest 2-D Gather table (a graph inspect does not understand)."""
    try:
        return vocab_for_feeds(model, inspect_model(model))
    except Exception:  # noqa: BLE001 - not a transformer inspect understands: any Gather table
        rows = [n.inputs[0].const_value.shape[0] for n in model.graph
                if n.op_type == "Gather" and n.inputs[0] is not None
                and n.inputs[0].const_value is not None and len(n.inputs[0].const_value.shape) == 2]
        return int(min(rows)) if rows else 2


def prepare(original: ir.Model | Path | str, reference: Runner | Callable[[], Runner],
            variant: ir.Model | Path | str | None = None, *, feeds: Feeds | None = None,
            vocab: int | None = None, shapes: Sequence[tuple[int, int]] = DEFAULT_SHAPES,
            seed: int = 0, tolerance: Tolerance | TolerancePolicy = Tolerance(),
            min_compared: int = 1) -> GateCheck:
    """A ready check of variants of `original` (its graph or file) against `reference` (a
    runner, or a loader called once). With `variant`, its inputs must be the original's
    (BadInput otherwise) and its cache policy is read now, so neither graph need be held
    while the sessions run. `feeds` None: built for the model with token ids below `vocab`
    (default: the model's own vocabulary, `model_vocab`)."""
    if min_compared < 1:
        raise ValueError(f"min_compared must be >= 1, not {min_compared}")
    model = _model(original)
    specs = tuple(input_specs(model))
    widened: CachePads = {}
    kept, positions = False, None
    if variant is not None:
        cand = _model(variant)
        kept = keep_input(cand.graph) is not None
        positions = positions_input(cand.graph)
        cand_specs = input_specs(cand)
        if [(s.name, s.dtype) for s in specs] != [(s.name, s.dtype) for s in cand_specs]:
            raise BadInput(f"the models take different inputs: {[s.name for s in specs]} vs "
                           f"{[s.name for s in cand_specs]}")
        widened = widened_cache(cand)
        del cand
    precision = model_precision(model)
    if isinstance(tolerance, Tolerance):  # a policy function is taken as given
        tolerance = tolerance.at_precision(precision)
    if feeds is None:
        built = gate_feeds(model, vocab or model_vocab(model), shapes, seed)
    else:
        built = list(feeds)
    if not isinstance(built, CacheFeeds):
        widened, kept, positions = {}, False, None
    live = not (callable(reference) and not hasattr(reference, "infer"))
    float_check = None
    if precision != "fp32" and isinstance(tolerance, Tolerance):
        # holds the graph (its float copy is made only for a variant that fails)
        float_check = FloatCheck(model, (lambda: reference) if live else reference, built,
                                 specs, min_compared, precision, variant, original_is_live=live)
    del model  # weights it read lazily (the vocabulary) would stay in memory beside a session
    if not live:  # recorded, then let go
        runner = record_rollouts(reference, built) if isinstance(built, CacheFeeds) else \
            record_then_release(reference, built)
    else:
        runner = reference
    return GateCheck(runner, built, tolerance, specs, min_compared, widened, kept, positions,
                     float_check)
