"""Shared fixtures: reference models are exported once and cached (models/build.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

FAMILIES = ("gpt2", "bert", "llama")
EXPORTERS = ("torchscript", "dynamo")


@pytest.fixture(scope="session")
def reference_model():
    """reference_model(name, shape="small", exporter="torchscript") -> Path of the cached export."""
    from models.build import cached

    def get(name: str, shape: str = "small", exporter: str = "torchscript") -> Path:
        return cached(name, shape, exporter)

    return get


@pytest.fixture(scope="session")
def llama_opset23():
    """Llama exported by dynamo at opset 23: torch writes ONNX's own Attention and
    RotaryEmbedding ops. Cached beside the reference models (built once, ~10 s)."""
    import torch

    from models.build import SEED, _cache_dir, _spec_key, _Wrapper, build_torch_model, spec

    path = _cache_dir() / f"llama-small-dynamo23-{_spec_key('llama', 'small', 'dynamo')}.onnx"
    if not path.exists():
        model = _Wrapper(build_torch_model(spec("llama", "small")), True)
        g = torch.Generator().manual_seed(SEED)
        ids = torch.randint(0, 1024, (2, 16), generator=g)
        batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("sequence", min=2, max=256)
        program = torch.onnx.export(
            model, (ids, torch.ones(2, 16, dtype=torch.int64)), dynamo=True, opset_version=23,
            input_names=["input_ids", "attention_mask"], output_names=["logits"],
            dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}})
        tmp = path.with_suffix(".tmp")
        program.save(str(tmp), external_data=False)
        tmp.replace(path)
    return path
