"""Feeds for cache models (roles by structure, prefill with past 0, decode with past P) and
the greedy rollout that feeds each model its own present: a model against itself passes,
and its liar (token embedding rows scaled by 3) fails."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from models.build import EXPORTERS, cached, spec
from tuner.errors import BadInput
from rollout_checks import compare_rollouts
from tuner.gate.kv_feeds import decode_feeds, greedy_rollout, prefill_feeds
from tuner.graph.cache_record import cache_record
from tuner.graph.lm_head import token_embedding
from tuner.graph.load import load_model
from tuner.runtime.ort import OrtRunner, load_cpu


def _runner(path) -> OrtRunner:
    return OrtRunner(load_cpu(path))


def _roles(family: str, exporter: str):
    return cache_record(load_model(cached(f"{family}-kv", "awkward", exporter)))


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_roles_are_found(family, exporter):
    roles = _roles(family, exporter)
    assert (roles.input_ids, roles.attention_mask, roles.position_ids, roles.logits) == (
        "input_ids", "attention_mask", "position_ids", "logits")
    assert roles.past_to_present["past_key_values.1.value"] == "present.1.value"
    assert roles.dtypes["input_ids"] == "int64" and roles.dtypes["past_key_values.0.key"] == "float32"


def test_roles_do_not_depend_on_names(tmp_path):
    """The STYLE.md trap: inputs called tok / m / p / c0 still get their roles."""
    model = load_model(cached("llama-kv", "awkward", "dynamo"))
    rename = {"input_ids": "tok", "attention_mask": "m", "position_ids": "p"}
    for i, v in enumerate(model.graph.inputs):  # past_key_values.* are inputs 3..6
        v.name = rename.get(v.name, f"c{i}")
    roles = cache_record(model)
    assert (roles.input_ids, roles.attention_mask, roles.position_ids) == ("tok", "m", "p")
    assert sorted(roles.past_to_present) == ["c3", "c4", "c5", "c6"]


def test_a_model_without_a_cache_is_refused():
    with pytest.raises(BadInput, match="no KV cache"):
        cache_record(load_model(cached("llama", "awkward", "torchscript")))


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_prefill_and_decode_feeds_run(exporter):
    roles = _roles("llama", exporter)
    runner = _runner(cached("llama-kv", "awkward", exporter))
    expect = spec("llama-kv", "awkward").expect
    kv, d = expect["num_kv_heads"], expect["head_dim"]
    ids = np.arange(10).reshape(2, 5)
    first = prefill_feeds(roles, ids)
    assert first.arrays["past_key_values.0.key"].shape == (2, kv, 0, d)  # (B, kv_heads, 0, d)
    assert first.arrays["attention_mask"].shape == (2, 5) and first.past == 0
    assert runner.infer(first.arrays)["present.0.key"].shape == (2, kv, 5, d)
    for seq in (1, 3):  # a decode step and a chunk
        step = decode_feeds(roles, batch=2, past=7, seq=seq, vocab_size=1003)
        assert step.arrays["attention_mask"].shape == (2, 7 + seq)
        np.testing.assert_array_equal(step.arrays["position_ids"], [list(range(7, 7 + seq))] * 2)
        assert {a.dtype.name for n, a in step.arrays.items() if n.startswith("past")} == {"float32"}
        out = runner.infer(step.arrays)
        assert out["present.1.value"].shape == (2, kv, 7 + seq, d)
        assert out["logits"].shape == (2, seq, 1003)


def _liar(family: str, exporter: str, tmp_path) -> str:
    """A copy whose token embedding rows are scaled by 3: must FAIL the comparison."""
    model = load_model(cached(f"{family}-kv", "awkward", exporter))
    weight = token_embedding(model.graph).weight
    weight.const_value = ir.tensor(weight.const_value.numpy() * 3)
    path = tmp_path / "liar.onnx"
    ir.save(model, str(path))
    return str(path)


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("family", ["gpt2", "llama", "gpt_neox", "mistral"])
def test_rollout_against_itself_passes_and_the_liar_fails(family, exporter, tmp_path):
    path = cached(f"{family}-kv", "awkward", exporter)
    roles = _roles(family, exporter)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, spec(f"{family}-kv", "awkward").expect["vocab_size"], (2, 6))
    mask = np.ones_like(ids)
    mask[1, :2] = 0  # a left-padded row: its padded logits are left out
    first = prefill_feeds(roles, ids, mask)
    ref = greedy_rollout(_runner(path).infer, first, steps=4)
    assert ref.tokens.shape == (2, 4) and len(ref.logits) == 4
    assert ref.cache["present.0.key"].shape[2] == 6 + 3  # the prompt and 3 fed tokens
    same = compare_rollouts(ref, greedy_rollout(_runner(path).infer, first, steps=4))
    assert same and max(same.max_abs) <= 1e-5, same
    liar = compare_rollouts(ref, greedy_rollout(_runner(_liar(family, exporter, tmp_path)).infer,
                                                first, steps=4))
    assert not liar and liar.reason.startswith("step 0: logits differ"), liar


def test_rollout_tokens_are_transformers_greedy_tokens():
    """The rollout's own bookkeeping (mask growth, positions, present -> past) is right:
    its tokens are generate(do_sample=False)'s."""
    import torch

    from models.build import build_torch_model

    model = build_torch_model(spec("llama-kv", "awkward"))
    model.generation_config.eos_token_id = None  # random weights: never stop early
    model.generation_config.pad_token_id = 0
    ids = np.random.default_rng(5).integers(0, 1003, (2, 6))
    run = greedy_rollout(_runner(cached("llama-kv", "awkward", "dynamo")).infer,
                         prefill_feeds(_roles("llama", "dynamo"), ids), steps=5)
    with torch.no_grad():
        ref = model.generate(torch.tensor(ids), attention_mask=torch.ones(2, 6, dtype=torch.int64),
                             do_sample=False, max_new_tokens=5)
    np.testing.assert_array_equal(run.tokens, ref[:, 6:].numpy())


def test_feed_arguments_are_checked():
    roles = _roles("gpt2", "torchscript")
    with pytest.raises(BadInput, match=r"prompt ids must be \(batch, seq >= 1\)"):
        prefill_feeds(roles, np.zeros((2, 0), np.int64))
    with pytest.raises(BadInput, match="prefill mask .* must match the ids"):
        prefill_feeds(roles, np.zeros((2, 3), np.int64), np.ones((2, 4)))
    with pytest.raises(BadInput, match="past >= 0"):
        decode_feeds(roles, batch=1, past=-1, seq=1, vocab_size=10)
    with pytest.raises(BadInput, match="steps >= 1"):
        greedy_rollout(lambda feeds: {}, prefill_feeds(roles, np.zeros((1, 2), np.int64)), 0)


def test_a_near_tie_that_flips_a_token_fails_with_that_reason():
    roles = _roles("gpt2", "torchscript")
    ref = greedy_rollout(_runner(cached("gpt2-kv", "awkward", "torchscript")).infer,
                         prefill_feeds(roles, np.array([[1, 2, 3]])), steps=2)
    flipped = type(ref)(ref.logits, ref.query_masks, ref.tokens + 1, ref.cache)
    check = compare_rollouts(ref, flipped)
    assert not check and check.reason == "step 0: greedy tokens differ"


def test_the_gates_tolerance_objects_are_policies_here():
    """tuner.verify.Tolerance (per-output limits) plugs in as the rollout's policy."""
    try:  # tuner/verify.py is moving to tuner/gate/verify.py
        from tuner.gate.verify import Tolerance
    except ImportError:
        from tuner.verify import Tolerance

    roles = _roles("llama", "torchscript")
    run = greedy_rollout(_runner(cached("llama-kv", "awkward", "torchscript")).infer,
                         prefill_feeds(roles, np.array([[1, 2, 3]])), steps=2)
    noisy = type(run)(tuple(x + 1e-3 for x in run.logits), run.query_masks, run.tokens, run.cache)
    assert not compare_rollouts(run, noisy, Tolerance(atol=1e-4, rtol=0))
    assert compare_rollouts(run, noisy, Tolerance(atol=1e-4, rtol=0, per_output=(("logits", 1e-2, 0),)))


def test_a_static_batch_is_kept():
    from dataclasses import replace

    roles = replace(_roles("gpt2", "torchscript"), batch=1)
    assert decode_feeds(roles, batch=1, past=2, seq=1, vocab_size=10).arrays["input_ids"].shape == (1, 1)
    with pytest.raises(BadInput, match="batch is fixed to 1; feeds of batch 2"):
        decode_feeds(roles, batch=2, past=2, seq=1, vocab_size=10)
