"""Head-dim and head-count padding of decoders with a KV cache, both cache policies
(tuner.rewrite.axis.cache), each proven by the rollout gate: `keep` leaves the cache that
clients see as it was, `widen` widens the cache inputs/outputs and records where the
original entries sit. Every test has its liar: a widened model that is fed the original
cache shape does not run, and a corrupted widened model fails the gate."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

from models.build import EXPORTERS, cached
from tuner.cli import main
from tuner.errors import BadInput
from tuner.graph.cache_record import cache_record
from tuner.gate.kv_feeds import prefill_feeds
from tuner.gate.kv_gate import cache_feeds, check
from tuner.graph.inspect import inspect_model
from tuner.graph.kv_cache import widened_cache
from tuner.graph.lm_head import token_embedding
from tuner.graph.load import load_model
from tuner.jobs.pad import pad_file
from tuner.rewrite.compose import PadRequest
from tuner.runtime.ort import OrtRunner, load_cpu

FAMILIES = ("gpt2", "llama", "gpt_neox", "mistral")


def _src(family: str, exporter: str):
    return cached(f"{family}-kv", "awkward", exporter)


def _cache_io(path):
    m = load_model(path)
    return {v.name: [d if isinstance(d, int) else str(d) for d in v.shape]
            for v in (*m.graph.inputs, *m.graph.outputs)
            if v.name.startswith(("past", "present"))}


@pytest.mark.parametrize("policy", ["keep", "widen"])
@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("family", FAMILIES)
def test_head_dim_padding_with_either_policy_is_exact(family, exporter, policy, tmp_path):
    src = _src(family, exporter)
    shape = inspect_model(load_model(src))
    dst = tmp_path / "p.onnx"
    res = pad_file(src, dst, PadRequest.from_multiples(shape, head_dim=128, cache_policy=policy))
    assert res.transforms == (f"head_dim {shape.head_dim}->128",)
    assert res.accuracy and max(o.max_abs for o in res.accuracy.outputs) <= 1e-4
    before, after = _cache_io(src), _cache_io(dst)
    # inspect still finds the cache of the variant (behind the padding, for keep)
    assert inspect_model(load_model(dst)).cache.head_dim == (
        shape.head_dim if policy == "keep" else 128)
    if policy == "keep":  # the client-visible cache is untouched
        assert after == before and widened_cache(load_model(dst)) == {}
    else:
        assert {n: s[3] for n, s in after.items()} == {n: 128 for n in before}
        table = widened_cache(load_model(dst))
        assert set(table) == set(before)
        (axis, pos, new), = table["past_key_values.0.key"]
        assert (axis, new, len(pos)) == (3, 128, shape.head_dim)
        if shape.sites.layers[0].attention.rotary == "full":  # per half: i still meets i + d'/2
            half = shape.head_dim // 2
            assert pos[half] == 64 and pos[half - 1] == half - 1


@pytest.mark.parametrize("policy", ["keep", "widen"])
@pytest.mark.parametrize("family,exporter", [("gpt2", "torchscript"), ("gpt_neox", "dynamo"),
                                             ("llama", "torchscript")])
def test_head_count_padding_with_either_policy_is_exact(family, exporter, policy, tmp_path):
    src = _src(family, exporter)
    shape = inspect_model(load_model(src))
    dst = tmp_path / "p.onnx"
    res = pad_file(src, dst, PadRequest.from_multiples(shape, heads=4, cache_policy=policy))
    assert res.accuracy and res.transforms == ("heads 2->4",)
    kv_heads = {n: s[1] for n, s in _cache_io(dst).items()}
    if policy == "widen" and shape.num_kv_heads == shape.num_heads:
        assert set(kv_heads.values()) == {4}
    else:  # keep, or GQA (new query heads join the existing kv groups: the cache is the same)
        assert set(kv_heads.values()) == {shape.num_kv_heads}


def test_both_axes_widened_then_the_cli_gate_feeds_the_wider_past(tmp_path, capsys):
    src = _src("gpt2", "dynamo")
    dst = tmp_path / "w.onnx"
    assert main(["pad", str(src), "-o", str(dst), "--head-dim", "128", "--heads", "4",
                 "--cache-policy", "widen"]) == 0
    assert _cache_io(dst)["past_key_values.1.value"][1:] == [4, "past_sequence", 128]
    assert [e[0] for e in widened_cache(load_model(dst))["present.0.key"]] == [3, 1]
    capsys.readouterr()
    assert main(["verify", str(src), str(dst)]) == 0  # the variant's record says how to feed it
    assert capsys.readouterr().out.strip().endswith("PASS")


def test_liars_of_the_widened_gate(tmp_path):
    src = _src("llama", "dynamo")
    shape = inspect_model(load_model(src))
    dst = tmp_path / "w.onnx"
    pad_file(src, dst, PadRequest.from_multiples(shape, head_dim=128, cache_policy="widen"))
    roles = cache_record(load_model(src))
    # fed the original cache shape, the widened model does not run: the widening is real
    with pytest.raises(InvalidArgument,
                       match=r"invalid dimensions for input: past_key_values\.\d\.(key|value) "
                             r"for the following indices\n index: 3 Got: 80 Expected: 128"):
        OrtRunner(load_cpu(dst)).infer(prefill_feeds(roles, np.array([[1, 2]])).arrays)
    model = load_model(dst)
    w = token_embedding(model.graph).weight
    w.const_value = ir.tensor(w.const_value.numpy() * 3)
    liar = tmp_path / "liar.onnx"
    ir.save(model, str(liar))
    result = check(OrtRunner(load_cpu(src)), OrtRunner(load_cpu(liar)),
                   cache_feeds(roles, 1003), widened=widened_cache(load_model(liar)))
    assert not result and not next(o for o in result.outputs if o.name == "logits").passed


def test_an_unknown_cache_policy_is_bad_input():
    with pytest.raises(BadInput, match="cache policy must be one of keep|widen"):
        PadRequest(head_dim=128, cache_policy="shrink")


def test_every_padding_at_once_keeps_the_cache(tmp_path):
    """vocab, FFN, head dim and heads together, cache kept: the second widening (heads) meets
    the first one's in-graph padding and slicing and pads/slices again on its own axis."""
    src = _src("gpt2", "torchscript")
    shape = inspect_model(load_model(src))
    dst = tmp_path / "all.onnx"
    res = pad_file(src, dst, PadRequest.from_multiples(shape, vocab_multiple=64, ffn_multiple=64,
                                                       head_dim=128, heads=4))
    assert res.accuracy and len(res.transforms) == 4
    assert _cache_io(dst) == _cache_io(src)
    padded = inspect_model(load_model(dst))
    assert (padded.head_dim, padded.num_heads, padded.cache.head_dim,
            padded.cache.num_kv_heads) == (128, 4, 80, 2)
