"""`ort-trt`: ONNX Runtime's TensorRT execution provider (CUDA EP behind it for any node
TensorRT does not take), one optimisation profile per bucket.

Profiles go to the EP as `trt_profile_min_shapes` / `_opt_shapes` / `_max_shapes`: the same
input named once per profile ("input_ids:1x1,attention_mask:1x1,input_ids:1x1,...") makes
one profile per repetition. Engines are cached per variant under
`cache_dir/ort-trt/engines/<variant key>` and the timing cache is shared by every variant in
`cache_dir/ort-trt/timing`, so a second variant's build reuses the first one's kernel timings
and `tuner serve` on the artifact finds the engines already built.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from tuner.errors import BadInput
from tuner.graph.roles import input_specs
from tuner.runtime.base import SessionSettings
from tuner.runtime.gpu import (CUDA_EP, TRT_EP, ShapeRange, cache_key, check_buckets, profiles_for,
                               work_dir)
from tuner.runtime.ort_gpu import IoBindingRunner, dummy_feed, make_session


@dataclass(frozen=True)
class TrtEpOptions:
    device_id: int = 0
    workspace_bytes: int = 4 << 30
    builder_optimization_level: int = 3  # TensorRT's default; 5 searches longest

    def __post_init__(self) -> None:
        if self.device_id < 0:
            raise ValueError(f"device_id must be >= 0, not {self.device_id}")
        if self.workspace_bytes < (1 << 20):
            raise ValueError(f"workspace_bytes must be at least 1 MiB, not {self.workspace_bytes}")
        if not 0 <= self.builder_optimization_level <= 5:
            raise ValueError("builder_optimization_level must be 0..5, not "
                             f"{self.builder_optimization_level}")


def _dims(shape: Sequence[int]) -> str:
    return "x".join(str(int(d)) for d in shape)


def profile_shape_options(profiles: Sequence[Mapping[str, ShapeRange]]) -> dict[str, str]:
    """The three trt_profile_* strings for a list of profiles (one entry per input each)."""
    parts: dict[str, list[str]] = {"min": [], "opt": [], "max": []}
    for prof in profiles:
        for name, (lo, opt, hi) in prof.items():
            if ":" in name or "," in name:

                raise BadInput(f"input name {name!r} contains ':' or ',', which the TensorRT "
                               "EP's profile syntax cannot express; use the trt backend")
            parts["min"].append(f"{name}:{_dims(lo)}")
            parts["opt"].append(f"{name}:{_dims(opt)}")
            parts["max"].append(f"{name}:{_dims(hi)}")
    return {f"trt_profile_{k}_shapes": ",".join(v) for k, v in parts.items()}


def provider_options(engine_dir: Path, timing_dir: Path,
                     profiles: Sequence[Mapping[str, ShapeRange]],
                     options: TrtEpOptions = TrtEpOptions()) -> dict[str, str]:
    """The TensorRT EP's options (booleans as the "True"/"False" strings it parses)."""
    opts = {
        "device_id": str(options.device_id),
        "trt_max_workspace_size": str(options.workspace_bytes),
        "trt_builder_optimization_level": str(options.builder_optimization_level),
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(engine_dir),
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": str(timing_dir),
    }
    if profiles:
        opts.update(profile_shape_options(profiles))
    return opts


def load_ort_trt(model_path: Path, settings: SessionSettings,
                 shapes: Sequence[tuple[int, int]] | None, cache_dir: Path | None, *,
                 options: TrtEpOptions = TrtEpOptions()):
    """The `ort-trt` loader (tuner.runtime.backend.Loader signature). Without buckets the EP
    builds engines for the shapes it meets at run time (and rebuilds when they grow)."""
    model_path = Path(model_path)
    buckets = check_buckets(shapes)
    profiles = profiles_for(input_specs(model_path), buckets) if buckets else []
    root = work_dir(cache_dir, "ort-trt")
    engine_dir = root / "engines" / f"{model_path.stem}-{cache_key(model_path)}"
    timing_dir = root / "timing"
    for d in (engine_dir, timing_dir):
        d.mkdir(parents=True, exist_ok=True)
    trt_opts = provider_options(engine_dir, timing_dir, profiles, options)
    sess = make_session(model_path, settings,
                        [(TRT_EP, trt_opts), (CUDA_EP, {"device_id": str(options.device_id)}),
                         "CPUExecutionProvider"], TRT_EP)
    runner = IoBindingRunner(sess, "ort-trt", options.device_id,
                             {"provider": TRT_EP, "profiles": len(profiles),
                              "engine_cache": str(engine_dir), "timing_cache": str(timing_dir),
                              # TensorRT allows TF32 for fp32 by default and onnxruntime's TRT
                              # EP has no option to clear it (the trt backend clears it)
                              "tf32": "TensorRT default (allowed)"})
    # build (or load) every profile's engine now, not inside the first timed run
    specs = input_specs(model_path)  # roles and axes from the graph's structure
    for b, s in buckets:
        runner.infer(dummy_feed(specs, b, s))
    return runner
