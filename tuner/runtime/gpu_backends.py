"""The GPU backends (ort-cuda, ort-cuda-fp16, ort-trt, trt, trt-fp16); tuner.runtime.registry
lists them after the CPU.

Nothing GPU-specific is imported here: each backend's check says, cheaply and once per
process, why it cannot run on this machine, and its loader imports its runtime only when
called. On a machine without an NVIDIA GPU every check answers "no NVIDIA GPU found (...)".
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from tuner.runtime.backend import Backend
from tuner.runtime.base import Runner, SessionSettings
from tuner.runtime.gpu import CUDA_EP, TRT_EP, ep_reason, gpu_reason
from tuner.runtime.ort_gpu import load_ort_cuda
from tuner.runtime.ort_trt import load_ort_trt
from tuner.runtime.trt import load_trt, trt_reason


def _ort_cuda_check() -> str | None:
    return ep_reason(CUDA_EP)


def _ort_trt_check() -> str | None:
    return ep_reason(TRT_EP)


def _trt_check() -> str | None:

    reasons = [r for r in (gpu_reason(), trt_reason()) if r]
    if reasons:
        return "; ".join(reasons)
    # device buffers are ONNX Runtime CUDA OrtValues: the CUDA EP has to load
    return ep_reason(CUDA_EP)


def _ort_cuda(fp16: bool):
    def load(path: Path, settings: SessionSettings, shapes: Sequence[tuple[int, int]] | None,
             cache_dir: Path | None) -> Runner:

        return load_ort_cuda(path, settings, shapes, cache_dir, fp16=fp16)
    return load


def _ort_trt(path: Path, settings: SessionSettings, shapes: Sequence[tuple[int, int]] | None,
             cache_dir: Path | None) -> Runner:

    return load_ort_trt(path, settings, shapes, cache_dir)


def _trt(fp16: bool):
    def load(path: Path, settings: SessionSettings, shapes: Sequence[tuple[int, int]] | None,
             cache_dir: Path | None) -> Runner:

        return load_trt(path, settings, shapes, cache_dir, fp16=fp16)
    return load


GPU_BACKENDS = (
    Backend("ort-cuda", "ONNX Runtime, CUDA execution provider (IO binding, CUDA graphs per "
            "bucket)", _ort_cuda_check, _ort_cuda(False)),
    Backend("ort-cuda-fp16", "ONNX Runtime, CUDA execution provider, fp16 copy of the variant",
            _ort_cuda_check, _ort_cuda(True), precision="fp16"),
    Backend("ort-trt", "ONNX Runtime, TensorRT execution provider (a profile per bucket)",
            _ort_trt_check, _ort_trt),
    Backend("trt", "TensorRT (one engine, a profile per bucket, saved in the artifact)",
            _trt_check, _trt(False)),
    Backend("trt-fp16", "TensorRT on the fp16 copy of the variant", _trt_check, _trt(True),
            precision="fp16"),
)
