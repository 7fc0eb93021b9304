"""Numbers that are what they claim: the GEMM probe times in the backend's precision, and a
results-cache entry is keyed by everything a timing depends on (runtime, provider, device,
driver, TensorRT), so an upgrade never reuses old timings."""

from __future__ import annotations

from dataclasses import replace

from tuner.hardware.detect import DeviceInfo
from tuner.jobs import planning
from tuner.measure.cache import ResultsCache, device_key, entry_key


def _gpu(**kw) -> DeviceInfo:
    base = DeviceInfo("gpu", "NVIDIA H100", "cpu", 8, sm_count=132, memory_bytes=80 << 30,
                      driver="550.54.15", cuda_driver="12.4", tensorrt="10.16.0",
                      onnxruntime="1.31.1")
    return replace(base, **kw)


def test_the_cache_key_changes_with_runtime_provider_device_driver_and_tensorrt():
    base = device_key(_gpu(), "ort-trt")
    for changed in (device_key(_gpu(onnxruntime="1.32.0"), "ort-trt"),
                    device_key(_gpu(), "ort-cuda"),
                    device_key(_gpu(name="NVIDIA H200"), "ort-trt"),
                    device_key(_gpu(driver="560.1"), "ort-trt"),
                    device_key(_gpu(tensorrt="10.17.0"), "ort-trt")):
        assert changed != base
        assert entry_key("sha", "ort-trt", changed, (1, 16), {}, 5, 1) != \
            entry_key("sha", "ort-trt", base, (1, 16), {}, 5, 1)
    assert "onnxruntime=1.31.1" in base and "tensorrt=10.16.0" in base and "driver=550.54.15" in base


def test_the_gemm_probe_times_in_the_backends_precision(monkeypatch):
    assert (planning.probe_dtype("fp32"), planning.probe_dtype("fp16"),
            planning.probe_dtype("bf16")) == ("fp32", "fp16", "bf16")
    seen = []

    def fake_probe(gemms, backend, rounds, warmup, threads, dtype):
        seen.append(dtype)
        return [type("R", (), {"samples_ms": (1.0,) * rounds})() for _ in gemms]

    monkeypatch.setattr(planning, "probe", fake_probe)

    class _Gemm:
        label = "x"

        def describe(self):
            return "1x2x3"

    for dtype in ("fp32", "fp16"):
        fn = planning._cached_probe(ResultsCache(None), ("sha", "probe:torch-cuda", "dev"), 1,
                                    "torch-cuda", dtype)
        fn([_Gemm()])
    assert seen == ["fp32", "fp16"]  # and the two are cached apart (two probes ran)
