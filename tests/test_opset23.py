"""The families whose opset-23 exports differ most from their opset-18 ones (torch's dynamo
exporter writes ONNX's own Attention, RotaryEmbedding and RMSNormalization ops there):

- falcon: a grouped fused qkv whose k reaches the Attention op after repeat_kv, so the op
  shows the q heads' count for k (read from the projection's width instead);
- phi: a LayerNormalization over each head's keys between the projection and the cache;
- gemma3: the same norm as opset 23's RMSNormalization.

Each plain export (no cache) runs at batch 1 only in ONNX Runtime (tuner.graph.rotary_caches)
until `tuner rebatch` expands its rotary caches; each cache export's cache is found."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from models.build import DYNAMO_23, EXPORTERS, KV_MORE, _Wrapper, build_torch_model, cached, spec
from tuner.graph.inspect import inspect_path
from tuner.jobs.pad import pad_file
from tuner.jobs.rotary_batch import rebatch_file
from tuner.plan.findings import audited
from tuner.rewrite.compose import PadRequest

FAMILIES = KV_MORE


@pytest.mark.parametrize("family", FAMILIES)
def test_inspect_reads_the_config_back(family):
    expect = spec(family, "awkward").expect
    plain = inspect_path(cached(family, "awkward", DYNAMO_23))
    assert {k: getattr(plain, k) for k in expect} == expect
    assert len(plain.one_row_rotary) == 4 and plain.cache is None
    # its fused ops are padded through (the sweep: FFN, vocabulary and head dim, every family)
    assert "onnx-fused-ops" in {f.rule for f in audited(plain).findings}
    with_cache = inspect_path(cached(f"{family}-kv", "awkward", DYNAMO_23))
    assert {k: getattr(with_cache, k) for k in expect} == expect
    assert with_cache.cache is not None and with_cache.cache.num_layers == 2
    assert with_cache.one_row_rotary == ()  # positions fed per row


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_a_norm_over_the_keys_before_the_cache(exporter):
    """Phi's LayerNormalization sits between the k projection and the cache under every
    exporter (before: no cache found, and the decoder taken for one without)."""
    found = inspect_path(cached("phi-kv", "awkward", exporter))
    assert found.cache is not None and found.cache.num_layers == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_rebatched_equals_torch_on_a_padded_batch(family, tmp_path):
    import torch

    result, nodes = rebatch_file(cached(family, "awkward", DYNAMO_23), tmp_path / "m.onnx")
    assert result and nodes == 4
    g = np.random.default_rng(1)
    ids, mask = g.integers(0, 1003, (3, 11)), np.ones((3, 11), np.int64)
    mask[1, 7:], mask[2, :4] = 0, 0
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {"input_ids": ids, "attention_mask": mask})[0]
    model = _Wrapper(build_torch_model(spec(family, "awkward")), True)
    with torch.no_grad():
        want = model(torch.tensor(ids), torch.tensor(mask)).numpy()
    keep = mask.astype(bool)
    np.testing.assert_allclose(got[keep], want[keep], atol=1e-4, rtol=1e-3)


def test_falcon_head_dim_padded_through_the_attention_op(tmp_path):
    src = cached("falcon", "awkward", DYNAMO_23)
    result = pad_file(src, tmp_path / "m.onnx",
                      PadRequest.from_multiples(inspect_path(src), head_dim=32))
    assert result.transforms == ("head_dim 20->32",) and result.rebatched == 4
    assert result.accuracy and result.accuracy.outputs[0].compared > 0
