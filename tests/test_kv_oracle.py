"""Padded KV-cache variants checked by an oracle that is not the gate: `tuner pad` writes the
variant (its own gate passed), then a plain ONNX Runtime greedy loop written for the tests
(tests/greedy_loops.py) decodes with the original and with the variant, each fed its own
presents, and the tokens must be identical and the logits equal at every step. For `widen` the
variant is fed its own wider, empty past: the rewrite's record of where the original entries
sit is not used, so a wrong record cannot hide a wrong rewrite. Each case has its liar: the
variant with its token embedding scaled is told apart by the same loop."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from greedy_loops import CacheRun, greedy_cache

from models.build import cached
from models.prompts import text_prompts
from tuner.graph.inspect import inspect_model
from tuner.graph.lm_head import token_embedding
from tuner.graph.load import load_model
from tuner.jobs.pad import pad_file
from tuner.rewrite.compose import PadRequest

STEPS = 8  # with a 7-token prompt, 15 positions: past Mistral's sliding window of 8
# each family with both exporters across the two policies
CASES = [("gpt2", "keep", "torchscript"), ("gpt2", "widen", "dynamo"),
         ("llama", "keep", "dynamo"), ("llama", "widen", "torchscript"),
         ("gpt_neox", "keep", "torchscript"), ("gpt_neox", "widen", "dynamo"),
         ("mistral", "keep", "dynamo"), ("mistral", "widen", "torchscript")]


def _session(path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _batch(vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Two rows of real text, the second left-padded by 3 (as generate() batches prompts)."""
    first, second = text_prompts(vocab, 2)
    ids = np.stack([first[:7], np.concatenate([np.zeros(3, np.int64), second[:4]])])  # (2, 7)
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


def _differences(want: CacheRun, got: CacheRun) -> list[str]:
    """What differs between two runs, step by step (empty: the same decoding)."""
    problems = []
    for step, (w, g, keep) in enumerate(zip(want.logits, got.logits, want.masks)):
        keep = keep.astype(bool)  # (B, S): padded query positions are don't-care
        if w.shape != g.shape:
            return [f"step {step}: logits shape {g.shape} != {w.shape}"]
        if not np.allclose(g[keep], w[keep], atol=1e-4, rtol=1e-3):
            problems.append(f"step {step}: logits differ by {np.abs(g[keep] - w[keep]).max():.3g}")
    if not np.array_equal(want.tokens, got.tokens):
        problems.append(f"tokens {got.tokens.tolist()} != {want.tokens.tolist()}")
    return problems


@pytest.mark.parametrize("family,policy,exporter", CASES, ids=["-".join(c) for c in CASES])
def test_padded_cache_variant_decodes_like_the_original(family, policy, exporter, tmp_path):
    src = cached(f"{family}-kv", "awkward", exporter)
    shape = inspect_model(load_model(src))
    dst = tmp_path / "padded.onnx"
    pad_file(src, dst, PadRequest.from_multiples(shape, vocab_multiple=64, ffn_multiple=64,
                                                 head_dim=128, cache_policy=policy))
    ids, mask = _batch(shape.vocab_size)
    want = greedy_cache(_session(src), ids, STEPS, mask)
    got = greedy_cache(_session(dst), ids, STEPS, mask)
    widths = {o.name: o.shape[3] for o in _session(dst).get_outputs() if o.name != "logits"}
    assert set(widths.values()) == {shape.head_dim if policy == "keep" else 128}
    assert _differences(want, got) == []
    assert len(set(want.tokens.ravel().tolist())) >= 4  # the tokens say something
    if policy == "keep":  # the client-visible cache is the original's, entry for entry
        for name, value in want.present.items():
            np.testing.assert_allclose(got.present[name], value, atol=1e-4, rtol=1e-3)

    model = load_model(dst)  # the liar: the same variant with its embedding scaled
    weight = token_embedding(model.graph).weight
    weight.const_value = ir.tensor(weight.const_value.numpy() * 3)
    liar = tmp_path / "liar.onnx"
    ir.save(model, str(liar))
    assert _differences(want, greedy_cache(_session(liar), ids, STEPS, mask))
