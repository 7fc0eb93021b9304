"""`trt` (and `trt-fp16`): TensorRT's own Python API.

One engine per variant with one optimisation profile per bucket (opt = max = the bucket, so
kernels are chosen for the exact shapes the server pads to). The engine is saved under
`cache_dir/trt/` and loaded from there by the next process (`tuner serve`) without a rebuild;
the timing cache `cache_dir/trt/timing.cache` is shared by every variant's build.

Networks are strongly typed (TensorRT 10.x needs NetworkDefinitionCreationFlag.STRONGLY_TYPED,
which every 10.x has; 11.x removed weak typing, BuilderFlag.FP16 with it, and ignores the now
deprecated flag), so precision lives in the ONNX graph: `trt-fp16` builds from the fp16 copy
of the variant that `ort-cuda-fp16` uses too. TF32 is cleared (TensorRT enables it by default
for fp32 tensors): the fp32 backend must give fp32 results, as ort-cuda does with use_tf32=0.

Device memory and copies use ONNX Runtime's CUDA OrtValues (onnxruntime-gpu is a dependency
already), so no pycuda/cuda-python is needed. Engines run on the default stream: TensorRT
warns that this costs a synchronisation, which the copies back to the host need anyway.
Engine files are compiled code: load only artifacts you built or trust.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from tuner.errors import BadInput
from tuner.graph.roles import input_specs
from tuner.hardware.detect import detect
from tuner.runtime.base import SessionSettings
from tuner.runtime.gpu import (ShapeRange, cache_key, check_buckets, fp16_model, pick_profile,
                               profiles_for, work_dir)
from tuner.util.files import atomic_write

TIMING_CACHE = "timing.cache"
ENGINE_SUFFIX = ".engine"
MAX_BUFFER_SETS = 32  # device buffers kept per distinct input shape
DEFAULT_BUCKETS = ((8, 512),)  # the profile when the caller names no buckets


@functools.lru_cache(maxsize=1)
def trt_reason() -> str | None:
    """None when `import tensorrt` works, else the install hint."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return "tensorrt is not installed (pip install 'shapetuner[trt]')"
    except Exception as e:  # noqa: BLE001 - a broken install raises OSError and friends
        return f"tensorrt does not import ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    return None


@dataclass(frozen=True)
class BuildOptions:
    workspace_bytes: int = 4 << 30
    builder_optimization_level: int = 3
    tf32: bool = False  # TensorRT's default is on; off keeps fp32 engines at fp32 accuracy

    def __post_init__(self) -> None:
        if self.workspace_bytes < (1 << 20):
            raise ValueError(f"workspace_bytes must be at least 1 MiB, not {self.workspace_bytes}")
        if not 0 <= self.builder_optimization_level <= 5:
            raise ValueError("builder_optimization_level must be 0..5, not "
                             f"{self.builder_optimization_level}")


def engine_path(cache_dir: Path, model_path: Path, profiles: Sequence[Mapping[str, ShapeRange]],
                device_name: str, trt_version: str, options: BuildOptions | None = None) -> Path:
    """Where the engine for this model, these profiles, this GPU, TensorRT (and build options)
    lives: any change to one of them is another file, so a stale engine is never loaded."""
    extra = {} if options is None else {"build": dataclasses.asdict(options)}
    key = cache_key(model_path, profiles=[{n: list(map(list, r)) for n, r in p.items()}
                                          for p in profiles],
                    device=device_name, tensorrt=trt_version, **extra)
    return Path(cache_dir) / f"{model_path.stem}-{key}{ENGINE_SUFFIX}"


def _major(version: str) -> int:
    try:
        return int(version.split(".")[0])
    except ValueError:
        return 0


def _network_flags(trt) -> int:
    """STRONGLY_TYPED on 10.x (enum value 1 there); 0 from 11.x, where every network is strongly
    typed and the flag (enum value 0 there) is deprecated and ignored."""
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    if flag is None or _major(trt.__version__) >= 11:
        return 0
    return 1 << int(flag)


def numpy_dtype(trt, trt_dtype, name: str) -> np.dtype:
    """The numpy dtype of an engine's I/O tensor. trt.nptype knows float32/16, int8/32/64, bool
    and uint8 (10.x and 11.x alike); bf16, fp8 and fp4 I/O raise TypeError there."""
    try:
        return np.dtype(trt.nptype(trt_dtype))
    except TypeError:
        raise BadInput(f"engine tensor {name!r} has type {trt_dtype}, which numpy cannot hold; "
                       "keep the model's inputs and outputs in float32/float16/int types") from None


def build_engine(model_path: Path, profiles: Sequence[Mapping[str, ShapeRange]],
                 timing_cache: Path, options: BuildOptions = BuildOptions()) -> bytes:
    """Parse the ONNX file (external data beside it), add the profiles, build, and merge what
    the build timed back into the shared timing cache. Returns the serialized engine."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(_network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(model_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise BadInput(f"TensorRT cannot parse {model_path.name}: {'; '.join(errors[:3])}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_bytes)
    config.builder_optimization_level = options.builder_optimization_level
    if not options.tf32:
        config.clear_flag(trt.BuilderFlag.TF32)
    cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.exists() else b"")
    if not config.set_timing_cache(cache, ignore_mismatch=False):
        # a cache from another GPU or TensorRT: start a fresh one rather than mix timings
        config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)
    for prof in profiles:
        p = builder.create_optimization_profile()
        for name, (lo, opt, hi) in prof.items():
            p.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(p)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"TensorRT failed to build an engine for {model_path.name} "
                           "(its log above says why)")
    try:
        atomic_write(timing_cache, memoryview(config.get_timing_cache().serialize()))
    except OSError:
        pass  # a read-only cache dir: the next build times again, nothing is wrong
    return bytes(memoryview(plan))


class TrtRunner:
    """Runs a deserialized engine: picks the tightest profile for the request's shapes, keeps
    device buffers per shape, copies in, executes, copies out."""

    def __init__(self, engine, name: str, info: dict[str, Any] | None = None,
                 device_id: int = 0) -> None:
        import tensorrt as trt

        self.engine = engine
        self.name = name
        self.info = dict(info or {})
        self.device_id = device_id
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.input_names = [n for n in names
                            if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.output_names = [n for n in names if n not in self.input_names]
        self.dtypes = {n: numpy_dtype(trt, engine.get_tensor_dtype(n), n) for n in names}
        self.profiles = [{n: tuple(tuple(int(v) for v in s)
                                   for s in engine.get_tensor_profile_shape(n, k))
                          for n in self.input_names}
                         for k in range(engine.num_optimization_profiles)]
        self.context = engine.create_execution_context()
        self._profile = 0  # a new context starts on profile 0
        self._buffers: dict[tuple, dict[str, Any]] = {}
        self._lock = threading.Lock()  # one context and its buffers: one request at a time

    def _buffers_for(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
        import onnxruntime as ort

        key = (self._profile, tuple(sorted(shapes.items())))
        if key not in self._buffers:
            bufs = {}
            for n in self.input_names + self.output_names:
                shape = shapes[n] if n in shapes else tuple(self.context.get_tensor_shape(n))
                if any(d < 0 for d in shape):
                    raise RuntimeError(f"output {n} has a data-dependent shape {shape}; "
                                       "the trt backend does not support those")
                bufs[n] = ort.OrtValue.ortvalue_from_shape_and_type(
                    list(shape), self.dtypes[n].type, "cuda", self.device_id)
            if len(self._buffers) >= MAX_BUFFER_SETS:  # odd shapes from a verify run: drop oldest
                self._buffers.pop(next(iter(self._buffers)))
            self._buffers[key] = bufs
        return self._buffers[key]

    def close(self) -> None:
        self._buffers.clear()
        self.context = self.engine = None

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise BadInput(f"missing inputs {missing}; the engine takes {self.input_names}")
        shapes = {n: tuple(int(d) for d in np.shape(feeds[n])) for n in self.input_names}
        k = pick_profile(self.profiles, shapes)
        with self._lock:
            return self._run(k, shapes, feeds)

    def _run(self, k: int, shapes: Mapping[str, tuple[int, ...]],
             feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if k != self._profile:
            if not self.context.set_optimization_profile_async(k, 0):
                raise RuntimeError(f"TensorRT refused to switch to profile {k}")
            self._profile = k
        for n, shape in shapes.items():
            if not self.context.set_input_shape(n, shape):
                raise BadInput(f"TensorRT refused shape {shape} for input {n}")
        bufs = self._buffers_for(shapes)
        for n in self.input_names:
            bufs[n].update_inplace(np.ascontiguousarray(feeds[n], dtype=self.dtypes[n]))
        for n, v in bufs.items():
            if not self.context.set_tensor_address(n, v.data_ptr()):
                raise RuntimeError(f"TensorRT refused the device address for tensor {n}")
        if not self.context.execute_async_v3(0):
            raise RuntimeError("TensorRT execution failed (its log above says why)")
        # OrtValue.numpy() copies with cudaMemcpy on the legacy default stream, which waits for
        # the engine's work on that same stream
        return {n: bufs[n].numpy() for n in self.output_names}


def load_trt(model_path: Path, settings: SessionSettings,
             shapes: Sequence[tuple[int, int]] | None, cache_dir: Path | None, *,
             fp16: bool = False, options: BuildOptions = BuildOptions(), device_id: int = 0):
    """The `trt` / `trt-fp16` loader (tuner.runtime.backend.Loader signature): load the saved
    engine when there is one for exactly these profiles, else build and save it."""
    import tensorrt as trt

    name = "trt-fp16" if fp16 else "trt"
    source = fp16_model(Path(model_path), cache_dir) if fp16 else Path(model_path)
    # without buckets (an accuracy check on a few small shapes): one profile up to the default
    buckets = check_buckets(shapes) or list(DEFAULT_BUCKETS)
    profiles = profiles_for(input_specs(source), buckets)
    root = work_dir(cache_dir, "trt")
    path = engine_path(root, source, profiles, detect(device_id).name, trt.__version__, options)
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine, built = None, False
    if path.exists():
        engine = runtime.deserialize_cuda_engine(path.read_bytes())  # None if incompatible
    if engine is None:
        plan = build_engine(source, profiles, root / TIMING_CACHE, options)
        try:
            atomic_write(path, plan)
        except OSError as e:  # read-only artifact: serve from memory, say it was not kept
            path = Path(f"(not saved: {e.strerror})")
        engine, built = runtime.deserialize_cuda_engine(plan), True
    if engine is None:
        raise RuntimeError(f"TensorRT could not deserialize the engine it built for {source.name}")
    info = {"engine": str(path), "built": built, "profiles": len(profiles),
            "precision": "fp16" if fp16 else "fp32", "tf32": options.tf32,
            "tensorrt": trt.__version__}
    return TrtRunner(engine, name, info, device_id)
