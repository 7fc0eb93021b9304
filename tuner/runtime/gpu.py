"""What the GPU backends share: whether a GPU and an execution provider really work here, the
shapes of TensorRT optimisation profiles from (batch, seq) buckets, cache keys, fp16 variants.

Why a real check: onnxruntime-gpu lists CUDAExecutionProvider among its available providers
on any machine, GPU or not; a session asked for it then quietly falls back to the CPU (or
fails when cuDNN is missing). So "usable" means: the CUDA driver sees a GPU, and a tiny
session created with the provider actually runs on it (session.get_providers()). Both answers
are cached for the life of the process.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from tuner.errors import BadInput
from tuner.graph.io import model_files
from tuner.hardware.detect import gpu_count

CUDA_EP = "CUDAExecutionProvider"
TRT_EP = "TensorrtExecutionProvider"

# (min, opt, max) shape of one input in one optimisation profile
ShapeRange = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def _ort_providers() -> list[str]:
    import onnxruntime as ort

    return list(ort.get_available_providers())


@functools.lru_cache(maxsize=1)
def gpu_reason() -> str | None:
    """None when the CUDA driver sees an NVIDIA GPU, else why not (with ORT's provider list,
    since that list is what misleads people into thinking the GPU is there)."""

    n, why = gpu_count()
    if n > 0:
        return None
    try:
        providers = ", ".join(_ort_providers())
    except ImportError:
        providers = "onnxruntime not importable"
    return f"no NVIDIA GPU found ({why}; onnxruntime reports providers: {providers})"


def _tiny_model() -> bytes:
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model.SerializeToString()


@functools.lru_cache(maxsize=2)
def preload_libraries(provider: str) -> None:
    """Load CUDA/cuDNN (and TensorRT) libraries installed from PyPI into this process, so the
    EP's provider library finds them by soname: onnxruntime's provider .so files carry no
    RUNPATH to the nvidia-* or tensorrt_libs wheels. Best effort, once; called only where the
    driver sees a GPU."""
    import onnxruntime as ort

    preload = getattr(ort, "preload_dlls", None)  # onnxruntime >= 1.21
    if preload is not None:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints what it cannot find
            with contextlib.suppress(Exception):
                preload()
    if provider == TRT_EP:
        with contextlib.suppress(Exception):
            import tensorrt  # noqa: F401 - its tensorrt_libs wheel loads libnvinfer on import


def trt_ep_needs() -> str | None:
    """The libnvinfer soname onnxruntime's TensorRT EP was linked against ("libnvinfer.so.10"
    for onnxruntime-gpu 1.31), read from the provider library itself; None if unknown."""
    import onnxruntime as ort

    lib = Path(ort.__file__).parent / "capi" / "libonnxruntime_providers_tensorrt.so"
    try:
        m = re.search(rb"libnvinfer\.so\.\d+", lib.read_bytes())
    except OSError:
        return None
    return m.group().decode() if m else None


@functools.lru_cache(maxsize=4)
def ep_reason(provider: str) -> str | None:
    """None when ONNX Runtime really runs `provider` on a GPU here, else the reason."""
    reason = gpu_reason()
    if reason is not None:
        return reason
    try:
        import onnxruntime as ort
    except ImportError as e:
        return f"onnxruntime is not importable ({e})"
    available = _ort_providers()
    if provider not in available:
        return (f"onnxruntime {ort.__version__} has no {provider} (providers: "
                f"{', '.join(available)}); install onnxruntime-gpu")
    preload_libraries(provider)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    try:
        sess = ort.InferenceSession(_tiny_model(), sess_options=so,
                                    providers=[provider, "CPUExecutionProvider"])
        sess.run(None, {"x": np.ones((1, 4), np.float32)})
    except Exception as e:  # noqa: BLE001 - any failure to start the EP is the answer
        return f"onnxruntime could not start {provider}: {str(e).splitlines()[0][:300]}"
    used = sess.get_providers()
    if not used or used[0] != provider:
        lib = "CUDA/cuDNN"
        if provider == TRT_EP:  # e.g. tensorrt 11 installed, but the EP needs libnvinfer.so.10
            lib = f"TensorRT ({trt_ep_needs() or 'libnvinfer'}) or CUDA/cuDNN"
        return (f"onnxruntime fell back from {provider} to {used} ({lib} libraries missing or "
                f"of the wrong version for onnxruntime {ort.__version__}?)")
    return None


# ---------------------------------------------------------------------------------------------
# Shapes


def check_buckets(shapes: Iterable[Sequence[int]] | None) -> list[tuple[int, int]]:
    """(batch, seq) buckets, validated, deduplicated and sorted; BadInput when one is bad."""
    out: set[tuple[int, int]] = set()
    for s in shapes or ():
        if len(s) != 2 or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                                  for v in s):
            raise BadInput(f"a bucket is (batch, seq) as two integers, not {tuple(s)!r}")
        b, q = int(s[0]), int(s[1])
        if b < 1 or q < 1:
            raise BadInput(f"bucket batch and seq must be >= 1, not ({b}, {q})")
        out.add((b, q))
    return sorted(out)


def bucket_shape(name: str, dims: Sequence[int | str | None], batch: int, seq: int,
                 *, dynamic_value: int | None = None, batch_axis: int | None = 0,
                 seq_axis: int | None = 1) -> tuple[int, ...]:
    """The concrete shape of one input at a bucket: the batch axis gets `batch`, the sequence
    axis `seq` (tuner.graph.roles.InputSpec's axes, found from the graph; (0, 1) by default);
    fixed axes stay, whichever they are (a batch-1 export keeps its 1). With
    `dynamic_value`, every dynamic axis gets that value instead (a profile's minimum)."""
    out = []
    for i, d in enumerate(dims):
        if isinstance(d, int) and d > 0:
            out.append(d)
        elif i not in (batch_axis, seq_axis):
            raise BadInput(f"input {name!r} has a third dynamic axis (axis {i}, {d!r}); only "
                           "(batch, seq) axes can get TensorRT profiles from buckets")
        else:
            v = batch if i == batch_axis else seq
            out.append(dynamic_value if dynamic_value is not None else v)
    return tuple(out)


def profiles_for(specs: Sequence, buckets: Sequence[tuple[int, int]]) -> list[dict[str, ShapeRange]]:
    """One optimisation profile per bucket: opt = max = the bucket's shape (the kernels are
    chosen for exactly the shape the server pads to), min = 1 on every dynamic axis (so any
    smaller request still fits). `specs`: objects with `name` and `dims` (tuner.gate.feeds.InputSpec)."""
    if not buckets:
        raise BadInput("TensorRT needs at least one (batch, seq) bucket for its profiles")
    profiles = []
    for b, s in buckets:
        prof = {}
        for spec in specs:
            axes = dict(batch_axis=getattr(spec, "batch_axis", 0),
                        seq_axis=getattr(spec, "seq_axis", 1))
            if axes["batch_axis"] is None and axes["seq_axis"] is None:
                axes = dict(batch_axis=0, seq_axis=1)
            top = bucket_shape(spec.name, spec.dims, b, s, **axes)
            low = bucket_shape(spec.name, spec.dims, b, s, dynamic_value=1, **axes)
            prof[spec.name] = (low, top, top)
        profiles.append(prof)
    return profiles


def pick_profile(profiles: Sequence[Mapping[str, ShapeRange]],
                 shapes: Mapping[str, tuple[int, ...]]) -> int:
    """The index of the tightest profile (smallest max volume) whose ranges hold `shapes`;
    BadInput listing the profiles' maxima when none does."""
    best, best_volume = -1, None
    for i, prof in enumerate(profiles):
        fits = all(name in shapes and len(shapes[name]) == len(lo)
                   and all(l <= v <= h for l, v, h in zip(lo, shapes[name], hi))
                   for name, (lo, _, hi) in prof.items())
        if fits:
            volume = sum(int(np.prod(hi)) for _, _, hi in prof.values())
            if best_volume is None or volume < best_volume:
                best, best_volume = i, volume
    if best < 0:
        maxima = sorted({tuple(r[2]) for p in profiles for r in p.values()})
        raise BadInput(f"input shapes {dict(shapes)} fit no TensorRT profile (maxima: {maxima}); "
                       "add a bucket that covers them")
    return best


# ---------------------------------------------------------------------------------------------
# Caches


def cache_key(model_path: Path, **extra) -> str:
    """A key that changes when the model's bytes (graph and weights) or `extra` change."""
    h = hashlib.sha256()
    for p in model_files(model_path):
        h.update(p.name.encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


_TMP_DIRS: list[tempfile.TemporaryDirectory] = []


def work_dir(cache_dir: Path | None, sub: str) -> Path:
    """`cache_dir/sub`, or a temporary folder kept for this process when there is no cache dir
    (or it cannot be created)."""
    if cache_dir is not None:
        d = Path(cache_dir) / sub
        try:
            d.mkdir(parents=True, exist_ok=True)
            return d
        except OSError:
            if d.is_dir():  # a read-only artifact (a container's mount): read what is there
                return d
    tmp = tempfile.TemporaryDirectory(prefix=f"shapetuner-{sub}-")
    _TMP_DIRS.append(tmp)
    return Path(tmp.name)


# ---------------------------------------------------------------------------------------------
# fp16 variants

FP16_MAX_PROTO = 1_800_000_000  # bytes; protobuf's limit is 2 GiB, leave room for the graph


def fp16_model(model_path: Path, cache_dir: Path | None) -> Path:
    """An fp16 copy of the model (weights and compute in fp16, inputs and outputs kept in their
    original types, so clients and the accuracy gate see the same interface), cached by the
    source's bytes. The accuracy gate must compare it at fp16 tolerances."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    out_dir = work_dir(cache_dir, "fp16")
    out = out_dir / f"{model_path.stem}-{cache_key(model_path, precision='fp16')}.onnx"
    if out.exists():
        return out
    model = onnx.load(str(model_path))
    big = model.ByteSize() > FP16_MAX_PROTO
    # keep_io_types: Cast nodes at the edges; shape inference cannot run on a > 2 GB proto
    model16 = convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=big)
    tmp = out.with_name(f".{out.name}.tmp")
    if model16.ByteSize() > FP16_MAX_PROTO or big:
        onnx.save(model16, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=f"{out.name}.data", size_threshold=1024)
    else:
        onnx.save(model16, str(tmp))
    os.replace(tmp, out)
    return out
