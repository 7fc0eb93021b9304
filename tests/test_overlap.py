"""serving.overlap: a lone request runs on every thread, requests that overlap each on a
one-thread session of their own; the server turns it on by default for a small CPU model
(`--workers` unset) and off when told how many runs to allow. Real ONNX Runtime sessions,
real gRPC."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import tritonclient.grpc as tg
from serving_support import feeds_for, infer_inputs, make_artifact

from serving.engine import EngineOptions
from serving.model import load_artifact
from serving.overlap import OVERLAP_MAX_BYTES, OverlapRunner, overlap_wanted
from serving.server import Server, ServerOptions
from tuner.runtime.base import SessionSettings
from tuner.runtime.ort import OrtRunner, load_cpu

TWO = SessionSettings(intra_op_threads=2)


def test_overlap_is_wanted_for_a_small_cpu_model_on_several_threads_only():
    assert overlap_wanted("ort-cpu", TWO, 10 << 20)
    assert not overlap_wanted("ort-cpu", SessionSettings(intra_op_threads=1), 10 << 20)
    assert not overlap_wanted("ort-cpu", TWO, OVERLAP_MAX_BYTES + 1)
    assert not overlap_wanted("ort-cuda", TWO, 10 << 20)
    assert not overlap_wanted("ort-cpu", TWO, 0)  # size unknown: one session


def _runner(model) -> OverlapRunner:
    full = OrtRunner(load_cpu(model, TWO))
    single = OrtRunner(load_cpu(model, SessionSettings(intra_op_threads=1)))
    return OverlapRunner(full, single, workers=2)


def test_lone_runs_take_every_thread_and_overlapping_ones_one_each(reference_model):
    model = reference_model("bert", "small", "torchscript")
    runner = _runner(model)
    feeds = feeds_for(32)
    alone = runner.infer(feeds)
    for _ in range(9):
        runner.infer(feeds)
    assert runner.runs == {"full": 10, "single": 0}  # one after another: never overlapping

    start = threading.Barrier(4)
    outs = []

    def client():
        start.wait()
        for _ in range(25):
            outs.append(runner.infer(feeds))

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert runner.runs["single"] > 0 and runner.runs["full"] > 10
    assert runner.runs["full"] + runner.runs["single"] == 110
    for out in outs:  # the same graph on one thread answers what it answers on two
        np.testing.assert_allclose(out["last_hidden_state"], alone["last_hidden_state"],
                                   atol=1e-5, rtol=1e-5)


def _config_count(server: Server) -> int:
    client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    config = client.get_model_config(server.slot.name, as_json=True)["config"]
    return int(config["instance_group"][0]["count"])


@pytest.mark.parametrize("workers", [None, 1])
def test_the_server_overlaps_by_default_and_not_when_told(reference_model, tmp_path, workers):
    model = reference_model("bert", "small", "torchscript")
    out = make_artifact(tmp_path / "art", model, settings={"intra_op_threads": 2})
    server = Server(out, ServerOptions(port=0, metrics_port=0,
                                       engine=EngineOptions(workers=workers)),
                    say=lambda line: None)
    server.start()
    try:
        assert server.wait_ready(120), server.slot.status
        engine = server.slot.engine
        client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
        feeds = feeds_for(16)
        want = load_artifact(out).runner.infer(feeds)["last_hidden_state"]
        got = client.infer(server.slot.name, infer_inputs(feeds)).as_numpy("last_hidden_state")
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        if workers is None:  # requests that meet overlap; none is joined into a batch
            assert isinstance(engine.model.runner, OverlapRunner)
            assert engine.workers == 2 and _config_count(server) == 2
            assert engine.join_rows == 1 and "side by side" in engine.batch_note
        else:  # one run at a time: the artifact's timings decide (it has none: batch)
            assert not isinstance(engine.model.runner, OverlapRunner)
            assert engine.workers == 1 and _config_count(server) == 1
            assert engine.join_rows == max(engine.model.buckets.batch) > 1
    finally:
        server.stop(5)


def test_a_decoder_is_never_loaded_twice(reference_model, tmp_path):
    model = reference_model("llama-kv", "awkward", "torchscript")
    out = make_artifact(tmp_path / "art", model, settings={"intra_op_threads": 2})
    assert not isinstance(load_artifact(out, overlap=True).runner, OverlapRunner)


def test_one_thread_settings_keep_one_session(reference_model, tmp_path):
    model = reference_model("bert", "small", "torchscript")
    out = make_artifact(tmp_path / "art", model, settings={"intra_op_threads": 1})
    assert not isinstance(load_artifact(out, overlap=True).runner, OverlapRunner)
    assert os.cpu_count()  # the default (0 threads) means every core: overlap_wanted's rule
