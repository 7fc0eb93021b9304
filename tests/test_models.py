"""The reference exports are faithful: ONNX Runtime on the exported graph gives what the torch
model gives, at batch and sequence sizes other than the ones traced and with padded masks.
Everything else (inspect, the rewrites' exactness) is measured against these graphs.

Every reference export is checked: each family and shape (the twelve of test_families.py and
the real MiniLM included), both exporters. The "<family>-kv" exports (with their cache) are
checked against transformers' own cache, step by step, in tests/test_models_kv.py.
gpt2/gpt2-small, the optimize benchmark's subject, is the same builder at 12 layers."""

from __future__ import annotations

import numpy as np
import pytest

from models.build import EXPORTERS, SPECS, _Wrapper, build_torch_model, spec


CASES = [(n, shape, e) for (n, shape), s in sorted(SPECS.items())
         if not s.cache and shape != "gpt2-small" for e in EXPORTERS]


@pytest.mark.parametrize("name,shape,exporter", CASES, ids=[f"{n}-{s}-{e}" for n, s, e in CASES])
def test_export_matches_torch_on_new_shapes_and_padding(reference_model, name, shape, exporter):
    import onnxruntime as ort
    import torch

    s = spec(name, shape)
    model = _Wrapper(build_torch_model(s), s.decoder)
    vocab = model.model.config.vocab_size
    session = ort.InferenceSession(str(reference_model(name, shape, exporter)),
                                   providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for batch, seq in [(1, 7), (3, 20)]:  # the export traced (2, 16)
        ids = rng.integers(0, vocab, (batch, seq))
        mask = np.ones((batch, seq), dtype=np.int64)
        if batch > 1:
            mask[1, seq // 2:] = 0  # right padding
            mask[2, :3] = 0  # left padding
        out = session.run(None, {"input_ids": ids, "attention_mask": mask})[0]
        with torch.no_grad():
            ref = model(torch.tensor(ids), torch.tensor(mask)).numpy()
        assert out.shape == ref.shape
        keep = mask.astype(bool)  # padded positions are don't-care
        np.testing.assert_allclose(out[keep], ref[keep], atol=1e-4, rtol=1e-3)


def test_unknown_reference_model_names_the_known_ones():
    with pytest.raises(KeyError, match="known: .*gpt2/small"):
        spec("gpt5", "small")
