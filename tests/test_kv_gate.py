"""The gate for decoders with a KV cache: `tuner verify m m` passes on every cache export,
corrupted copies (embedding rows x3, one FFN weight, the LM head's last vocab entry) fail,
and `tuner pad` gates cache models through the rollouts (vocab and FFN padding exact, the
cache untouched). A cache whose keys and values differ in width (multi-head latent
attention, DeepSeek-V3's Optimum export) is gated at each one's own width, and copies that
change its values alone or its keys' shared rotary part alone fail."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from models import optimum
from models.build import EXPORTERS, cached
from tuner.cli import main
from tuner.errors import BadInput
from tuner.graph.cache_record import cache_record
from tuner.gate.kv_feeds import prefill_feeds
from tuner.gate.kv_gate import SERVED, CacheFeeds, cache_feeds, check, widen_feeds
from tuner.graph.inspect import inspect_model
from tuner.graph.lm_head import token_embedding
from tuner.graph.load import load_model
from tuner.jobs.pad import pad_file
from tuner.rewrite.common import find_node
from tuner.rewrite.compose import PadRequest
from tuner.runtime.ort import OrtRunner, load_cpu

FAMILIES = ("gpt2", "llama", "gpt_neox", "mistral")


def _src(family: str, exporter: str):
    return cached(f"{family}-kv", "awkward", exporter)


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("family", FAMILIES)
def test_verify_a_cache_model_against_itself_passes(family, exporter, capsys):
    src = str(_src(family, exporter))
    assert main(["verify", src, src]) == 0
    out = capsys.readouterr().out
    assert "greedy rollouts" in out and "present.1.value" in out and out.strip().endswith("PASS")


def _corrupt(model: ir.Model, how: str) -> None:
    shape = inspect_model(model)
    if how == "embedding":  # every row x3
        w = token_embedding(model.graph).weight
        w.const_value = ir.tensor(w.const_value.numpy() * 3)
    elif how == "ffn":  # one weight of one FFN
        w = find_node(model.graph, shape.sites.layers[0].ffn.down).inputs[1]
        arr = w.const_value.numpy().copy()
        arr.reshape(-1)[7] += 0.5
        w.const_value = ir.tensor(arr)
    else:  # the LM head's last vocab entry
        w = find_node(model.graph, shape.sites.lm_head).inputs[1]
        arr = w.const_value.numpy().copy()
        axis = list(arr.shape).index(shape.vocab_size)
        last = np.moveaxis(arr, axis, 0)[-1]  # a view: edits arr
        last += np.random.default_rng(0).standard_normal(last.shape).astype(arr.dtype)
        # (not a constant: after a LayerNorm the hidden features sum to ~0, hiding a shift)
        w.const_value = ir.tensor(arr)


@pytest.mark.parametrize("how", ["embedding", "ffn", "lm_head"])
@pytest.mark.parametrize("family,exporter", [("gpt2", "torchscript"), ("llama", "dynamo")])
def test_corrupted_copies_fail(family, exporter, how, tmp_path, capsys):
    if how == "lm_head" and family == "gpt2":
        family = "gpt_neox"  # GPT-2 ties its head to the embedding: the embedding liar covers it
    src = _src(family, exporter)
    model = load_model(src)
    _corrupt(model, how)
    liar = tmp_path / "liar.onnx"
    ir.save(model, str(liar))
    assert main(["verify", str(src), str(liar)]) == 1
    assert capsys.readouterr().out.strip().endswith("FAIL")


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("family", FAMILIES)
def test_vocab_and_ffn_padding_leave_the_cache_alone(family, exporter, tmp_path):
    src = _src(family, exporter)
    shape = inspect_model(load_model(src))
    req = PadRequest.from_multiples(shape, ffn_multiple=64, vocab_multiple=64)
    res = pad_file(src, tmp_path / "p.onnx", req)
    assert res.accuracy and "greedy rollouts" in res.accuracy.tolerance
    assert {t.kind for t in res.records} == {"vocab", "ffn"}
    assert all(o.max_abs <= 1e-4 for o in res.accuracy.outputs)
    before = inspect_model(load_model(src)).cache
    after = inspect_model(load_model(tmp_path / "p.onnx")).cache
    assert (after.num_kv_heads, after.head_dim, after.layout, after.layers) == (
        before.num_kv_heads, before.head_dim, before.layout, before.layers)


def test_a_widened_candidate_is_fed_zeros_in_the_new_entries():
    roles = cache_record(load_model(_src("llama", "dynamo")))
    first = prefill_feeds(roles, np.array([[1, 2, 3]]))
    name = next(iter(roles.past_to_present))
    pos = tuple(range(0, 40)) + tuple(range(64, 104))  # per half, 80 -> 128
    wide = widen_feeds(first, {name: ((3, pos, 128),)})
    assert wide.arrays[name].shape[3] == 128 and first.arrays[name].shape[3] == 80


def test_the_gate_fails_closed_on_a_candidate_that_cannot_run():
    src = _src("gpt2", "torchscript")
    feeds = cache_feeds(cache_record(load_model(src)), 50257)
    assert isinstance(feeds, CacheFeeds) and len(feeds) == 4 + len(SERVED)

    class Broken:
        def infer(self, feeds):
            raise RuntimeError("no")

    result = check(OrtRunner(load_cpu(src)), Broken(), feeds)
    assert not result and "the candidate failed to run" in result.errors[0]


def _alone(runner, record, start, row: int, steps: int) -> np.ndarray:
    """Row `row` of a served-shape start rolled out alone: its own cache, unpadded."""
    from tuner.gate.decode_step import row_cache, step_feeds
    from tuner.gate.kv_feeds import greedy_rollout

    past = start.mask[:, : start.past]
    mine = row_cache(record, {n: start.arrays[n] for n in record.past}, past[row], row)
    tokens = start.arrays[record.input_ids][row][start.mask[row, start.past:] == 1]
    length = int(past[row].sum())
    feeds = step_feeds(record, [tuple(int(t) for t in tokens)], np.ones((1, length), np.int64),
                       mine)
    return greedy_rollout(runner.infer, feeds, steps).tokens[0]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_served_shapes_give_each_row_what_it_gives_alone(family):
    """Rows of different lengths, bucket padding, a chunk beside decoding rows: each real
    row of a served-shape rollout generates what it generates alone (the shapes are right,
    not only equal between two models)."""
    from tuner.gate.kv_feeds import greedy_rollout

    src = _src(family, "torchscript")
    record = cache_record(load_model(src))
    runner = OrtRunner(load_cpu(src))
    feeds = cache_feeds(record, 1003)
    served = feeds.starts[-len(SERVED):]
    for (lengths, _, _, _, steps), (start, _) in zip(SERVED, served):
        together = greedy_rollout(runner.infer, start, steps).tokens
        for row in range(len(lengths)):
            np.testing.assert_array_equal(together[row], _alone(runner, record, start, row, steps))


def test_a_corrupted_model_fails_on_the_served_shapes_alone(tmp_path):
    src = _src("llama", "torchscript")
    model = load_model(src)
    _corrupt(model, "ffn")
    bad = tmp_path / "bad.onnx"
    ir.save(model, bad)
    feeds = cache_feeds(cache_record(load_model(src)), 1003)
    served = CacheFeeds(feeds.roles, feeds.starts[-len(SERVED):])
    assert check(OrtRunner(load_cpu(src)), OrtRunner(load_cpu(src)), served)
    assert not check(OrtRunner(load_cpu(src)), OrtRunner(load_cpu(bad)), served)


def _noisy_columns(src, dst, node: str, cols: slice, std: float):
    """A copy of `src` whose MatMul named with `node` gets noise of `std` in its weight
    columns `cols` (its outputs there change, nothing else the graph computes before it)."""
    model = load_model(src)
    w = next(n for n in model.graph if n.op_type == "MatMul" and node in n.name).inputs[1]
    arr = w.const_value.numpy().copy()  # (in, out)
    noise = np.random.default_rng(0).standard_normal(arr[:, cols].shape) * std
    arr[:, cols] += noise.astype(arr.dtype)
    w.const_value = ir.tensor(arr)
    ir.save(model, str(dst))
    return dst


@pytest.mark.venv(*optimum.VENV)  # the export is cached; its environment built beside the tests
def test_a_latent_attention_cache_is_gated_at_its_own_widths(tmp_path, capsys):
    """DeepSeek-V3 caches keys 24 wide (16 per head, 8 of rotary shared by the heads) and
    values 16: each past gets its own shape, the bytes count both widths, a shape asked for
    without the tensor's name is refused; `verify m m` passes comparing both presents, and a
    copy whose values alone change (head 0's value columns of layer 0's kv_b_proj, per head
    [keys 16 | values 16]) or whose keys' shared rotary part alone changes (the last 8
    columns of layer 1's kv_a_proj_with_mqa, [latent 32 | rotary 8]) FAILS on that cache,
    the same layer's other cache passing."""
    src = optimum.cached("deepseek_v3")
    record = cache_record(load_model(src))
    assert (record.head_dim, record.value_head_dim, record.layout) == (24, 16, "bhsd")
    assert record.past_shape(2, 5, "past_key_values.1.key") == (2, 4, 5, 24)
    assert record.past_shape(2, 5, "past_key_values.1.value") == (2, 4, 5, 16)
    assert record.bytes_per_token == 2 * 4 * (24 + 16) * 4  # layers x kv heads x widths x fp32
    with pytest.raises(BadInput, match="needs the tensor's name"):
        record.past_shape(2, 5)
    assert main(["verify", str(src), str(src)]) == 0
    out = capsys.readouterr().out
    assert "present.1.value" in out and out.strip().endswith("PASS")
    liars = (("layers.0/self_attn/kv_b_proj", slice(16, 32), "present.0.value", "present.0.key"),
             ("layers.1/self_attn/kv_a_proj_with_mqa", slice(32, 40), "present.1.key",
              "present.1.value"))
    for node, cols, hit, spared in liars:  # noise of 1e-3: the cache's own rows tell
        liar = _noisy_columns(src, tmp_path / f"{hit}.onnx", node, cols, 1e-3)
        assert main(["verify", str(src), str(liar)]) == 1
        out = capsys.readouterr().out
        rows = {line.split()[0]: line.split()[-1] for line in out.splitlines()
                if line.startswith("present.")}
        assert (rows[hit], rows[spared], out.strip()[-4:]) == ("FAIL", "pass", "FAIL"), out
