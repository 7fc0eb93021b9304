"""Multi-head latent attention served: DeepSeek-V3's Optimum export caches keys 24 wide and
values 16 (tuner.graph.kv_cache's value_head_dim). Four streams of different lengths sent at
once share the engine's decode batch, and each is what a plain ONNX Runtime greedy loop over
the export gives it alone (the matrix's cell, tests/test_conformance.py, serves one)."""

from __future__ import annotations

import threading
import urllib.request

from models import optimum
from serving.generation import GenerateOptions
from serving.server import Server, ServerOptions
from tests.serving_support import make_artifact
from tests.test_conformance import _ort_greedy, _served_greedy
from tuner.artifact.records import Buckets
from tuner.graph.cache_record import find_cache_record
from tuner.graph.load import load_model

PROMPTS = ([5, 17, 301, 9, 42, 7], [3, 4], list(range(10, 40)), [99, 98, 97, 96, 95, 94])
NEW = 12


def test_streams_sent_together_each_equal_the_plain_loop(tmp_path) -> None:
    src = optimum.cached("deepseek_v3")
    record = find_cache_record(load_model(src))
    assert (record.head_dim, record.value_head_dim) == (24, 16)
    want = [_ort_greedy(src, p, NEW) for p in PROMPTS]
    out = make_artifact(tmp_path / "art", src, Buckets(batch=(1, 2, 4), seq=(16, 64)))
    server = Server(out, ServerOptions(port=0, http_port=None, metrics_port=0,
                                       generate=GenerateOptions(max_tokens=64)))
    server.start()
    try:
        assert server.wait_ready(120), server.slot.status
        got: list = [None] * len(PROMPTS)

        def one(i: int) -> None:
            got[i] = _served_greedy(server, PROMPTS[i], NEW)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert got == want
        # some steps ran more than one row: the streams shared the decode batch
        assert _metric(server, 'tuner_batch_size_count') > _metric(
            server, 'tuner_batch_size_bucket{le="1.0"')
    finally:
        server.stop(5)


def _metric(server: Server, prefix: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                  timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix))
