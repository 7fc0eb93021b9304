"""The KV-cache reference exports (models/kv.py) are faithful: ONNX Runtime runs the prefill
with past length 0, then greedy decode steps fed their own `present` as `past`, and every
step's logits equal the transformers model's own (with its own cache), and the greedy tokens
equal `generate(do_sample=False)` on the same weights."""

from __future__ import annotations

import numpy as np
import pytest

from models.build import EXPORTERS, KV_FAMILIES, build_torch_model, cached, spec
from models.kv import head_dim_of, io_names, kv_heads_of

PROMPT, STEPS = 6, 4  # mistral's sliding window is 8: prompt + steps runs past it


def _session(family: str, exporter: str):
    import onnxruntime as ort

    path = cached(f"{family}-kv", "awkward", exporter)
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _positions(mask: np.ndarray) -> np.ndarray:
    """Position ids from a mask, as ONNX Runtime's HF integration and generate() derive them:
    count kept tokens; padded slots get 1 (any value: the mask hides them)."""
    pos = mask.cumsum(-1) - 1
    return np.where(mask == 0, 1, pos)  # (B, P + S)


def _ort_greedy(session, config, ids: np.ndarray, steps: int,
                mask: np.ndarray | None = None) -> tuple[list[np.ndarray], np.ndarray]:
    """Prefill (past 0) + `steps` decode steps; per-step last-position logits and all tokens."""
    batch, seq = ids.shape
    inputs, outputs = io_names(config.num_hidden_layers)
    empty = np.zeros((batch, kv_heads_of(config), 0, head_dim_of(config)), np.float32)
    past = {name: empty for name in inputs[3:]}  # (B, kv_heads, 0, d)
    mask = np.ones_like(ids) if mask is None else mask
    tokens, step_ids, length, logits = ids, ids, 0, []
    for _ in range(steps + 1):
        s = step_ids.shape[1]
        feeds = {"input_ids": step_ids, "attention_mask": mask,  # (B, P + S)
                 "position_ids": _positions(mask)[:, length:], **past}  # (B, S)
        out = dict(zip(outputs, session.run(outputs, feeds)))
        logits.append(out["logits"][:, -1])  # (B, vocab)
        length += s
        past = {i: out[o] for i, o in zip(inputs[3:], outputs[1:])}
        for name in outputs[1:]:
            assert out[name].shape[2] == length, name  # present is past + seq long
        step_ids = logits[-1].argmax(-1)[:, None]  # (B, 1)
        tokens = np.concatenate([tokens, step_ids], axis=1)
        mask = np.concatenate([mask, np.ones_like(step_ids)], axis=1)
    return logits, tokens[:, :seq + steps + 1]


def _torch_greedy(model, ids: np.ndarray, steps: int,
                  mask: np.ndarray | None = None) -> list[np.ndarray]:
    """The same loop through transformers itself: its own cache object (sliding-window layers
    for Mistral), the same masks and positions."""
    import torch

    mask = np.ones_like(ids) if mask is None else mask
    logits, cache, step, length = [], None, torch.tensor(ids), 0
    with torch.no_grad():
        for _ in range(steps + 1):
            pos = torch.tensor(_positions(mask)[:, length:])
            out = model(input_ids=step, attention_mask=torch.tensor(mask), position_ids=pos,
                        cache=cache, use_cache=True)
            cache, length = out.cache, length + step.shape[1]
            logits.append(out.logits[:, -1].numpy())
            step = out.logits[:, -1].argmax(-1, keepdim=True)
            mask = np.concatenate([mask, np.ones_like(step.numpy())], axis=1)
    return logits


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("family", KV_FAMILIES)
def test_greedy_decode_with_cache_matches_transformers(family, exporter):
    import torch

    model = build_torch_model(spec(f"{family}-kv", "awkward"))
    config = model.config
    ids = np.random.default_rng(3).integers(0, config.vocab_size, (2, PROMPT))
    got, tokens = _ort_greedy(_session(family, exporter), config, ids, STEPS)
    want = _torch_greedy(model, ids, STEPS)
    for step, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-3, err_msg=f"step {step}")
    model.generation_config.eos_token_id = None  # random weights: never stop early
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        ref = model.generate(torch.tensor(ids), attention_mask=torch.ones_like(torch.tensor(ids)),
                             do_sample=False, max_new_tokens=STEPS + 1)
    np.testing.assert_array_equal(tokens, ref.numpy())


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_left_padded_batch_decodes_like_transformers(family, exporter):
    """A batch whose second row is left-padded: the mask runs over past + seq, positions come
    from the mask, and each step still equals transformers' own."""
    model = build_torch_model(spec(f"{family}-kv", "awkward"))
    ids = np.random.default_rng(4).integers(0, model.config.vocab_size, (2, PROMPT))
    mask = np.ones_like(ids)
    mask[1, :2] = 0
    got, _ = _ort_greedy(_session(family, exporter), model.config, ids, 2, mask)
    want = _torch_greedy(model, ids, 2, mask)
    for step, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-3, err_msg=f"step {step}")


def _dims(value) -> list[str | int]:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("family", KV_FAMILIES)
def test_io_names_and_symbolic_axes(family, exporter):
    import onnx

    s = spec(f"{family}-kv", "awkward")
    graph = onnx.load(str(cached(f"{family}-kv", "awkward", exporter)), load_external_data=False).graph
    layers, kv, d = s.expect["num_layers"], s.expect["num_kv_heads"], s.expect["head_dim"]
    inputs, outputs = io_names(layers)
    assert [v.name for v in graph.input] == inputs
    assert [v.name for v in graph.output] == outputs
    dims = {v.name: _dims(v) for v in [*graph.input, *graph.output]}
    batch, seq = dims["input_ids"]
    past = dims[inputs[3]][2]
    total = dims[outputs[1]][2]
    assert all(isinstance(x, str) for x in (batch, seq, past, total))
    assert len({batch, seq, past, total}) == 4  # four different symbols
    assert dims["attention_mask"] == [batch, total]
    assert dims["position_ids"] == [batch, seq]
    assert dims["logits"] == [batch, seq, s.expect["vocab_size"]]
    for name in inputs[3:]:
        assert dims[name] == [batch, kv, past, d], name
    for name in outputs[1:]:
        assert dims[name] == [batch, kv, total, d], name
