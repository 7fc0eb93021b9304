"""ONNX Runtime on the CPU execution provider: the backend that always works."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Mapping

import ml_dtypes
import numpy as np

from tuner.errors import BadInput
from tuner.graph.io import model_bytes
from tuner.runtime.backend import Backend
from tuner.runtime.base import Runner, SessionSettings

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


_BF16 = np.dtype(ml_dtypes.bfloat16)
_ONNX_BF16 = 16  # onnx.TensorProto.BFLOAT16


def _to_ort_value(arr: np.ndarray):
    """An OrtValue for one input; bfloat16 (ml_dtypes) goes in as its raw 16 bits, which
    onnxruntime's numpy binding cannot convert itself."""
    import onnxruntime as ort

    arr = np.ascontiguousarray(arr)
    if arr.dtype == _BF16:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(arr.view(np.uint16), _ONNX_BF16)
    return ort.OrtValue.ortvalue_from_numpy(arr)


def _from_ort_value(value) -> np.ndarray:
    """numpy for one output; a bfloat16 tensor is copied out bit for bit as ml_dtypes."""
    if value.data_type() != "tensor(bfloat16)":
        return value.numpy()
    shape = tuple(value.shape())
    count = int(np.prod(shape)) if shape else 1
    raw = (ctypes.c_uint16 * count).from_address(value.data_ptr()) if count else []
    return np.array(raw, dtype=np.uint16).reshape(shape).view(_BF16)


class OrtRunner:
    """Runs an onnxruntime InferenceSession (any execution provider). bfloat16 inputs and
    outputs are fed and read as bfloat16 (through OrtValues), never as float32."""

    def __init__(self, session, name: str = "ort-cpu") -> None:
        self.session = session
        self.name = name
        self.output_names = [o.name for o in session.get_outputs()]
        self._bf16 = any(o.type == "tensor(bfloat16)" for o in session.get_outputs()) or any(
            i.type == "tensor(bfloat16)" for i in session.get_inputs())
        self._binding = None  # infer_into's: (names, IOBinding, what is bound, arrays kept)

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._bf16 or any(np.asarray(a).dtype == _BF16 for a in feeds.values()):
            values = {k: _to_ort_value(np.asarray(v)) for k, v in feeds.items()}
            outs = self.session.run_with_ort_values(self.output_names, values)
            return {n: _from_ort_value(o) for n, o in zip(self.output_names, outs)}
        outs = self.session.run(self.output_names, dict(feeds))
        return dict(zip(self.output_names, outs))

    @property
    def writes_into(self) -> bool:
        """Whether `infer_into` can write outputs into the caller's buffers (CPU memory)."""
        return self.name == "ort-cpu" and not self._bf16

    def infer_into(self, feeds: Mapping[str, np.ndarray],
                   into: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`infer`, with each output named in `into` written into that array (C-contiguous,
        its shape and dtype the output's) instead of a new one: IO binding. An output bound
        to an input's own memory is how GroupQueryAttention shares its past and present
        buffer (it then writes only the new entries). Returns the other outputs.

        One binding is kept while the names stay the same, and an array is bound again only
        where its address, shape or dtype changed: a decode step rebinds its new tokens and
        mask, not the dozens of cache buffers it runs in (binding them all anew cost ~0.2 ms
        a step, 2% of a batch-1 decode run of an 8-layer h-1024 Llama)."""
        names = (tuple(feeds), tuple(into))
        if self._binding is None or self._binding[0] != names:
            self._binding = (names, self.session.io_binding(), {}, {})
        _, binding, bound, kept = self._binding
        for name, arr in feeds.items():
            arr = np.ascontiguousarray(arr)
            kept[name] = arr  # alive while bound
            if bound.get(name) != (arr.ctypes.data, arr.shape, arr.dtype):
                binding.bind_input(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
                bound[name] = (arr.ctypes.data, arr.shape, arr.dtype)
        for name, arr in into.items():
            if not arr.flags.c_contiguous:
                raise ValueError(f"output {name} must be written into a C-contiguous array")
            kept["out " + name] = arr
            if bound.get("out " + name) != (arr.ctypes.data, arr.shape, arr.dtype):
                binding.bind_output(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
                bound["out " + name] = (arr.ctypes.data, arr.shape, arr.dtype)
        rest = [n for n in self.output_names if n not in into]
        for name in rest:  # bound to the device alone, every run: ONNX Runtime allocates it
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        outs = binding.get_outputs()[len(into):]  # in the order first bound: `into` first
        return {n: o.numpy() for n, o in zip(rest, outs)}

    def close(self) -> None:
        self.session = self._binding = None  # the binding holds the session too


def _ort_cpu_check() -> str | None:
    try:
        import onnxruntime  # noqa: F401
    except ImportError as e:  # pragma: no cover - a dependency of the package
        return f"onnxruntime is not importable ({e})"
    return None


def _ort_cpu_load(path: Path, settings: SessionSettings, shapes, cache_dir) -> Runner:
    return OrtRunner(load_cpu(path, settings), name="ort-cpu")


CPU_BACKEND = Backend("ort-cpu", "ONNX Runtime, CPU execution provider", _ort_cpu_check,
                      _ort_cpu_load)
