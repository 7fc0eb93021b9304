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
