"""Mixtures of experts on batched weights (tuner.graph.experts), on Optimum's GPT-OSS export:
inspect found no FFN there ("0 unknown") and said nothing of its experts; it now reports
each block's experts and their width, and that they are not padded."""

from __future__ import annotations

import pytest

from models import optimum
from tuner.graph.experts import find_experts
from tuner.graph.inspect import inspect_model
from tuner.graph.load import load_model
from tuner.graph.shape import ExpertsSite
from tuner.plan.findings import audited

pytestmark = pytest.mark.venv(*optimum.VENV)  # built beside the first tests (conftest)


def test_gpt_oss_experts_are_reported_not_padded():
    shape = audited(inspect_model(load_model(optimum.cached("gpt_oss"))))
    assert shape.sites.experts == tuple(
        ExpertsSite(f"/model/layers.{i}/mlp/experts/MatMul",
                    f"/model/layers.{i}/mlp/experts/MatMul_1", 4, 72) for i in range(2))
    assert shape.ffn_size == 0 and shape.num_layers == 2  # no dense FFN to pad
    [finding] = [f for f in shape.findings if f.rule == "experts-not-padded"]
    assert "72" in finding.message and "4 per block" in finding.message


def test_dense_models_have_none():
    assert find_experts(load_model(optimum.cached("llama")).graph) == []
