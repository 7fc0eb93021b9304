"""`tuner optimize` on decoders with a KV cache (prefill and decode measured apart, the
manifest's `cache` and `phases`, cache-length buckets from the traffic) and `tuner serve` on
the result: a plain ModelInfer forward where the client passes past, exactly, with the past
checked against the mask."""

from __future__ import annotations

import json
import re

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as tg
from serving_support import make_artifact
from tritonclient.utils import InferenceServerException

from models import optimum
from models.build import EXPORTERS, cached
from serving.engine import EngineOptions
from serving.server import Server, ServerOptions
from tuner.artifact.store import read_manifest
from tuner.cli import main
from tuner.graph.cache_record import cache_record
from tuner.gate.kv_feeds import decode_feeds, prefill_feeds
from tuner.graph.inspect import inspect_model
from tuner.graph.load import load_model
from tuner.jobs.pad import pad_file
from tuner.rewrite.compose import PadRequest

FAST = ["--no-plots", "--rounds", "2", "--warmup", "0", "--bucket-rounds", "1", "--no-probe",
        "--no-fuse", "--max-variants", "2", "--no-cache", "--max-buckets", "2"]


def _src(family: str, exporter: str):
    return cached(f"{family}-kv", "awkward", exporter)


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("family", ["gpt2", "llama", "gpt_neox", "mistral"])
def test_optimize_a_cache_export_runs_to_an_artifact(family, exporter, tmp_path):
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("".join(json.dumps({"prompt_tokens": p, "output_tokens": o}) + "\n"
                               for p, o in ((5, 8), (12, 20), (30, 4), (9, 40))))
    out = tmp_path / "out"
    assert main(["optimize", str(_src(family, exporter)), "-o", str(out), "--requests",
                 str(traffic), *FAST]) == 0
    m = json.loads((out / "manifest.json").read_text())
    shape = inspect_model(load_model(_src(family, exporter)))
    c = m["cache"]
    assert (c["layers"], c["kv_heads"], c["head_dim"], c["layout"], c["policy"]) == (
        2, shape.num_kv_heads, shape.head_dim, "bhsd", "keep")
    assert c["original_shape"] == c["served_shape"] == ["batch", shape.num_kv_heads, "past",
                                                        shape.head_dim]
    # padded variants were made, and every variant in the artifact passed the rollout gate
    assert [v for v in m["variants"] if v["transforms"]], m["variants"]
    for v in m["variants"]:
        assert v["accuracy"]["passed"], v
        want = "greedy rollouts" if v["transforms"] else "the reference itself"
        assert want in v["accuracy"]["detail"], v
    ph = m["phases"]
    assert ph["mean_output_tokens"] == 18.0 and "decode" in ph["rule"]
    dec = ph["decode"]["shapes"][0]
    for v in m["variants"]:  # every variant timed in both phases at the selection shapes
        assert ph["prefill"]["shapes"][0] in v["latency"] and dec in v["latency_decode"]
    assert m["buckets"]["past"][-1] >= 30 + 4 - 1  # the longest cache a decode step reads
    assert "## Decoder: prefill and decode" in (out / "report.md").read_text()
    page = (out / "report.html").read_text()  # both phases side by side, one row per variant
    assert "<h2>Prefill and decode</h2>" in page and dec.split("@")[1] in page
    assert all(page.count(f">{v['name']}</th>") >= 2 for v in m["variants"])
    read_manifest(out)  # and it reads back


def test_traffic_of_prompts_alone_assumes_an_output_length(tmp_path):
    from tuner.jobs.decoder import DEFAULT_OUTPUT_TOKENS, decoder_traffic

    f = tmp_path / "t.jsonl"
    f.write_text('{"seq": 10}\n{"seq": 20, "batch": 2}\n')
    t = decoder_traffic(f, None, 2, 1024)
    assert t.mean_output == DEFAULT_OUTPUT_TOKENS and t.batch == (1, 2)
    assert t.past.max_seq == 20 + DEFAULT_OUTPUT_TOKENS - 1


def test_decode_is_compared_at_the_servers_streams():
    """--streams 32: decode steps are compared at the batch bucket of 32 streams (a server's
    in-flight batch), prefill stays at the traffic's; 1 (the default) keeps the traffic's."""
    from tuner.jobs.decoder import decode_shape, decoder_traffic

    t = decoder_traffic(None, 64, 32, 1024)
    assert decode_shape(t, (1, 32))[0] == 1
    assert decode_shape(t, (1, 32), streams=32)[0] == 32
    assert decode_shape(t, (1, 32), streams=20)[0] == 32  # the bucket that holds 20
    assert decode_shape(t, (1, 32), streams=64)[0] == 32  # no bigger bucket: the largest
    assert decode_shape(t, (1, 32), streams=20)[1] == decode_shape(t, (1, 32))[1]


# ---------------------------------------------------------------------------------------------
# serve


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """llama-kv (GQA, full rotary) with its head dim padded 80 -> 128 (cache kept), selected:
    the server gates it with rollouts before it serves it."""
    src = _src("llama", "dynamo")
    root = tmp_path_factory.mktemp("kvserve")
    shape = inspect_model(load_model(src))
    padded = root / "padded.onnx"
    pad_file(src, padded, PadRequest.from_multiples(shape, head_dim=128, vocab_multiple=64))
    out = make_artifact(root / "out", src, variant=padded)
    server = Server(out, ServerOptions(port=0, metrics_port=0, engine=EngineOptions()),
                    say=lambda line: None)
    server.start()
    assert server.wait_ready(120), server.slot.status
    yield server, src
    server.stop(5)


def _infer(server, feeds):
    c = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    inputs = []
    for name, a in feeds.items():
        i = tg.InferInput(name, list(a.shape), "FP32" if a.dtype == np.float32 else "INT64")
        i.set_data_from_numpy(a)
        inputs.append(i)
    res = c.infer(server.slot.name, inputs)
    return {o.name: res.as_numpy(o.name) for o in res.get_response().outputs}


def test_serve_answers_prefill_then_decode_with_the_clients_past_exactly(served):
    server, src = served
    assert server.slot.engine.model.served == "padded"  # the rollout gate passed on the server
    roles = cache_record(load_model(src))
    direct = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    names = [o.name for o in direct.get_outputs()]
    first = dict(prefill_feeds(roles, np.array([[3, 14, 15, 92, 65]])).arrays)  # past 0
    got = _infer(server, first)
    want = dict(zip(names, direct.run(None, first)))
    for n in names:
        np.testing.assert_allclose(got[n], want[n], atol=1e-5, rtol=1e-4, err_msg=n)
    # the next step: the client feeds present back as past
    token = got["logits"][:, -1].argmax(-1).reshape(1, 1)
    step = {roles.input_ids: token, roles.attention_mask: np.ones((1, 6), np.int64),
            roles.position_ids: np.array([[5]]),
            **{p: got[q] for p, q in roles.past_to_present.items()}}
    got2, want2 = _infer(server, step), dict(zip(names, direct.run(None, step)))
    for n in names:
        np.testing.assert_allclose(got2[n], want2[n], atol=1e-5, rtol=1e-4, err_msg=n)


def test_serve_checks_the_past_against_the_mask(served):
    server, src = served
    roles = cache_record(load_model(src))
    step = dict(decode_feeds(roles, batch=1, past=4, seq=1, vocab_size=1003).arrays)
    step = {k: (v.astype(np.float32) if v.dtype.kind == "f" else v) for k, v in step.items()}
    assert _infer(server, step)["logits"].shape == (1, 1, 1003)
    bad = [({roles.attention_mask: np.ones((1, 4), np.int64)}, "past + seq"),
           ({"past_key_values.1.value": np.zeros((1, 1, 3, 80), np.float32)},
            "disagree on the cache length"),
           ({"past_key_values.0.key": np.zeros((1, 1, 4, 128), np.float32)},
            "Expected [-1,1,-1,80]")]
    for change, message in bad:
        with pytest.raises(InferenceServerException) as e:
            _infer(server, {**step, **change})
        assert "INVALID_ARG" in str(e.value.status()) and message in e.value.message(), (
            change.keys(), e.value.message())


@pytest.mark.venv(*optimum.VENV)  # the export is cached; its environment built beside the tests
def test_a_clients_past_is_checked_at_the_keys_and_the_values_own_widths():
    """DeepSeek-V3 (multi-head latent attention) caches keys 24 wide and values 16: each
    past is checked at its own width, and a value of the keys' width is refused naming the
    values' head dim."""
    from serving.errors import InvalidArgument
    from serving.kv import check_cache_feeds

    record = cache_record(load_model(optimum.cached("deepseek_v3")))
    step = dict(decode_feeds(record, batch=1, past=4, seq=1, vocab_size=1003).arrays)
    check_cache_feeds(record, step, "deepseek")
    wrong = {**step, "past_key_values.1.value": np.zeros((1, 4, 4, 24), np.float32)}
    with pytest.raises(InvalidArgument, match="has 24 on axis 3, but the values' head dim is 16"):
        check_cache_feeds(record, wrong, "deepseek")


def test_serve_a_widened_cache_the_client_feeds_wide(tmp_path):
    """widen: the server gates the variant through its record (zeros in the new entries),
    then the client feeds the wider past; logits equal the original's."""
    from tuner.gate.kv_gate import widen_feeds
    from tuner.graph.kv_cache import widened_cache

    src = _src("gpt2", "torchscript")
    padded = tmp_path / "wide.onnx"
    pad_file(src, padded, PadRequest.from_multiples(inspect_model(load_model(src)), head_dim=128,
                                                    cache_policy="widen"))
    server = Server(make_artifact(tmp_path / "out", src, variant=padded),
                    ServerOptions(port=0, metrics_port=0, engine=EngineOptions()),
                    say=lambda line: None)
    server.start()
    try:
        assert server.wait_ready(120) and server.slot.engine.model.served == "padded"
        roles = cache_record(load_model(src))
        step = decode_feeds(roles, batch=1, past=3, seq=1, vocab_size=50257)
        wide = dict(widen_feeds(step, widened_cache(load_model(padded))).arrays)
        got = _infer(server, wide)
        assert got["present.0.key"].shape == (1, 2, 4, 128)
        direct = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
        want = direct.run(["logits"], dict(step.arrays))[0]
        np.testing.assert_allclose(got["logits"], want, atol=1e-4, rtol=1e-4)
        # the original width is refused, naming the width it expects
        with pytest.raises(InferenceServerException, match=re.escape("Expected [-1,2,-1,128]")):
            _infer(server, dict(step.arrays))
    finally:
        server.stop(5)


def test_serve_what_optimize_wrote(tmp_path):
    src = _src("llama", "torchscript")
    out = tmp_path / "out"
    assert main(["optimize", str(src), "-o", str(out), *FAST]) == 0
    server = Server(out, ServerOptions(port=0, metrics_port=0, engine=EngineOptions()),
                    say=lambda line: None)
    server.start()
    try:
        assert server.wait_ready(120), server.slot.status
        roles = cache_record(load_model(src))
        step = dict(decode_feeds(roles, batch=2, past=6, seq=1, vocab_size=1003).arrays)
        direct = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
        want = dict(zip([o.name for o in direct.get_outputs()], direct.run(None, step)))
        got = _infer(server, step)
        for name, w in want.items():
            np.testing.assert_allclose(got[name], w, atol=1e-5, rtol=1e-4, err_msg=name)
    finally:
        server.stop(5)
