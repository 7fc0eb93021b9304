"""SIGTERM under load, with `tuner serve` as a real subprocess: every request the server had
accepted is answered, and correctly; calls after the signal are refused (UNAVAILABLE), never
left hanging; the process exits 0."""

from __future__ import annotations

import signal
import time

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as tg
from serving_support import (Answers, assert_close_where_valid, feeds_for, free_port, infer_inputs,
                             make_artifact, serve_process)
from tritonclient.utils import InferenceServerException


@pytest.fixture()
def served(reference_model, tmp_path):
    model = reference_model("bert", "small", "torchscript")
    out = make_artifact(tmp_path / "art", model)
    port = free_port()
    # A long queue delay and a batch limit above the load: every request below waits in the
    # server's queue for up to 3 s, so SIGTERM lands while all of them are in flight.
    proc = serve_process(out, port, "bert", "--max-batch", "64", "--max-queue-delay-ms", "3000")
    client = tg.InferenceServerClient(f"127.0.0.1:{port}")
    yield proc, client, model
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_sigterm_answers_every_accepted_request(served) -> None:
    proc, client, model = served
    rng = np.random.default_rng(3)
    requests = [feeds_for(int(rng.integers(2, 33)), seed=i) for i in range(40)]
    answers = Answers()
    results = answers.results
    for i, feeds in enumerate(requests):
        client.async_infer("bert", infer_inputs(feeds), answers.callback(i), client_timeout=60)
    time.sleep(0.5)  # all 40 are now queued in the server, waiting for a fuller batch
    assert not results, "requests were answered before the signal: the test proves nothing"
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    try:  # a call after the signal is refused, not accepted and dropped
        client.infer("bert", infer_inputs(feeds_for(4)), client_timeout=10)
        late = None
    except InferenceServerException as e:
        late = e
    answers.wait(len(requests), timeout=60)
    code = proc.wait(timeout=60)
    stderr = proc.stderr.read()
    assert code == 0, stderr
    assert late is not None and "UNAVAILABLE" in str(late.status()), late
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    for i, feeds in enumerate(requests):
        result = results[i]
        assert not isinstance(result, Exception), f"request {i} lost: {result}"
        assert_close_where_valid(result.as_numpy("last_hidden_state"),
                                 session.run(None, feeds)[0], feeds["attention_mask"],
                                 what=f"request {i}")
    assert "stopped after answering 40 inference request(s)" in stderr, stderr
