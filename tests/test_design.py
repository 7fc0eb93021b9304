"""`tuner design`: candidates obey the paper's rules and the budget, ranking statistics, the
command end to end on ORT CPU (small target, few rounds), and bad input exiting 2."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tuner.cli import main
from tuner.design.candidates import SearchSpace, enumerate_candidates, ffn_widths, natural_layers
from tuner.design.measure import MeasureSettings, ShapeCost
from tuner.design.params import FAMILIES, DesignShape, count_params
from tuner.design.rank import rank
from tuner.design.search import DesignRequest, parse_layers, plan, start_from_flags
from tuner.errors import BadInput
from tuner.hardware.facts import DEVICES
from tuner.plan.probe import GemmResult, backend_unavailable, model_gemms

NEOX, LLAMA = FAMILIES["gpt_neox"], FAMILIES["llama"]
PYTHIA_2_8B = DesignShape(32, 2560, 32, 32, 80, 10240, 50257, NEOX)


@pytest.mark.parametrize("family,target", [(NEOX, 125_000_000), (LLAMA, 125_000_000),
                                           (NEOX, 2_700_000_000), (LLAMA, 7_000_000_000)])
def test_candidates_follow_the_rules_and_the_budget(family, target):
    space = SearchSpace(target, (8, 12, 16, 24, 32, 40), 50257, family, max_candidates=30)
    cands = enumerate_candidates(space)
    assert 0 < len(cands) <= 30
    for c in cands:
        s = c.shape
        assert abs(c.params - target) <= 0.05 * target
        assert s.vocab_size % 64 == 0 and s.hidden_size % 64 == 0
        assert s.head_dim in (64, 128) and s.num_heads * s.head_dim == s.hidden_size
        assert s.ffn_size % 64 == 0
        assert s.ffn_size == 4 * s.hidden_size or family.ffn_gated


def test_swiglu_widths_include_the_published_fast_ones():
    """h=4096: 8h/3 = 10922 ran at 273 TFLOP/s on an H100, 10944 at 398, 11008 at 395."""
    widths = ffn_widths(4096, gated=True)
    assert {10944, 11008} <= set(widths) and 10922 not in widths
    assert ffn_widths(4096, gated=False) == (16384,)


def test_start_shape_comes_first_and_is_kept_whatever_its_rules():
    space = SearchSpace(count_params(PYTHIA_2_8B), (32,), 50257, NEOX)
    cands = enumerate_candidates(space, PYTHIA_2_8B)
    assert cands[0].origin == "start" and cands[0].shape == PYTHIA_2_8B
    assert cands[0].name == "start:L32-h2560-a32-f10240"
    names = {c.name for c in cands}
    assert "L32-h2560-a20-f10240" in names  # the paper's fix: 20 heads of 128
    assert all(c.origin == "search" for c in cands[1:])


def test_max_candidates_keeps_those_nearest_the_target():
    space = SearchSpace(2_700_000_000, tuple(range(24, 48)), 50257, NEOX, max_candidates=5)
    few = enumerate_candidates(space)
    many = enumerate_candidates(SearchSpace(2_700_000_000, tuple(range(24, 48)), 50257, NEOX,
                                            max_candidates=500))
    assert len(few) == 5 < len(many)
    worst_kept = max(abs(c.params - space.target) for c in few)
    dropped = [c for c in many if c.name not in {f.name for f in few}]
    assert all(abs(c.params - space.target) >= worst_kept for c in dropped)


def test_natural_depth_of_gpt3_sizes():
    assert 10 <= natural_layers(125_000_000, 50257, FAMILIES["gpt2"]) <= 13
    assert 30 <= natural_layers(2_700_000_000, 50257, NEOX) <= 40


@pytest.mark.parametrize("target,layers,message", [
    (1000, (12,), "no shape fits 1,000 parameters \\+-5%: even h=64 with 12 layers"),
    (125_000_000, (300,), "no shape with 300 layers"),
])
def test_a_target_no_shape_meets_is_bad_input(target, layers, message):
    with pytest.raises(BadInput, match=message):
        enumerate_candidates(SearchSpace(target, layers, 50257, NEOX))


@pytest.mark.parametrize("layers,rng,result", [(12, None, (12,)), (None, "3:5", (3, 4, 5)),
                                               (None, None, None)])
def test_parse_layers(layers, rng, result):
    assert parse_layers(layers, rng) == result


@pytest.mark.parametrize("layers,rng,message", [
    (12, "8:16", "--layers and --layers-range contradict each other"),
    (None, "16:8", "need 1 <= A <= B"), (None, "x", "must look like A:B"), (0, None, ">= 1"),
])
def test_parse_layers_bad(layers, rng, message):
    with pytest.raises(BadInput, match=message):
        parse_layers(layers, rng)


def test_start_depth_is_solved_from_the_target_when_not_given():
    s = start_from_flags(2560, 32, 10240, None, 50257, NEOX, target=2_775_000_000)
    assert s.num_layers == 32 and s.head_dim == 80
    with pytest.raises(BadInput, match="needs a depth"):
        start_from_flags(2560, 32, 10240, None, 50257, NEOX)


def test_plan_without_a_target_uses_the_start_count():
    space, cands = plan(DesignRequest(None, PYTHIA_2_8B, None))
    assert space.target == count_params(PYTHIA_2_8B) and space.layers == (32,)
    with pytest.raises(BadInput, match="give a parameter target"):
        DesignRequest(None, None, None)


def _cost(cands, i, samples):
    """Per-round GEMM times whose whole-model total is `samples`: half in the LM head."""
    c = cands[i]
    gemms = model_gemms(c.shape, 1, 16)
    per_layer = (len(gemms) - 1) * c.shape.num_layers
    results = tuple(GemmResult(g, "ort-cpu", "CPU", tuple(
        samples / 2 if g.label == "lm_head" else samples / (2 * per_layer))) for g in gemms)
    layer = np.sum([r.samples_ms for r in results if r.shape.label != "lm_head"], axis=0)
    head = np.sum([r.samples_ms for r in results if r.shape.label == "lm_head"], axis=0)
    return ShapeCost(c, results, tuple(layer), tuple(head))


def test_rank_speedup_intervals_and_ties():
    """Known per-round times: one shape 20% faster every round, one equal to the start."""
    cands = enumerate_candidates(SearchSpace(count_params(PYTHIA_2_8B), (32,), 50257, NEOX),
                                 PYTHIA_2_8B)[:3]
    rng = np.random.default_rng(0)
    base = 100 + rng.normal(0, 3, 12)  # a drifting machine: the same drift in every shape
    costs = [_cost(cands, 0, base), _cost(cands, 1, base / 1.25), _cost(cands, 2, base * 1.0)]
    settings = MeasureSettings(1, 16, rounds=12)
    ranking = rank(costs, settings, DEVICES["cpu"])
    assert ranking.baseline == cands[0].name and ranking.baseline_kind == "start"
    assert ranking.best.name == cands[1].name
    sp = ranking.best.speedup
    assert sp.ratio == pytest.approx(1.25) and sp.low > 1.2
    assert not ranking.best.tied_with_next  # 25% faster than the next, every round
    assert ranking.rows[1].tied_with_next  # the other two are the same
    tied = {ranking.rows[1].name, ranking.rows[2].name}
    assert tied == {cands[0].name, cands[2].name}
    np.testing.assert_allclose(costs[1].total_ms, base / 1.25)
    assert ranking.best.tokens_per_s == pytest.approx(16 / (np.median(base / 1.25) * 1e-3))


def test_measure_settings_validation():
    with pytest.raises(BadInput, match="at least 3 rounds"):
        MeasureSettings(1, 16, rounds=2)
    with pytest.raises(BadInput, match="batch and seq must be >= 1"):
        MeasureSettings(0, 16)
    with pytest.raises(BadInput, match="unknown probe backend"):
        MeasureSettings(1, 16, backend="cuda")


SMALL = ["design", "--params", "20e6", "--vocab", "8000", "--layers-range", "6:8", "--batch",
         "1", "--seq", "32", "--rounds", "3", "--threads", "1", "--quiet"]


def test_design_end_to_end_on_cpu(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(SMALL + ["--json", "-o", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((out / "design.json").read_text())
    assert printed["best"] == written["best"]
    shapes = written["shapes"]
    assert len(shapes) == written["candidates"] >= 2
    medians = [s["forward_ms"]["median"] for s in shapes]
    assert medians == sorted(medians)
    assert written["baseline_kind"] == "slowest" and shapes[-1]["name"] == written["baseline"]
    for s in shapes:
        assert abs(s["params"] - 20e6) <= 0.05 * 20e6 and 6 <= s["shape"]["num_layers"] <= 8
        assert s["speedup"]["low"] <= s["speedup"]["ratio"] <= s["speedup"]["high"]
        assert len(s["forward_ms"]["samples"]) == 3 and s["notes"]
    md = (out / "design.md").read_text()
    assert "| 1 | " + written["best"] in md and "## Why" in md
    assert (out / "design.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_design_from_a_reference_model(reference_model, capsys):
    path = reference_model("llama", "small", "torchscript")
    args = ["design", "--from", str(path), "--batch", "1", "--seq", "16", "--rounds", "3",
            "--threads", "1", "--quiet", "--json", "--tolerance", "0.5"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    start = next(s for s in data["shapes"] if s["origin"] == "start")
    # the llama "small" reference: 2 layers, h 64, 4 heads, 2 kv heads, f 176, vocab 1024
    for key, value in {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2,
                       "ffn_size": 176, "vocab_size": 1024, "ffn_gated": True}.items():
        assert start["shape"][key] == value
    assert data["baseline"] == start["name"] and data["baseline_kind"] == "start"


@pytest.mark.parametrize("args,message", [
    (["--params", "125e6", "--layers", "12", "--layers-range", "8:16"], "contradict each other"),
    (["--params", "1e3"], "no shape fits 1,000 parameters"),
    (["--params", "lots"], "--params must be a number"),
    (["--params", "125e6", "--ffn", "swiglu", "--family", "gpt2"], "contradicts --ffn swiglu"),
    (["--params", "125e6", "--hidden", "768"], "needs all of --hidden, --heads and --ffn-size"),
    (["--params", "125e6", "--device", "tpu9"], "unknown device 'tpu9'"),
])
def test_bad_input_exits_2_with_a_reason(args, message, capsys):
    assert main(["design"] + args + ["--quiet"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(backend_unavailable("torch-cuda") is None, reason="a GPU is present")
def test_named_gpu_without_one_exits_2(capsys):
    assert main(["design", "--params", "2.7e9", "--device", "h100", "--quiet"]) == 2
    assert "device h100 needs a CUDA GPU" in capsys.readouterr().err


def test_from_an_encoder_is_bad_input(reference_model, capsys):
    assert main(["design", "--from", str(reference_model("bert")), "--quiet"]) == 2
    assert "no LM head" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(backend_unavailable("torch-cuda") is not None,
                    reason=f"torch-cuda: {backend_unavailable('torch-cuda')}")
def test_design_on_a_gpu_reports_waves(capsys):
    """The paper's 2.7B case, cut down to seconds: the GPT-3 2.7B shape as the start."""
    args = ["design", "--hidden", "2560", "--heads", "32", "--ffn-size", "10240", "--layers",
            "32", "--device", "auto", "--batch", "1", "--seq", "512", "--rounds", "5",
            "--quiet", "--json"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["backend"] == "torch-cuda" and data["baseline_kind"] == "start"
    names = {s["name"] for s in data["shapes"]}
    assert "L32-h2560-a20-f10240" in names
    assert all("tiles" in g for s in data["shapes"] for g in s["gemms"])


def test_explanations_in_the_papers_terms():
    from tuner.design.explain import head_dim_note, waves_note
    from tuner.design.report import markdown, verdict

    assert "FlashAttention pads it to 96" in head_dim_note(80) and "ONNX Runtime has a fused" in head_dim_note(80)
    assert "ONNX Runtime has no fused attention kernel" in head_dim_note(96)
    assert "power of two >= 64" in head_dim_note(128)
    cands = enumerate_candidates(SearchSpace(count_params(PYTHIA_2_8B), (32,), 50257, NEOX),
                                 PYTHIA_2_8B)[:2]
    base = 100 + np.random.default_rng(1).normal(0, 3, 8)
    costs = [_cost(cands, 0, base), _cost(cands, 1, base / 1.2)]
    # GEMM results as a GPU run would give them: with waves on an H100
    h100 = DEVICES["h100"]
    from tuner.plan.probe import batched_waves
    gpu_costs = [ShapeCost(c.candidate, tuple(GemmResult(g.shape, "torch-cuda", h100.name,
                                                         g.samples_ms, batched_waves(g.shape, h100))
                                              for g in c.gemms), c.layer_ms, c.head_ms)
                 for c in costs]
    ranking = rank(gpu_costs, MeasureSettings(1, 16, rounds=8, backend="torch-cuda"), h100)
    note = waves_note(ranking.best.cost, h100)
    assert "tiles of 128x256" in note and "on 132 SMs" in note
    assert any(n.startswith("vs baseline, per GEMM group") for n in ranking.best.notes)
    assert verdict(ranking).startswith(f"best: {cands[1].name}, 1.200x")
    md = markdown(ranking, {"target": count_params(PYTHIA_2_8B)}, top=1)
    assert "CPU:" not in md and cands[0].name in md  # the baseline row is shown beyond --top
