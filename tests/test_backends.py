"""GPU backends: what this CPU machine can check for real (the refusals and their messages,
TensorRT profile shapes from buckets, provider options, cache keys, fp16 variants run by ONNX
Runtime), and the GPU runs themselves, which skip here with the reason and run on a machine
with an NVIDIA GPU.

Over 400 lines because every GPU backend's checks sit side by side (ort-cuda, ort-trt, trt and
their fp16 forms share fixtures and the CUDA stubs), so a change to one is seen beside the
others."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from tuner.errors import BadInput
from tuner.gate.feeds import make_feeds
from tuner.graph.roles import input_specs
from tuner.runtime import registry
from tuner.runtime.gpu import (bucket_shape, cache_key, check_buckets, ep_reason, fp16_model,
                               gpu_reason, pick_profile, profiles_for, work_dir)
from tuner.runtime.ort_gpu import CudaOptions
from tuner.runtime.ort_trt import TrtEpOptions, profile_shape_options, provider_options
from tuner.runtime.trt import BuildOptions, engine_path, trt_reason

ROOT = Path(__file__).resolve().parent.parent
GPU_BACKENDS = ("ort-cuda", "ort-cuda-fp16", "ort-trt", "trt", "trt-fp16")
NO_GPU = gpu_reason() is not None


# ---------------------------------------------------------------------------------------------
# Registration and refusal on a machine without a GPU


def test_gpu_backends_are_registered_with_their_precision():
    assert set(GPU_BACKENDS) <= set(registry.names())
    for name in GPU_BACKENDS:
        b = registry.get_backend(name)
        assert b.precision == ("fp16" if name.endswith("-fp16") else "fp32")
        assert b.description
    assert registry.get_backend("ort-cpu").precision == "fp32"


@pytest.mark.skipif(not NO_GPU, reason="this machine has an NVIDIA GPU")
def test_without_a_gpu_every_gpu_backend_says_why():
    for name in GPU_BACKENDS:
        ok, reason = registry.get_backend(name).available()
        assert not ok
        assert reason.startswith("no NVIDIA GPU found (")
        # onnxruntime-gpu lists CUDAExecutionProvider anyway: the message shows that list
        assert "onnxruntime reports providers: " in reason


@pytest.mark.skipif(not NO_GPU, reason="this machine has an NVIDIA GPU")
def test_asking_for_a_gpu_backend_explicitly_is_bad_input(reference_model):
    with pytest.raises(BadInput, match=r"^backend ort-cuda cannot run here: no NVIDIA GPU found"):
        registry.resolve("ort-cpu,ort-cuda")
    with pytest.raises(BadInput, match=r"^backend trt cannot run here: no NVIDIA GPU found"):
        registry.get_backend("trt").load(reference_model("gpt2"), shapes=[(1, 16)])


@pytest.mark.skipif(not NO_GPU, reason="this machine has an NVIDIA GPU")
def test_auto_skips_gpu_backends_with_one_line_each():
    usable, skipped = registry.resolve("auto")
    assert [b.name for b in usable] == ["ort-cpu"]
    for name in GPU_BACKENDS:
        lines = [s for s in skipped if s.startswith(f"skipped backend {name}: ")]
        assert len(lines) == 1 and "no NVIDIA GPU found" in lines[0]


@pytest.mark.skipif(not NO_GPU, reason="this machine has an NVIDIA GPU")
@pytest.mark.parametrize("name", ["ort-cuda", "trt"])
def test_cli_exits_2_with_one_line_for_an_explicit_gpu_backend(reference_model, tmp_path,
                                                               capsys, name):
    from tuner.cli import main

    code = main(["optimize", str(reference_model("gpt2")), "-o", str(tmp_path / "out"),
                 "--backend", name])
    err = capsys.readouterr().err
    assert code == 2
    assert f"tuner: error: backend {name} cannot run here: no NVIDIA GPU found" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


@pytest.mark.skipif(trt_reason() is None, reason="tensorrt is installed here")
def test_trt_check_names_the_extra_to_install():
    ok, reason = registry.get_backend("trt").available()
    assert not ok and "tensorrt is not installed (pip install 'shapetuner[trt]')" in reason


def test_checks_are_cached():
    ep_reason.cache_clear()
    first = ep_reason("CUDAExecutionProvider")
    assert ep_reason("CUDAExecutionProvider") == first
    assert ep_reason.cache_info().hits == 1


# ---------------------------------------------------------------------------------------------
# Buckets and TensorRT profiles


def test_check_buckets_sorts_deduplicates_and_refuses_bad_ones():
    assert check_buckets([(8, 128), (1, 16), (8, 128)]) == [(1, 16), (8, 128)]
    assert check_buckets(None) == []
    for bad, msg in [([(0, 16)], "must be >= 1"), ([(1, -2)], "must be >= 1"),
                     ([(1, 2, 3)], "two integers"), ([(True, 16)], "two integers"),
                     ([(1.5, 16)], "two integers")]:
        with pytest.raises(BadInput, match=msg):
            check_buckets(bad)


def test_bucket_shape_maps_dynamic_axes_to_batch_then_seq():
    assert bucket_shape("ids", ("batch", "sequence"), 4, 128) == (4, 128)
    assert bucket_shape("ids", (None, None), 4, 128, dynamic_value=1) == (1, 1)
    assert bucket_shape("pix", ("batch", 3, 224, 224), 8, 1) == (8, 3, 224, 224)
    assert bucket_shape("ids", (1, "s"), 8, 64) == (1, 64)  # fixed batch stays; seq gets 64
    assert bucket_shape("ids", (1, "s"), 8, 64, dynamic_value=1) == (1, 1)
    assert bucket_shape("kv", ("b", 2, "p", 8), 4, 16, seq_axis=2) == (4, 2, 16, 8)
    with pytest.raises(BadInput, match=r"input 'past' has a third dynamic axis \(axis 2"):
        bucket_shape("past", ("b", "s", "p"), 1, 2)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_profiles_from_buckets_on_real_exports(reference_model, exporter):
    specs = input_specs(reference_model("gpt2", exporter=exporter))
    profiles = profiles_for(specs, [(1, 16), (8, 128)])
    assert profiles == [
        {"input_ids": ((1, 1), (1, 16), (1, 16)), "attention_mask": ((1, 1), (1, 16), (1, 16))},
        {"input_ids": ((1, 1), (8, 128), (8, 128)),
         "attention_mask": ((1, 1), (8, 128), (8, 128))},
    ]
    with pytest.raises(BadInput, match="at least one"):
        profiles_for(specs, [])


def test_pick_profile_takes_the_tightest_that_fits():
    profiles = [{"x": ((1, 1), (4, 128), (4, 128))}, {"x": ((1, 1), (1, 16), (1, 16))},
                {"x": ((1, 1), (2, 512), (2, 512))}]
    assert pick_profile(profiles, {"x": (1, 16)}) == 1
    assert pick_profile(profiles, {"x": (1, 17)}) == 0  # 4x128 (512) is tighter than 2x512
    assert pick_profile(profiles, {"x": (1, 200)}) == 2
    assert pick_profile(profiles, {"x": (4, 100)}) == 0
    with pytest.raises(BadInput, match=r"fit no TensorRT profile .*\(4, 128\)"):
        pick_profile(profiles, {"x": (5, 16)})
    with pytest.raises(BadInput, match="fit no TensorRT profile"):
        pick_profile(profiles, {"x": (1, 16, 1)})  # wrong rank
    with pytest.raises(BadInput, match="fit no TensorRT profile"):
        pick_profile(profiles, {"y": (1, 16)})  # the profile's input is missing


def test_trt_ep_profile_strings_repeat_each_input_per_profile():
    profiles = [{"input_ids": ((1, 1), (1, 16), (1, 16)), "mask": ((1, 1), (1, 16), (1, 16))},
                {"input_ids": ((1, 1), (8, 128), (8, 128)), "mask": ((1, 1), (8, 128), (8, 128))}]
    assert profile_shape_options(profiles) == {
        "trt_profile_min_shapes": "input_ids:1x1,mask:1x1,input_ids:1x1,mask:1x1",
        "trt_profile_opt_shapes": "input_ids:1x16,mask:1x16,input_ids:8x128,mask:8x128",
        "trt_profile_max_shapes": "input_ids:1x16,mask:1x16,input_ids:8x128,mask:8x128",
    }
    with pytest.raises(BadInput, match="contains ':' or ','"):
        profile_shape_options([{"a:b": ((1,), (1,), (1,))}])


def test_trt_ep_provider_options(tmp_path):
    profiles = [{"x": ((1, 1), (2, 8), (2, 8))}]
    opts = provider_options(tmp_path / "e", tmp_path / "t", profiles, TrtEpOptions(device_id=1))
    assert opts["device_id"] == "1"
    assert opts["trt_engine_cache_enable"] == "True" and opts["trt_timing_cache_enable"] == "True"
    assert opts["trt_engine_cache_path"] == str(tmp_path / "e")
    assert opts["trt_timing_cache_path"] == str(tmp_path / "t")
    assert opts["trt_profile_opt_shapes"] == "x:2x8"
    assert all(isinstance(v, str) for v in opts.values())
    assert "trt_profile_min_shapes" not in provider_options(tmp_path, tmp_path, [])


def test_cuda_provider_options_and_validation():
    o = CudaOptions()
    assert o.provider_options(True) == {"device_id": "0", "use_tf32": "0",
                                        "enable_cuda_graph": "1",
                                        "arena_extend_strategy": "kSameAsRequested"}
    assert CudaOptions(gpu_mem_limit=2**30).provider_options(False)["gpu_mem_limit"] == str(2**30)
    assert CudaOptions(use_tf32=True).provider_options(False)["enable_cuda_graph"] == "0"
    with pytest.raises(ValueError, match="device_id must be >= 0"):
        CudaOptions(device_id=-1)
    with pytest.raises(ValueError, match="gpu_mem_limit must be positive"):
        CudaOptions(gpu_mem_limit=0)
    with pytest.raises(ValueError, match="workspace_bytes must be at least 1 MiB"):
        TrtEpOptions(workspace_bytes=10)
    with pytest.raises(ValueError, match="builder_optimization_level must be 0..5"):
        BuildOptions(builder_optimization_level=6)


# ---------------------------------------------------------------------------------------------
# Caches


def _external_model(folder: Path) -> Path:
    """A MatMul whose weight lives in an external data file beside the model."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.arange(64 * 64, dtype=np.float32).reshape(64, 64), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 64])],
                              [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    path = folder / "m.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="m.onnx.data",
              size_threshold=0)
    return path


def test_cache_key_follows_graph_weights_and_extras(tmp_path):
    path = _external_model(tmp_path)
    key = cache_key(path)
    assert key == cache_key(path) and len(key) == 16
    assert cache_key(path, profiles=[[1, 16]]) != key
    data = tmp_path / "m.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[0] ^= 1  # one bit of one weight: same graph, other weights
    data.write_bytes(bytes(raw))
    assert cache_key(path) != key


def test_cache_key_refuses_external_data_outside_the_model_folder(tmp_path):
    path = _external_model(tmp_path)
    proto = onnx.load(str(path), load_external_data=False)
    for entry in proto.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = "/dev/zero"
    onnx.save(proto, str(path))
    with pytest.raises(BadInput, match="absolute path"):
        cache_key(path)


def test_engine_path_changes_with_profiles_device_and_version(tmp_path):
    path = _external_model(tmp_path)
    p1 = [{"x": ((1, 64), (4, 64), (4, 64))}]
    p2 = [{"x": ((1, 64), (8, 64), (8, 64))}]
    base = engine_path(tmp_path / "trt", path, p1, "NVIDIA H100", "10.13.0")
    assert base == engine_path(tmp_path / "trt", path, p1, "NVIDIA H100", "10.13.0")
    # an engine built with TF32 allowed is another engine
    assert engine_path(tmp_path / "trt", path, p1, "NVIDIA H100", "10.13.0", BuildOptions()) != \
        engine_path(tmp_path / "trt", path, p1, "NVIDIA H100", "10.13.0", BuildOptions(tf32=True))
    assert base.name.startswith("m-") and base.suffix == ".engine"
    others = {engine_path(tmp_path / "trt", path, p2, "NVIDIA H100", "10.13.0"),
              engine_path(tmp_path / "trt", path, p1, "NVIDIA A100", "10.13.0"),
              engine_path(tmp_path / "trt", path, p1, "NVIDIA H100", "11.4.0")}
    assert base not in others and len(others) == 3


def test_work_dir_falls_back_to_a_temporary_folder(tmp_path):
    assert work_dir(tmp_path, "trt") == tmp_path / "trt" and (tmp_path / "trt").is_dir()
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    d = work_dir(blocker, "trt")  # cannot create file/trt: a private temp folder instead
    assert d.is_dir() and not d.is_relative_to(tmp_path)


# ---------------------------------------------------------------------------------------------
# fp16 variants (converted here, run by ONNX Runtime's CPU EP)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_fp16_variant_keeps_the_interface_and_stays_close(reference_model, tmp_path, exporter):
    from onnx import TensorProto

    from tuner.runtime.ort import OrtRunner, load_cpu

    src = reference_model("gpt2", exporter=exporter)
    out = fp16_model(src, tmp_path)
    assert out.parent == tmp_path / "fp16"
    mtime = out.stat().st_mtime_ns
    assert fp16_model(src, tmp_path) == out and out.stat().st_mtime_ns == mtime  # cached
    proto = onnx.load(str(out))
    big = [t for t in proto.graph.initializer if len(t.dims) == 2 and min(t.dims) > 1]
    assert big and all(t.data_type == TensorProto.FLOAT16 for t in big)
    orig = onnx.load(str(src), load_external_data=False)
    sig = lambda g: [(v.name, v.type.tensor_type.elem_type) for v in g]  # noqa: E731
    assert sig(proto.graph.input) == sig(orig.graph.input)
    assert sig(proto.graph.output) == sig(orig.graph.output)
    feed = make_feeds(src, 1024, [(2, 16)])[0]
    ref = OrtRunner(load_cpu(src)).infer(feed)
    half = OrtRunner(load_cpu(out)).infer(feed)
    for name, r in ref.items():
        err = np.abs(half[name] - r).max()
        assert half[name].dtype == r.dtype == np.float32
        assert 0 < err < 2e-2 * max(1.0, np.abs(r).max())  # rounded, but only at fp16 level


# ---------------------------------------------------------------------------------------------
# The runners' own logic, on the CPU EP: fixed per-bucket buffers updated in place (what a CUDA
# graph replays), output discovery, the uncaptured path for other shapes


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_bucket_buffer_runner_is_exact_on_the_cpu_ep(reference_model, exporter):
    from tuner.runtime.ort import OrtRunner, load_cpu
    from tuner.runtime.ort_gpu import CudaGraphRunner, IoBindingRunner

    src = reference_model("gpt2", exporter=exporter)
    ref = OrtRunner(load_cpu(src))
    graphs = CudaGraphRunner(load_cpu(src), "t", [(1, 16), (2, 16)], device="cpu")
    plain = IoBindingRunner(load_cpu(src), "t", device="cpu")
    assert graphs.info == {"cuda_graph": True, "graphs": 2}
    feeds = make_feeds(src, 1024, [(2, 16), (1, 16), (1, 7), (2, 16)], seed=5)
    first = graphs.infer(feeds[0])
    kept = {k: v.copy() for k, v in first.items()}
    for feed in feeds:  # buckets (in-place buffers) and 1x7 (the uncaptured path)
        want = ref.infer(feed)
        for runner in (graphs, plain):
            got = runner.infer(feed)
            assert set(got) == set(want)
            for k in want:
                np.testing.assert_array_equal(got[k], want[k])
    # a later run at the same bucket must not overwrite what an earlier one returned
    for k in kept:
        np.testing.assert_array_equal(first[k], kept[k])


def test_a_session_that_fell_back_to_the_cpu_is_refused(reference_model):
    """onnxruntime-gpu on a machine without CUDA libraries runs a CUDA session on the CPU
    without raising: make_session must catch it, or every 'GPU' timing would be a CPU one."""
    from tuner.runtime.base import SessionSettings
    from tuner.runtime.ort_gpu import make_session

    if ep_reason("CUDAExecutionProvider") is None:
        pytest.skip("the CUDA EP really works here")
    with pytest.raises(BadInput, match=r"onnxruntime did not start CUDAExecutionProvider"):
        make_session(reference_model("gpt2"), SessionSettings(),
                     ["CUDAExecutionProvider", "CPUExecutionProvider"], "CUDAExecutionProvider")


# ---------------------------------------------------------------------------------------------
# ONNX Runtime's own checks of our options and runners: the installed onnxruntime-gpu provider
# libraries, loaded on no-op CUDA/TensorRT stubs (tests/cuda_stubs.py) in a child process. They
# judge what ORT accepts, refuses and reports; the stubs compute nothing, so no value is checked.


def _ep_library(name: str) -> bytes:
    import onnxruntime as ort

    lib = Path(ort.__file__).parent / "capi" / name
    if not lib.exists():
        pytest.skip(f"onnxruntime {ort.__version__} has no {name}")
    return lib.read_bytes()


def test_option_names_are_the_ones_the_installed_providers_know(tmp_path):
    cuda = _ep_library("libonnxruntime_providers_cuda.so")
    trt = _ep_library("libonnxruntime_providers_tensorrt.so")
    profiles = [{"x": ((1, 1), (2, 8), (2, 8))}]
    known = lambda lib, key: b"\0" + key.encode() + b"\0" in lib  # noqa: E731 - a C string
    for key in CudaOptions(gpu_mem_limit=2**30).provider_options(True):
        assert known(cuda, key), key
    for key in provider_options(tmp_path, tmp_path, profiles):
        assert known(trt, key), key
    assert not known(cuda, "enable_cuda_graphs") and not known(trt, "trt_profile_shapes")


@pytest.fixture(scope="module")
def stub_libs(tmp_path_factory):
    import onnxruntime as ort
    from cuda_stubs import build

    libs = build(tmp_path_factory.mktemp("cuda-stubs"), Path(ort.__file__).parent / "capi")
    if libs is None:
        pytest.skip("needs gcc, nm and readelf, and onnxruntime-gpu's provider libraries")
    return libs


def _result(proc) -> dict:
    import json

    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


_CUDA_OPTIONS_CHILD = """
import json
import onnxruntime as ort
from tuner.runtime.gpu import _tiny_model
from tuner.runtime.ort_gpu import CudaOptions
so = ort.SessionOptions()
so.log_severity_level = 3
out = {}
for name, opts in [("minimal", {"device_id": "0"}),
                   ("graph", CudaOptions(gpu_mem_limit=2**30).provider_options(True)),
                   ("plain", CudaOptions().provider_options(False)),
                   ("misspelt", {"device_id": "0", "enable_cuda_graphs": "1"})]:
    s = ort.InferenceSession(_tiny_model(), so, providers=[("CUDAExecutionProvider", opts),
                                                          "CPUExecutionProvider"])
    out[name] = [s.get_providers()[0], s.get_provider_options().get("CUDAExecutionProvider", {})]
print("RESULT " + json.dumps(out))
"""


def test_onnxruntime_parses_our_cuda_options(stub_libs):
    from cuda_stubs import run_child

    out = _result(run_child(stub_libs, _CUDA_OPTIONS_CHILD))
    if out["minimal"][0] != "CUDAExecutionProvider":
        pytest.skip(f"this onnxruntime build does not start on the stubs: {out['minimal']}")
    provider, parsed = out["graph"]
    assert provider == "CUDAExecutionProvider"
    assert {k: parsed[k] for k in ("device_id", "enable_cuda_graph", "use_tf32",
                                   "arena_extend_strategy", "gpu_mem_limit")} == {
        "device_id": "0", "enable_cuda_graph": "1", "use_tf32": "0",
        "arena_extend_strategy": "kSameAsRequested", "gpu_mem_limit": str(2**30)}
    assert out["plain"][0] == "CUDAExecutionProvider"
    assert out["plain"][1]["enable_cuda_graph"] == "0"
    # a misspelt option is not an error: ORT prints it and quietly runs on the CPU instead
    # (which is why make_session checks get_providers())
    assert out["misspelt"][0] == "CPUExecutionProvider"


_TRT_OPTIONS_CHILD = """
import onnxruntime as ort
from tuner.runtime.gpu import _tiny_model
ort.set_default_logger_severity(0)  # the EP logs every option as it parsed it, at VERBOSE
so = ort.SessionOptions()
ort.InferenceSession(_tiny_model(), so, providers=[("TensorrtExecutionProvider", {opts!r}),
                                                   "CPUExecutionProvider"])
"""


def _trt_ep_log(stub_libs, opts: dict) -> str:
    from cuda_stubs import run_child

    proc = run_child(stub_libs, _TRT_OPTIONS_CHILD.format(opts=opts))
    return proc.stdout + proc.stderr


def test_onnxruntime_parses_our_trt_ep_options(stub_libs, tmp_path):
    profiles = [{"x": ((1, 4), (1, 4), (1, 4))}, {"x": ((1, 4), (1, 4), (1, 4))}]
    opts = provider_options(tmp_path / "e", tmp_path / "t", profiles,
                            TrtEpOptions(workspace_bytes=3 << 30))
    log = _trt_ep_log(stub_libs, opts)
    line = next((ln for ln in log.splitlines() if "TensorRT provider options: " in ln), None)
    if line is None:
        pytest.skip(f"the TensorRT EP did not start on the stubs: {log[-1500:]}")
    parsed = dict(kv.split(": ", 1) for kv in
                  line.split("TensorRT provider options: ", 1)[1].split(", ") if ": " in kv)
    assert {k: parsed[k] for k in ("device_id", "trt_max_workspace_size", "trt_engine_cache_enable",
                                   "trt_cache_path", "trt_global_cache_path",
                                   "trt_builder_optimization_level", "trt_profile_min_shapes",
                                   "trt_profile_opt_shapes", "trt_profile_max_shapes")} == {
        "device_id": "0", "trt_max_workspace_size": str(3 << 30), "trt_engine_cache_enable": "1",
        "trt_cache_path": str(tmp_path / "e"), "trt_global_cache_path": str(tmp_path / "t"),
        "trt_builder_optimization_level": "3", "trt_profile_min_shapes": "x:1x4,x:1x4",
        "trt_profile_opt_shapes": "x:1x4,x:1x4", "trt_profile_max_shapes": "x:1x4,x:1x4"}
    assert "is wrong" not in log and "Invalid TensorRT EP option" not in log
    # what the EP says about options it does not take: booleans are "True"/"False" only
    assert "should be 'True' or 'False'" in _trt_ep_log(stub_libs, {"trt_engine_cache_enable": "1"})
    assert "The format of provider option 'trt_profile_min_shapes' is wrong" in _trt_ep_log(
        stub_libs, {"trt_profile_min_shapes": "x=1x4", "trt_profile_opt_shapes": "x=1x4",
                    "trt_profile_max_shapes": "x=1x4"})


_RUNNERS_CHILD = """
import json
from tuner.gate.feeds import make_feeds
from tuner.runtime.base import SessionSettings
from tuner.runtime.ort_gpu import load_ort_cuda
out = {{}}
for name, src in {models!r}.items():
    r = load_ort_cuda(src, SessionSettings(), [(1, 16), (2, 16)], None)
    shapes = [{{k: [list(v.shape), str(v.dtype)] for k, v in r.infer(f).items()}}
              for f in make_feeds(src, 1024, [(2, 16), (1, 7)])]
    out[name] = [type(r).__name__, r.info, shapes]
print("RESULT " + json.dumps(out, default=str))
"""


def test_preloading_gpu_libraries_prints_nothing(capsys):
    """onnxruntime.preload_dlls prints every library it cannot find to stdout, which would
    break `tuner optimize --json`; preload_libraries swallows that."""
    from tuner.runtime.gpu import TRT_EP, preload_libraries

    preload_libraries.cache_clear()
    preload_libraries(TRT_EP)
    assert capsys.readouterr().out == ""


def test_trt_ep_names_the_libnvinfer_it_was_built_against():
    import re

    from tuner.runtime.gpu import trt_ep_needs

    lib = _ep_library("libonnxruntime_providers_tensorrt.so")
    needs = trt_ep_needs()
    assert re.fullmatch(r"libnvinfer\.so\.\d+", needs) and needs.encode() in lib


def test_a_libcuda_without_cuinit_is_no_gpu(stub_libs):
    from cuda_stubs import run_child

    proc = run_child(stub_libs, "from tuner.hardware.detect import gpu_count, detect\n"
                                "print('RESULT', __import__('json').dumps([gpu_count(), "
                                "detect().kind]))")
    assert _result(proc) == [[0, "libcuda.so.1 has no cuInit: not an NVIDIA driver library"],
                             "cpu"]


def test_cuda_runners_drive_the_real_cuda_ep(stub_libs, reference_model):
    """load_ort_cuda against ORT's CUDA EP code: graph capture per bucket (ids, warm-up, fixed
    OrtValues updated in place) on the dynamo export; ORT's own refusal of graph capture on the
    TorchScript export (shape nodes on the CPU), caught and reported in info."""
    from cuda_stubs import run_child

    from tuner.runtime.ort import OrtRunner, load_cpu

    models = {e: str(reference_model("gpt2", exporter=e)) for e in ("torchscript", "dynamo")}
    out = _result(run_child(stub_libs, _RUNNERS_CHILD.format(models=models)))
    kind, info, _ = out["torchscript"]
    assert kind == "IoBindingRunner" and info["cuda_graph"] is False
    assert "cannot use the graph capture feature" in info["cuda_graph_off"]
    kind, info, _ = out["dynamo"]
    assert kind == "CudaGraphRunner" and info["cuda_graph"] is True and info["graphs"] == 2
    for name, src in models.items():
        cpu = OrtRunner(load_cpu(Path(src)))
        want = [{k: [list(v.shape), str(v.dtype)] for k, v in cpu.infer(f).items()}
                for f in make_feeds(Path(src), 1024, [(2, 16), (1, 7)])]
        assert out[name][2] == want  # a bucket (graph replay) and another shape (plain path)


# ---------------------------------------------------------------------------------------------
# The GPU runs (skip here; run where a GPU is)


def _gpu_backend(name: str) -> None:
    ok, reason = registry.get_backend(name).available()
    if not ok:
        pytest.skip(f"{name}: {reason}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_gpu_backend_matches_the_cpu(reference_model, tmp_path, name):
    _gpu_backend(name)
    src = reference_model("gpt2")
    buckets = [(1, 16), (2, 16)]
    runner = registry.get_backend(name).load(src, shapes=buckets, cache_dir=tmp_path)
    assert runner.name == name
    cpu = registry.get_backend("ort-cpu").load(src)
    tol = 2e-2 if name.endswith("fp16") else 1e-3
    # the buckets (CUDA graphs, profiles) and a smaller shape inside them (plain path)
    for feed in make_feeds(src, 1024, buckets + [(1, 7)]):
        want, got = cpu.infer(feed), runner.infer(feed)
        for k, v in want.items():
            np.testing.assert_allclose(got[k], v, atol=tol, rtol=tol)


@pytest.mark.gpu
def test_trt_engine_is_saved_and_loaded_without_rebuilding(reference_model, tmp_path):
    _gpu_backend("trt")
    src = reference_model("gpt2")
    first = registry.get_backend("trt").load(src, shapes=[(1, 16)], cache_dir=tmp_path)
    second = registry.get_backend("trt").load(src, shapes=[(1, 16)], cache_dir=tmp_path)
    assert first.info["built"] is True and second.info["built"] is False
    assert (tmp_path / "trt" / "timing.cache").stat().st_size > 0


# ---------------------------------------------------------------------------------------------
# The GPU check script, in its CPU smoke mode


def test_gpu_check_smoke_runs_and_prints_one_table():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke",
                        "--rounds", "2"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "SMOKE" in out and "| part " in out
    assert "| probe | tiny  | vocab (lm_head)" in out and "| e2e   | tiny  | vocab on ort-cpu" in out
