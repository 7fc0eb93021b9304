"""The gate cannot be fooled by layouts that are not our reference builds (models/layouts.py):
batch fixed to 1, fully static, renamed inputs, int32 ids, bool mask, inputs_embeds only,
fp16, bf16 I/O, BERT with token_type_ids. For each: roles found from the structure, `tuner
verify` passes the true copy and FAILS three corrupted copies (its liars), `pad` runs and
the padded copy passes, and a served artifact answers exactly after its start-up gate (which
refuses a corrupted variant and serves the original instead)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from tuner.cli import main
from tuner.gate.feeds import make_feeds
from tuner.graph.inspect import inspect_model
from tuner.graph.io import embedding_table
from tuner.graph.roles import (ATTENTION_MASK, INPUTS_EMBEDS, TOKEN_IDS, TOKEN_TYPE_IDS,
                               input_specs, with_role)

ROLES = {  # layout -> {input: role}: what the structure must say, whatever the names
    "batch1": {"input_ids": TOKEN_IDS, "attention_mask": ATTENTION_MASK},
    "static": {"input_ids": TOKEN_IDS, "attention_mask": ATTENTION_MASK},
    "renamed": {"tok": TOKEN_IDS, "m": ATTENTION_MASK},
    "xnames": {"x0": ATTENTION_MASK, "x1": TOKEN_IDS},
    "int32": {"input_ids": TOKEN_IDS, "attention_mask": ATTENTION_MASK},
    "boolmask": {"input_ids": TOKEN_IDS, "attention_mask": ATTENTION_MASK},
    "embeds": {"inputs_embeds": INPUTS_EMBEDS},
    "fp16": {"input_ids": TOKEN_IDS, "attention_mask": ATTENTION_MASK},
    "bf16io": {"inputs_embeds": INPUTS_EMBEDS, "attention_mask": ATTENTION_MASK},
    "bert": {"input_ids": TOKEN_IDS, "attention_mask": ATTENTION_MASK,
             "token_type_ids": TOKEN_TYPE_IDS},
}
LAYOUTS = tuple(ROLES)


@pytest.fixture(scope="module")
def layout():
    from models.layouts import cached
    return cached


def _const(model: ir.Model, name: str) -> ir.Value:
    value = model.graph.initializers.get(name)
    assert value is not None and value.const_value is not None, name
    return value


def _edit(value: ir.Value, fn) -> None:
    arr = value.const_value.numpy()
    new = fn(arr.astype(np.float32)).astype(arr.dtype)
    value.const_value = ir.Tensor(new, name=value.name)


def _node(model: ir.Model, name: str) -> ir.Node:
    return next(n for n in model.graph if n.name == name)


def corrupt(src: Path, dst: Path, kind: str) -> Path:
    """A copy of `src` with one corruption, written through onnx_ir:
    embedding: the rows of the table the inputs index (token embedding; the position table
      for inputs_embeds layouts) other than row 0, scaled x3;
    ffn: one weight of layer 0's FFN up projection changed;
    lm_head: the LM head's last vocabulary row changed."""
    model = ir.load(str(src))
    shape = inspect_model(model)
    if kind == "embedding":
        specs = input_specs(model)
        token = with_role(specs, TOKEN_IDS)
        name = embedding_table(model, token.name) if token else next(
            n.inputs[0].name for n in model.graph if n.op_type == "Gather"
            and n.inputs[0] is not None and n.inputs[0].const_value is not None
            and len(n.inputs[0].const_value.shape) == 2)
        _edit(_const(model, name), lambda a: np.concatenate([a[:1], a[1:] * 3]))
    elif kind == "ffn":
        up = _node(model, shape.sites.layers[0].ffn.up)
        weight = next(i for i in up.inputs if i is not None and i.const_value is not None
                      and len(i.const_value.shape) == 2)

        def one(a):
            a = a.copy()
            a[0, 0] += 4.0
            return a
        _edit(weight, one)
    elif kind == "lm_head":
        w = _const(model, shape.sites.lm_head_weight)
        vocab_axis = 0 if w.const_value.shape[0] == shape.vocab_size else 1

        def last(a):  # not a constant shift: a LayerNorm'd hidden state sums to ~0
            a = a.copy()
            noise = np.random.default_rng(0).standard_normal(a.shape[1 - vocab_axis])
            if vocab_axis == 0:
                a[-1] += noise
            else:
                a[:, -1] += noise
            return a
        _edit(w, last)
    ir.save(model, str(dst))
    return dst


@pytest.mark.parametrize("name", LAYOUTS)
def test_roles_are_found_from_structure(layout, name):
    specs = {s.name: s for s in input_specs(layout(name))}
    assert {n: s.role for n, s in specs.items()} == ROLES[name]
    for s in specs.values():
        assert (s.batch_axis, s.seq_axis) == (0, 1), s


def test_feeds_keep_static_dims_and_declared_dtypes(layout):
    (feed,) = make_feeds(layout("static"), 1003, [(3, 33)])[:1]
    assert {k: v.shape for k, v in feed.items()} == {"input_ids": (1, 16), "attention_mask": (1, 16)}
    shapes = [f["input_ids"].shape for f in make_feeds(layout("batch1"), 1003)]
    assert shapes == [(1, 7), (1, 16), (1, 33)]  # the batch stays 1, the length is honoured
    int32 = make_feeds(layout("int32"), 1003, [(2, 5)])[0]
    assert int32["input_ids"].dtype == np.int32 and int32["attention_mask"].dtype == np.int32
    assert make_feeds(layout("boolmask"), 1003, [(2, 5)])[0]["attention_mask"].dtype == bool
    ids = make_feeds(layout("xnames"), 1003, [(3, 33)])[0]["x1"]
    assert len(np.unique(ids)) > 20  # real token ids, not all zeros
    bf16 = make_feeds(layout("bf16io"), 1003, [(2, 5)])[0]["inputs_embeds"]
    assert bf16.dtype.name == "bfloat16"


@pytest.mark.parametrize("name", LAYOUTS)
def test_verify_passes_the_true_copy_and_fails_every_corruption(layout, name, tmp_path, capsys):
    src = layout(name)
    true_copy = tmp_path / "copy.onnx"
    shutil.copyfile(src, true_copy)
    assert main(["verify", str(src), str(true_copy)]) == 0
    text = capsys.readouterr().out
    assert "PASS" in text and " 0  pass" not in text
    if name == "fp16":
        assert "fp16 model: fp16 tolerances" in text
    for kind in ("embedding", "ffn", "lm_head"):
        bad = corrupt(src, tmp_path / f"{kind}.onnx", kind)
        rc = main(["verify", str(src), str(bad)])
        out = capsys.readouterr().out
        assert rc == 1 and "FAIL" in out, f"{name}/{kind} passed the gate:\n{out}"


@pytest.mark.parametrize("name", LAYOUTS)
def test_pad_runs_and_passes_the_gate(layout, name, tmp_path, capsys):
    src, out = layout(name), tmp_path / "padded.onnx"
    rc = main(["pad", str(src), "-o", str(out), "--vocab-multiple", "64", "--ffn-multiple", "64"])
    captured = capsys.readouterr()
    # every layout pads today: a refusal (exit 2) is a regression, not a skip
    assert rc == 0, f"pad exited {rc} on {name}:\n{captured.out}{captured.err}"
    assert "PASS" in captured.out
    assert main(["verify", str(src), str(out)]) == 0


def _request(name: str, src: Path) -> dict[str, np.ndarray]:
    """A request the layout takes: 1 x 5 (1 x 16 when static), real ids, a full mask."""
    seq = 16 if name == "static" else 5
    return make_feeds(src, 1003, [(1, seq)], seed=11)[0]


def _served_equals_direct(server, src: Path, feeds: dict[str, np.ndarray]) -> None:
    import tritonclient.grpc as tg

    from serving.datatypes import datatype_of
    from tuner.runtime.ort import OrtRunner, load_cpu

    client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    inputs = []
    for k, v in feeds.items():
        i = tg.InferInput(k, list(v.shape), datatype_of(v.dtype))
        i.set_data_from_numpy(v)
        inputs.append(i)
    got = client.infer(server.slot.name, inputs).as_numpy("logits")
    want = OrtRunner(load_cpu(src)).infer(feeds)["logits"]
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


@pytest.mark.parametrize("name", LAYOUTS)
def test_serve_gates_at_start_and_answers_exactly(layout, name, tmp_path):
    from serving_support import make_artifact

    from serving.engine import EngineOptions
    from serving.server import Server, ServerOptions
    from tuner.artifact.records import Buckets

    src = layout(name)
    padded, bad = tmp_path / "padded.onnx", tmp_path / "bad.onnx"
    assert main(["pad", str(src), "-o", str(padded), "--ffn-multiple", "64"]) == 0
    corrupt(src, bad, "ffn")
    buckets = Buckets(batch=(1, 2), seq=(16, 32))
    for variant, served in ((padded, "padded"), (bad, "original")):
        out = make_artifact(tmp_path / f"art-{served}", src, buckets, variant=variant)
        server = Server(out, ServerOptions(port=0, metrics_port=0, engine=EngineOptions()),
                        say=lambda line: None)
        server.start()
        try:
            assert server.wait_ready(120), server.slot.status
            model = server.slot.engine.model
            assert model.served == served, model.note
            if name in ("batch1", "static"):
                assert server.slot.engine.max_batch == 1 and server.slot.engine.join_rows == 1
            _served_equals_direct(server, src, _request(name, src))
            if served == "padded" and name in ("xnames", "int32", "batch1"):
                _ids_out_of_range_are_invalid_argument(server, src, name)
            if served == "padded" and name == "batch1":
                _concurrent_requests_are_never_joined(server, src)
        finally:
            server.stop(5)


def _client_inputs(feeds):
    import tritonclient.grpc as tg

    from serving.datatypes import datatype_of

    out = []
    for k, v in feeds.items():
        i = tg.InferInput(k, list(v.shape), datatype_of(v.dtype))
        i.set_data_from_numpy(v)
        out.append(i)
    return out


def _ids_out_of_range_are_invalid_argument(server, src, name):
    """The vocabulary check follows the role, whatever the input is called; a negative id
    (which ONNX's Gather would wrap silently) is refused too; never INTERNAL."""
    import tritonclient.grpc as tg
    from tritonclient.utils import InferenceServerException

    client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    token = with_role(input_specs(src), TOKEN_IDS).name
    for bad in (1003, -1):
        feeds = _request(name, src)
        feeds[token] = feeds[token].copy()
        feeds[token][0, 2] = bad
        with pytest.raises(InferenceServerException) as info:
            client.infer(server.slot.name, _client_inputs(feeds))
        assert "INVALID_ARGUMENT" in str(info.value.status()), info.value
        assert f"input '{token}'" in info.value.message() and "vocabulary [0, 1003)" in \
            info.value.message()


def _concurrent_requests_are_never_joined(server, src):
    """A batch-1 graph: requests queued together still run one by one, each exact."""
    import tritonclient.grpc as tg
    from serving_support import Answers

    from tuner.runtime.ort import OrtRunner, load_cpu

    client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    requests = [make_feeds(src, 1003, [(1, n)], seed=n)[0] for n in (3, 5, 7, 9, 11, 13)]
    answers = Answers()
    for i, feeds in enumerate(requests):
        client.async_infer(server.slot.name, _client_inputs(feeds), answers.callback(i))
    answers.wait(len(requests), 60)
    direct = OrtRunner(load_cpu(src))
    for i, feeds in enumerate(requests):
        got = answers.results[i]
        assert not isinstance(got, Exception), got
        np.testing.assert_allclose(got.as_numpy("logits"), direct.infer(feeds)["logits"],
                                   atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", LAYOUTS)
def test_optimize_runs_on_shapes_the_model_takes(layout, name, tmp_path, capsys):
    import json

    src, out = layout(name), tmp_path / "out"
    rc = main(["optimize", str(src), "-o", str(out), "--rounds", "2", "--warmup", "0",
               "--bucket-rounds", "1", "--no-probe", "--no-plots", "--max-variants", "3",
               "--max-seq", "32",
               "--no-cache", "-q", *([] if name == "fp16" else ["--no-fuse"])])
    captured = capsys.readouterr()
    # every layout optimizes today: a refusal (exit 2) is a regression, not a skip
    assert rc == 0, f"optimize exited {rc} on {name}:\n{captured.err}"
    manifest = json.loads((out / "manifest.json").read_text())
    if name in ("batch1", "static"):
        assert manifest["buckets"]["batch"] == [1]
    if name == "static":
        assert manifest["buckets"]["seq"] == [16]
    for v in manifest["variants"]:
        assert v["accuracy"]["passed"], v
        for key in v["latency"]:
            b, s = (int(x) for x in key.split("x"))
            assert name not in ("batch1", "static") or b == 1
            assert name != "static" or s == 16
    if name == "fp16":  # its own fusions pass at its own precision
        fused = [v for v in manifest["variants"] if "fuse" in v["name"]]
        assert fused and "fp16 model: fp16 tolerances" in fused[0]["accuracy"]["detail"]


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_gate_pad_and_optimize_share_fails_corrupted_copies(layout, name, tmp_path):
    """tuner.jobs.pad.gate is what `pad` and every `optimize` variant pass through, on feeds
    made as they make them: the true copy passes, each corrupted copy raises NotExact."""
    from tuner.gate.feeds import DEFAULT_SHAPES
    from tuner.gate.verify import Tolerance
    from tuner.graph.io import model_precision, vocab_for_feeds
    from tuner.graph.load import load_model
    from tuner.gate.entry import prepare
    from tuner.jobs.pad import NotExact, gate, load_reference

    src = layout(name)
    model = load_model(src)
    specs = input_specs(model)
    feeds = make_feeds(specs, vocab_for_feeds(model, inspect_model(model)), DEFAULT_SHAPES)
    check = prepare(model, lambda: load_reference(src), feeds=feeds, tolerance=Tolerance())
    assert check.tolerance == Tolerance().at_precision(model_precision(model))
    assert [s.name for s in check.specs] == [s.name for s in specs]
    true_copy = tmp_path / "copy.onnx"
    shutil.copyfile(src, true_copy)
    assert gate(check, true_copy)
    for kind in ("embedding", "ffn", "lm_head"):
        with pytest.raises(NotExact, match="does not match the original within tolerance"):
            gate(check, corrupt(src, tmp_path / f"{kind}.onnx", kind))
