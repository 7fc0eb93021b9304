"""ONNX Runtime on the CPU execution provider: the backend that always works."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import numpy as np

from tuner.runtime.base import SessionSettings

_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC",
           "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}


def session_options(settings: SessionSettings):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = settings.intra_op_threads
    so.inter_op_num_threads = settings.inter_op_threads
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _LEVELS[settings.graph_optimization])
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if settings.allow_spinning else "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "1" if settings.allow_spinning else "0")
    so.log_severity_level = 3  # errors only: ORT's warnings about unused initializers are noise here
    return so


BIG_MODEL_BYTES = 1 << 30  # past this, sessions trade arena speed for memory (big_model_options)


def big_model_options(so, model_bytes: int):
    """For a model past BIG_MODEL_BYTES: no CPU memory arena and no memory pattern, so that
    activation buffers go back to the system when freed instead of staying reserved at their
    high-water mark (which grows with batch x seq), and the environment's shared allocators
    where one is registered (a no-op otherwise). At the gate's small feeds the weights
    dominate: `tuner verify` on an 8-layer Pythia-2.8B slice (3.55 GB, bench/big_model.py)
    peaked at 4.42 GB with and without these. A small model keeps ORT's defaults, which its
    latencies were measured with."""
    if model_bytes > BIG_MODEL_BYTES:
        so.enable_cpu_mem_arena = False
        so.enable_mem_pattern = False
        so.add_session_config_entry("session.use_env_allocators", "1")
    return so


def _size_or_zero(path: str) -> int:
    """The model's bytes, or 0 when the file cannot be read as ONNX: ONNX Runtime's own
    error then says why, as it did before sizes were read."""
    from tuner.errors import BadInput
    from tuner.graph.size import model_bytes

    try:
        return model_bytes(path)
    except (BadInput, OSError):
        return 0


def load_cpu(model: str | os.PathLike | bytes, settings: SessionSettings = SessionSettings()):
    """An InferenceSession on the CPU EP. `model` is a path (external data beside it) or bytes."""
    import onnxruntime as ort

    so = session_options(settings)
    if isinstance(model, bytes):
        src = model
    else:
        src = str(Path(model))
        big_model_options(so, _size_or_zero(src))
    return ort.InferenceSession(src, sess_options=so, providers=["CPUExecutionProvider"])


class OrtRunner:
    """Runs an onnxruntime InferenceSession (any execution provider)."""

    def __init__(self, session, name: str = "ort-cpu") -> None:
        self.session = session
        self.name = name
        self.output_names = [o.name for o in session.get_outputs()]

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        outs = self.session.run(self.output_names, dict(feeds))
        return dict(zip(self.output_names, outs))
