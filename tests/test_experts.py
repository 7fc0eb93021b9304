"""Mixtures of experts, on Optimum's exports: GPT-OSS's on batched weights
(tuner.graph.experts), where inspect found no FFN ("0 unknown") and said nothing of its
experts, and Qwen3-MoE's, a Linear per expert, which inspect counted as layers. Each block's
experts and their width are reported now, and that they are not padded."""

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


def test_qwen3_moe_experts_are_one_layer_not_four():
    """Qwen3-MoE as Optimum exports it (its patch runs every expert, a Linear each, on the
    tokens routed to it): inspect counted each expert as a layer (8 layers, FFN 72); each
    layer's FFNs after its attention are now its experts."""
    shape = audited(inspect_model(load_model(optimum.cached("qwen3_moe"))))
    assert shape.num_layers == 2 and shape.ffn_size == 0 and shape.activation == "silu"
    assert [(e.count, e.width) for e in shape.sites.experts] == [(4, 72), (4, 72)]
    assert shape.sites.experts[1].up == "/model/layers.1/mlp/experts.0/up_proj/MatMul"
    assert all(layer.ffn is None for layer in shape.sites.layers)


def test_dense_models_have_none():
    assert find_experts(load_model(optimum.cached("llama")).graph) == []


@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_moe"])
def test_optimize_with_the_gemm_probe_plans_a_model_of_experts(name, tmp_path):
    """`tuner optimize` with its defaults stopped with an internal error on these models of
    experts ("GemmShape.n must be a positive integer, not 0": the probe's GEMMs took the FFN
    width 0); the conformance runs had the probe off. The experts' GEMMs stand in now."""
    from tuner.cli import main
    from tuner.plan.probe import model_gemms

    shape = inspect_model(load_model(optimum.cached(name)))
    labels = {g.label: g for g in model_gemms(shape, 1, 16)}
    assert (labels["up"].m, labels["up"].n) == (16 * 4, 72)  # 4 experts over every token
    assert main(["optimize", str(optimum.cached(name)), "-o", str(tmp_path / "out"),
                 "--rounds", "2", "--warmup", "0", "--bucket-rounds", "1", "--no-fuse",
                 "--max-variants", "1", "--no-cache", "--max-buckets", "1", "-q",
                 "--no-plots"]) == 0
    assert (tmp_path / "out" / "manifest.json").is_file()
