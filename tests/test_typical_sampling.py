"""Locally typical sampling (serving.sampling's typical_p, TGI's parameter) draws from what
transformers' TypicalLogitsWarper leaves, after the temperature, top-k, top-p and min-p cuts
in transformers' order; and the vocabulary's other cuts are unchanged by it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper,
                                                    TypicalLogitsWarper)

from serving.errors import InvalidArgument
from serving.sampling import Sampling, distribution


def _transformers(logits: np.ndarray, s: Sampling) -> np.ndarray:
    warpers = [TemperatureLogitsWarper(s.temperature)]
    if s.top_k:
        warpers.append(TopKLogitsWarper(s.top_k))
    if s.top_p < 1:
        warpers.append(TopPLogitsWarper(s.top_p))
    if s.min_p > 0:
        warpers.append(MinPLogitsWarper(s.min_p))
    if s.typical_p < 1:
        warpers.append(TypicalLogitsWarper(s.typical_p))
    scores = torch.from_numpy(logits.astype(np.float64))[None]
    for warp in warpers:
        scores = warp(None, scores)
    return torch.softmax(scores, -1)[0].numpy()


@pytest.mark.parametrize("s", [
    Sampling(1.0, typical_p=0.95), Sampling(1.0, typical_p=0.5), Sampling(0.7, typical_p=0.2),
    Sampling(1.3, typical_p=1e-6), Sampling(1.0, top_k=40, typical_p=0.9),
    Sampling(1.0, top_p=0.9, typical_p=0.95), Sampling(0.8, min_p=0.05, typical_p=0.6),
], ids=lambda s: f"t{s.temperature}-k{s.top_k}-p{s.top_p}-min{s.min_p}-typ{s.typical_p}")
def test_what_is_drawn_from_is_transformers_own(s: Sampling) -> None:
    rng = np.random.default_rng(3)
    for _ in range(5):
        logits = rng.normal(0, 3, 1000).astype(np.float32)
        got, want = distribution(logits, s), _transformers(logits, s)
        assert set(np.flatnonzero(got)) == set(np.flatnonzero(want))
        np.testing.assert_allclose(got, want, atol=1e-9)


def test_a_tiny_mass_keeps_the_most_typical_id_alone() -> None:
    """Not the likeliest: the id whose surprise is nearest the entropy."""
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    p = np.exp(logits)
    entropy = -np.sum(p * logits)
    typical = int(np.argmin(np.abs(-logits - entropy)))
    assert typical != 0
    got = distribution(logits, Sampling(1.0, typical_p=1e-6))
    assert np.flatnonzero(got).tolist() == [typical]
    assert np.array_equal(distribution(logits, Sampling(1.0)), distribution(
        logits, Sampling(1.0, typical_p=1.0)))  # 1: no cut


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5])
def test_typical_p_out_of_range_is_refused(bad: float) -> None:
    with pytest.raises(InvalidArgument, match="typical_p must be in"):
        Sampling(1.0, typical_p=bad)
