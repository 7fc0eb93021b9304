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
                      "bls, greedy, checked (tritonclient.grpc, Triton's Whisper names)"),
          "sparse": ("TEI /embed_sparse (sparse), checked", "TEI / (sparse), checked"),
          "tagger": ("POST / (token classification), checked",
                     "token_classification, checked (huggingface_hub)"),
          "masked-lm": ("POST / (fill-mask), checked", "fill_mask, checked (huggingface_hub)")}


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


def test_an_answer_per_token_unlike_the_idle_servers_is_told_apart() -> None:
    """The soak's checks of sparse vectors, entities and fills (bench/soak_tokens.py) see a
    value moved past 1e-5, an entry, a word or a token changed, a fill left out."""
    from soak_tokens import FillMaskClients, SparseClients, TaggerClients

    sparse = {3: 0.5, 7: 1.25}
    assert SparseClients.same(sparse, dict(sparse))
    assert SparseClients.same({**sparse, 9: 1e-7}, sparse)  # an entry at the edge of zero
    assert not SparseClients.same({**sparse, 7: 1.2501}, sparse)
    assert not SparseClients.same({3: 0.5, 8: 1.25}, sparse)
    entity = {"entity_group": "LOC", "word": "paris", "start": 0, "end": 5, "score": 0.9}
    assert TaggerClients.same([{**entity, "entity_group": None, "entity": "LOC"}], [entity])
    for changed in ({"score": 0.9001}, {"word": "pari"}, {"end": 4}, {"entity_group": "PER"}):
        assert not TaggerClients.same([{**entity, **changed}], [entity])
    assert not TaggerClients.same([], [entity])
    fills = [{"token": t, "token_str": str(t), "sequence": f"a {t}", "score": 1 / t}
             for t in (2, 3, 4)]
    assert FillMaskClients.same(fills[:2], fills)  # the first k of the top 5
    assert not FillMaskClients.same(fills[1:], fills)
    assert not FillMaskClients.same([{**fills[0], "score": 0.5001}], fills)
    assert not FillMaskClients.same([], fills)


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
