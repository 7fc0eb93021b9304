"""The one entry to the gate (tuner.gate.entry.prepare): what it settles for every caller
(verify, pad, optimize's variants, the server): the reference recorded for plain feeds and
live for rollouts, tolerances at the model's own precision for cache models too, the floor of
compared elements for cache models too, and a corrupted copy that fails through it."""

from __future__ import annotations

import onnx_ir as ir
import pytest

from models.build import cached
from tuner.errors import BadInput
from tuner.gate.entry import prepare
from tuner.gate.verify import Replay, Tolerance
from tuner.graph.lm_head import token_embedding
from tuner.graph.load import load_model
from tuner.runtime.registry import get_backend

CPU = get_backend("ort-cpu")


def _kv():
    return cached("gpt2-kv", "awkward", "torchscript")


def test_plain_feeds_record_the_reference_and_rollouts_keep_it_live(reference_model):
    plain = reference_model("gpt2", "awkward")
    gate = prepare(plain, lambda: CPU.load(plain), vocab=50257)
    assert isinstance(gate.reference, Replay) and not gate.rollouts
    assert gate.check(CPU.load(plain)), "a model against itself passes"
    kv = _kv()
    live = prepare(kv, lambda: CPU.load(kv))
    assert live.rollouts and not isinstance(live.reference, Replay)
    assert live.check(CPU.load(kv), kv)


def test_a_corrupted_cache_model_fails_through_the_entry(tmp_path):
    kv = _kv()
    model = load_model(kv)
    w = token_embedding(model.graph).weight
    w.const_value = ir.tensor(w.const_value.numpy() * 3)  # every embedding row x3
    liar = tmp_path / "liar.onnx"
    ir.save(model, str(liar))
    gate = prepare(kv, lambda: CPU.load(kv), liar)
    result = gate.check(CPU.load(liar))
    assert not result and result.table().endswith("FAIL")


def test_the_compared_elements_floor_holds_for_cache_models_too():
    kv = _kv()
    gate = prepare(kv, lambda: CPU.load(kv), min_compared=10**12)
    result = gate.check(CPU.load(kv), kv)
    assert not result
    assert all(o.reason.startswith("nothing compared") for o in result.outputs)
    assert result.min_compared == 10**12


def test_a_half_precision_cache_model_is_gated_at_its_own_tolerances(tmp_path):
    from tuner.runtime.gpu import fp16_model

    half = fp16_model(_kv(), tmp_path)  # fp16 weights and compute, fp32 inputs and outputs
    gate = prepare(half, lambda: CPU.load(half), tolerance=Tolerance(atol=1e-4, rtol=1e-3))
    assert gate.rollouts and gate.tolerance == Tolerance.fp16()
    assert "fp16 model: fp16 tolerances" in gate.tolerance.label()


def test_a_variant_with_other_inputs_is_bad_input(reference_model):
    plain = reference_model("gpt2", "awkward")
    with pytest.raises(BadInput, match="the models take different inputs"):
        prepare(_kv(), lambda: CPU.load(plain), plain)
