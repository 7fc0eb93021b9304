"""Smoke runs of bench/soak.py (a few seconds each): every kind of model the server serves
under every kind of client at once, each answer equal to the idle server's; and a server
whose answers change with the rows beside them (a graph quantized with one activation
range per run, batched anyway with --allow-batch-variance) fails it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.serving_support import quantize_dynamic_copy
from tests.test_http_bench import ROOT, _run

sys.path.insert(0, str(ROOT / "bench"))  # the bench's own artifacts (serve_common)

COMMON = {"decoder": ("greedy, checked (openai)", "stream cancelled or read (tritonclient.grpc)",
                      "/v1/messages streamed"),
          "embedding": ("embeddings, float, checked (openai)", "TEI /embed, checked (http)",
                        "infer, checked (tritonclient.http)"),
          "reranker": ("rerank (", "TEI /rerank, checked", "/score, checked"),
          "classifier": ("/classify, checked", "KServe V1 predict, checked",
                         "TEI /predict, texts and pairs, checked"),
          "whisper": ("transcribe, greedy, checked (openai)",
                      "bls, greedy, checked (tritonclient.grpc, Triton's Whisper names)")}


def _soak(*args: str, code: int = 0) -> tuple[str, int, int]:
    """bench/soak.py's output, and how many of its checked answers equalled the idle
    server's, of how many."""
    out = _run("soak.py", "--clients", "4", *args, code=code)
    checked = re.search(r"equal to the idle server's answer: (\d+) of (\d+)", out)
    assert checked, out
    return out, int(checked[1]), int(checked[2])


@pytest.mark.parametrize("model", sorted(COMMON))
def test_every_client_of_every_kind_gets_the_idle_servers_answers(model) -> None:
    out, equal, checked = _soak("--seconds", "3" if model == "decoder" else "2",
                                "--model", model)
    for row in (*COMMON[model], "malformed"):
        assert f"| {row}" in out, out
    assert "client errors: 0" in out and "answers as before: yes" in out, out
    assert "0 streams running, 0 queued" in out and equal == checked > 0, out


def _quantized(source: Path, tmp_path: Path) -> Path:
    return quantize_dynamic_copy(source, tmp_path / "q.onnx")


def test_a_decoder_whose_streams_change_with_their_batch_fails(reference_model,
                                                                tmp_path) -> None:
    from serve_common import decoder_artifact

    art = decoder_artifact(tmp_path, _quantized(
        reference_model("llama-kv", "awkward", "torchscript"), tmp_path))
    _, equal, checked = _soak("--seconds", "3", "--artifact", str(art),
                              "--serve-args=--allow-batch-variance", code=1)
    assert equal < checked


def test_an_embedding_model_whose_vectors_change_with_their_batch_fails(tmp_path) -> None:
    from models.build import cached
    from serve_common import embedding_artifact

    art = embedding_artifact(tmp_path, _quantized(cached("minilm", "real", "torchscript"),
                                                  tmp_path))
    _, equal, checked = _soak("--seconds", "3", "--artifact", str(art),
                              "--serve-args=--max-batch 4 --allow-batch-variance", code=1)
    assert equal < checked
