"""Feeds for decoders exported with a KV cache, and a greedy rollout through them: the basis
of the cache-aware accuracy gate (DESIGN.md, "Decoders with a KV cache").

    roles = cache_roles(model)                        # which input is which, by structure
    first = prefill_feeds(roles, ids, mask)           # past length 0
    step = decode_feeds(roles, batch=2, past=7, seq=1, vocab_size=1003, seed=0)
    run = greedy_rollout(runner.infer, first, steps=4)   # each step fed its own present
    check = compare_rollouts(reference_run, candidate_run)   # truthy when it passes

Roles come from the graph, not from names: the cache inputs are what tuner.graph.kv_cache
finds, and the token ids, the mask and the position ids are what tuner.graph.roles finds
for every model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np
import onnx_ir as ir

from tuner.errors import BadInput
from tuner.gate.verify import TolerancePolicy
from tuner.graph.kv_cache import KvCache, find_kv_cache
from tuner.graph.roles import ATTENTION_MASK, POSITION_IDS, TOKEN_IDS, input_specs, with_role

Infer = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


@dataclass(frozen=True)
class CacheRoles:
    """The graph names of a cache model's inputs/outputs by role, and the declared dtypes."""

    input_ids: str
    attention_mask: str | None  # None: the graph takes no mask
    position_ids: str | None  # None: positions come from inside the graph
    logits: str
    cache: KvCache
    dtypes: Mapping[str, str] = field(default_factory=dict)  # input name -> numpy dtype name
    batch: int | None = None  # the graph's batch when it is static (STYLE.md: static dims are real)

    @property
    def past_to_present(self) -> dict[str, str]:
        """past input -> the present output that feeds it on the next step."""
        pairs: dict[str, str] = {}
        for layer in self.cache.layers:
            if layer.present_key is None or layer.present_value is None:
                raise BadInput(f"layer {layer.index}'s cache is not a graph output: "
                               "no present to feed back")
            pairs[layer.past_key] = layer.present_key
            pairs[layer.past_value] = layer.present_value
        return pairs


# ---------------------------------------------------------------------------------------------
# Roles


def _logits(graph: ir.Graph, cache: KvCache) -> str:
    presents = {n for layer in cache.layers for n in (layer.present_key, layer.present_value)}
    rest = [v for v in graph.outputs if v.name not in presents]
    if len(rest) != 1:
        raise BadInput(f"a cache model should return logits and the cache; it returns "
                       f"{len(rest)} other outputs: {[v.name for v in rest]}")
    return rest[0].name or ""


def cache_roles(model: ir.Model) -> CacheRoles:
    """Roles of a cache model's graph inputs; BadInput when the model has no KV cache."""
    graph = model.graph
    cache = find_kv_cache(graph)
    if cache is None:
        raise BadInput("the model has no KV cache (no past key/value input joined by a Concat)")
    specs = input_specs(model)  # roles from the structure (tuner.graph.roles)
    ids, mask = with_role(specs, TOKEN_IDS), with_role(specs, ATTENTION_MASK)
    pos = with_role(specs, POSITION_IDS)
    if ids is None:
        raise BadInput("no token-id input (one that reaches the token embedding) in the graph")
    batch = ids.dims[ids.batch_axis] if ids.batch_axis is not None else None
    return CacheRoles(ids.name, mask.name if mask is not None else None,
                      pos.name if pos is not None else None, _logits(graph, cache), cache,
                      {s.name: s.dtype for s in specs},
                      batch if isinstance(batch, int) else None)


# ---------------------------------------------------------------------------------------------
# Feeds


@dataclass(frozen=True)
class StepFeeds:
    """One step's arrays, keyed by graph input name, with the roles that built them. `mask`
    is (B, P + S) even when the graph takes none: the rollout and the comparison need it."""

    roles: CacheRoles
    arrays: Mapping[str, np.ndarray]
    mask: np.ndarray

    @property
    def seq(self) -> int:
        return int(self.arrays[self.roles.input_ids].shape[1])

    @property
    def past(self) -> int:
        return int(self.mask.shape[1]) - self.seq


def cache_shape(cache: KvCache, batch: int, length: int) -> tuple[int, ...]:
    """The shape of one past tensor holding `length` positions, in the cache's own layout."""
    if cache.num_kv_heads is None or cache.head_dim is None:
        raise BadInput("the cache's kv heads / head dim are not static in the graph")
    size = {"b": batch, "h": cache.num_kv_heads, "s": length, "d": cache.head_dim}
    return tuple(size[letter] for letter in cache.layout)  # e.g. bhsd: (B, kv_heads, P, d)


def positions(mask: np.ndarray) -> np.ndarray:
    """Position ids from a (B, P + S) mask, as ONNX Runtime's HF integration and generate()
    derive them: kept tokens count 0, 1, ...; padded slots get 1 (the mask hides them)."""
    pos = mask.astype(np.int64).cumsum(-1) - 1
    return np.where(mask == 0, 1, pos)  # (B, P + S)


def _feeds(roles: CacheRoles, ids: np.ndarray, mask: np.ndarray,
           past: Mapping[str, np.ndarray]) -> StepFeeds:
    batch, seq = ids.shape
    if roles.batch is not None and batch != roles.batch:
        raise BadInput(f"the graph's batch is fixed to {roles.batch}; feeds of batch {batch} "
                       "would not run")
    arrays = {roles.input_ids: ids.astype(roles.dtypes[roles.input_ids])}
    if roles.attention_mask is not None:
        arrays[roles.attention_mask] = mask.astype(roles.dtypes[roles.attention_mask])
    if roles.position_ids is not None:
        pos = positions(mask)[:, mask.shape[1] - seq:]  # (B, S): the new tokens' positions
        arrays[roles.position_ids] = np.ascontiguousarray(pos.astype(roles.dtypes[roles.position_ids]))
    for name, arr in past.items():
        arrays[name] = np.ascontiguousarray(arr.astype(roles.dtypes[name], copy=False))
    return StepFeeds(roles, arrays, mask.astype(np.int64))


def prefill_feeds(roles: CacheRoles, ids: np.ndarray, mask: np.ndarray | None = None) -> StepFeeds:
    """The first step: ids (B, S), mask (B, S) (default all ones), every past of length 0."""
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.shape[1] < 1:
        raise BadInput(f"prompt ids must be (batch, seq >= 1), not {ids.shape}")
    mask = np.ones(ids.shape, np.int64) if mask is None else np.asarray(mask)
    if mask.shape != ids.shape:
        raise BadInput(f"prefill mask {mask.shape} must match the ids {ids.shape}")
    empty = cache_shape(roles.cache, ids.shape[0], 0)  # (B, kv_heads, 0, d) for bhsd
    past = {name: np.zeros(empty, roles.dtypes[name]) for name in roles.past_to_present}
    return _feeds(roles, ids, mask, past)


def decode_feeds(roles: CacheRoles, batch: int, past: int, seq: int, vocab_size: int,
                 seed: int = 0) -> StepFeeds:
    """A step against a cache of `past` positions (random values, all kept): ids (B, seq),
    mask (B, past + seq), position ids past .. past + seq - 1. seq 1 is a decode step, seq k
    a chunk (speculative or chunked prefill)."""
    if batch < 1 or past < 0 or seq < 1:
        raise BadInput(f"decode feeds need batch >= 1, past >= 0, seq >= 1; "
                       f"not ({batch}, {past}, {seq})")
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab_size, (batch, seq))
    shape = cache_shape(roles.cache, batch, past)
    cache = {name: rng.standard_normal(shape) for name in roles.past_to_present}
    return _feeds(roles, ids, np.ones((batch, past + seq), np.int64), cache)


def next_feeds(feeds: StepFeeds, outputs: Mapping[str, np.ndarray], tokens: np.ndarray) -> StepFeeds:
    """The step after `feeds`: `tokens` (B, 1) as ids, this step's presents as the pasts."""
    roles = feeds.roles
    mask = np.concatenate([feeds.mask, np.ones((len(tokens), 1), np.int64)], axis=1)  # (B, P+S+1)
    past = {p: outputs[q] for p, q in roles.past_to_present.items()}
    return _feeds(roles, tokens.reshape(-1, 1), mask, past)


# ---------------------------------------------------------------------------------------------
# Rollout and its comparison


@dataclass(frozen=True)
class Rollout:
    """What a greedy generation produced: per-step logits (B, S_step, vocab) and the step's
    query mask (B, S_step), the chosen tokens (B, steps), the cache after the last step."""

    logits: tuple[np.ndarray, ...]
    query_masks: tuple[np.ndarray, ...]
    tokens: np.ndarray
    cache: Mapping[str, np.ndarray]  # present output name -> array


def greedy_rollout(infer: Infer, feeds: StepFeeds, steps: int) -> Rollout:
    """`steps` forward passes from `feeds`, each fed the argmax of the last position and its
    own `present` as the next `past`; a runner's `infer` is the model."""
    if steps < 1:
        raise BadInput(f"a rollout needs steps >= 1, not {steps}")
    logits, query_masks, tokens = [], [], []
    outputs: Mapping[str, np.ndarray] = {}
    for step in range(steps):
        outputs = infer(feeds.arrays)
        out = np.asarray(outputs[feeds.roles.logits])  # (B, S, vocab)
        logits.append(out)
        query_masks.append(feeds.mask[:, feeds.past:])  # (B, S)
        tokens.append(out[:, -1].argmax(-1))  # (B,)
        if step + 1 < steps:
            feeds = next_feeds(feeds, outputs, tokens[-1])
    cache = {q: np.asarray(outputs[q]) for q in feeds.roles.past_to_present.values()}
    return Rollout(tuple(logits), tuple(query_masks), np.stack(tokens, axis=1), cache)


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
            # A widened cache (DESIGN.md's `widen` policy) needs the rewrite's own map of
            # original positions; without it nothing is compared, so nothing passes.
            shape = None if g is None else g.shape
            return RolloutCheck(False, errors, None, f"cache {name}: {shape}, reference {r.shape}")
        worst = max(worst, float(np.abs(g.astype(np.float64) - r).max(initial=0.0)))
        if not tolerance(name, r, g):
            return RolloutCheck(False, errors, worst, f"cache {name} differs by up to {worst:.3g}")
    return RolloutCheck(True, errors, worst)
