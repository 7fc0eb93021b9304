"""Test-only comparison of two greedy rollouts (tuner.gate.kv_feeds.Rollout), step by step:
what tests/test_kv_feeds.py checks the rollouts with (the gate's own comparison is
tuner.gate.kv_gate.verify_cache_model)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tuner.gate.kv_feeds import Rollout
from tuner.gate.verify import TolerancePolicy


def allclose(atol: float = 1e-4, rtol: float = 1e-3) -> TolerancePolicy:
    """|cand - ref| <= atol + rtol * |ref| everywhere (numpy's allclose, the gate's default)."""
    def policy(name: str, ref: np.ndarray, cand: np.ndarray) -> bool:
        return bool(np.all(np.abs(cand - ref) <= atol + rtol * np.abs(ref)))

    return policy


@dataclass(frozen=True)
class RolloutCheck:
    """Truthy when every step's logits (on kept positions), the tokens and the final cache
    match. `max_abs` is per step; `reason` says what failed first."""

    passed: bool
    max_abs: tuple[float, ...]
    cache_max_abs: float | None
    reason: str = ""

    def __bool__(self) -> bool:
        return self.passed


def _step_error(ref: np.ndarray, got: np.ndarray, mask: np.ndarray) -> np.ndarray:
    keep = mask.astype(bool)  # (B, S): padded query positions are don't-care
    return np.abs(got[keep].astype(np.float64) - ref[keep].astype(np.float64))


def compare_rollouts(ref: Rollout, got: Rollout,
                     tolerance: TolerancePolicy = allclose()) -> RolloutCheck:
    """Compare a candidate's rollout with the reference's, step by step (fails closed)."""
    errors: list[float] = []
    for step, (r, g, m) in enumerate(zip(ref.logits, got.logits, ref.query_masks)):
        if r.shape != g.shape:
            return RolloutCheck(False, tuple(errors), None, f"step {step}: logits {g.shape}, "
                                f"reference {r.shape}")
        keep = m.astype(bool)
        errors.append(float(_step_error(r, g, m).max(initial=0.0)))
        if not tolerance("logits", r[keep], g[keep]):
            return RolloutCheck(False, tuple(errors), None,
                                f"step {step}: logits differ by up to {errors[-1]:.3g}")
        # Within tolerance yet another argmax (a near tie): the next steps would compare
        # different inputs, so stop here with the real reason.
        if not np.array_equal(ref.tokens[:, step], got.tokens[:, step]):
            return RolloutCheck(False, tuple(errors), None, f"step {step}: greedy tokens differ")
    if len(ref.logits) != len(got.logits):
        return RolloutCheck(False, tuple(errors), None,
                            f"{len(got.logits)} steps, reference {len(ref.logits)}")
    return _compare_cache(ref, got, tuple(errors), tolerance)


def _compare_cache(ref: Rollout, got: Rollout, errors: tuple[float, ...],
                   tolerance: TolerancePolicy) -> RolloutCheck:
    worst = 0.0
    for name, r in ref.cache.items():
        g = got.cache.get(name)
        if g is None or g.shape != r.shape:
            # A widened cache (docs/design.md's `widen` policy) needs the rewrite's own map of
            # original positions; without it nothing is compared, so nothing passes.
            shape = None if g is None else g.shape
            return RolloutCheck(False, errors, None, f"cache {name}: {shape}, reference {r.shape}")
        worst = max(worst, float(np.abs(g.astype(np.float64) - r).max(initial=0.0)))
        if not tolerance(name, r, g):
            return RolloutCheck(False, errors, worst, f"cache {name} differs by up to {worst:.3g}")
    return RolloutCheck(True, errors, worst)
