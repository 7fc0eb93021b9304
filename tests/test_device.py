"""tuner.hardware.detect: device facts for the manifest. The parsers and the name mapping are pure and
tested on real outputs of the tools; detect() is tested on this machine as it is."""

from __future__ import annotations

import json
import os

import pytest

from tuner.hardware.detect import (DeviceInfo, cuda_version_string, detect, facts_key_for,
                                   gpu_count, parse_cpuinfo, parse_nvidia_smi)
from tuner.hardware.facts import DEVICES

X86_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme de
"""
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd
CPU part\t: 0xd4f

Model\t\t: NVIDIA Grace
"""


def test_parse_cpuinfo_reads_the_model_name():
    assert parse_cpuinfo(X86_CPUINFO) == "Intel(R) Xeon(R) Platinum 8480+"
    assert parse_cpuinfo(ARM_CPUINFO) == "NVIDIA Grace"
    assert parse_cpuinfo("")  # falls back to the platform's name, never empty


def test_parse_nvidia_smi_rows():
    out = "NVIDIA H100 80GB HBM3, 550.54.15, 81559\nNVIDIA A100-SXM4-40GB, 535.104.05, 40960\n"
    rows = parse_nvidia_smi(out)
    assert rows == [{"name": "NVIDIA H100 80GB HBM3", "driver": "550.54.15", "memory_mib": "81559"},
                    {"name": "NVIDIA A100-SXM4-40GB", "driver": "535.104.05", "memory_mib": "40960"}]
    assert parse_nvidia_smi("") == []
    assert parse_nvidia_smi("garbage without commas") == []


@pytest.mark.parametrize("name, key", [
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 PCIe", "h100"),
    ("NVIDIA H100 NVL", "h100"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-40GB", "a100"),
    ("NVIDIA A100 80GB PCIe", "a100"),
    ("Tesla T4", None),
    ("NVIDIA GeForce RTX 4090", None),
    ("NVIDIA GH200 480GB", None),  # not the h200 entry: "gh200" is another part
    ("NVIDIA A1000", None),  # not an A100
])
def test_facts_key_for_gpu_names(name, key):
    assert facts_key_for(name) == key


def test_cuda_version_string():
    assert cuda_version_string(12040) == "12.4"
    assert cuda_version_string(13000) == "13.0"
    assert cuda_version_string(11080) == "11.8"


def _gpu(**kw) -> DeviceInfo:
    base = dict(kind="gpu", name="NVIDIA H100 PCIe", cpu_model="x", cpu_cores=8, sm_count=114,
                memory_bytes=80 * 2**30, facts_key="h100")
    return DeviceInfo(**{**base, **kw})


@pytest.mark.parametrize("kw, message", [
    (dict(kind="tpu"), "device kind must be gpu or cpu"),
    (dict(name=""), "device name must not be empty"),
    (dict(cpu_cores=0), "cpu_cores must be >= 1"),
    (dict(sm_count=0), "sm_count must be >= 1"),
    (dict(sm_count=None), "a gpu device needs its sm_count"),
    (dict(memory_bytes=-1), "memory_bytes must be >= 0"),
    (dict(facts_key="v100"), "facts_key 'v100' is not one of"),
])
def test_device_info_validation_messages(kw, message):
    with pytest.raises(ValueError, match=message):
        _gpu(**kw)


def test_json_round_trip_and_unknown_keys():
    info = _gpu(driver="550.54.15", cuda_driver="12.4", tensorrt="10.13.0")
    text = json.dumps(info.to_json())
    back = DeviceInfo.from_json({**json.loads(text), "added_by_a_later_version": 1})
    assert back == info


def test_facts_use_the_detected_sm_count():
    facts = _gpu().facts()  # an H100 PCIe has 114 SMs, the table's SXM part 132
    assert facts.sm_count == 114 and facts.tile == DEVICES["h100"].tile
    assert facts.name == "NVIDIA H100 PCIe"
    unknown = _gpu(name="Tesla T4", sm_count=40, facts_key=None).facts()
    assert (unknown.kind, unknown.sm_count, unknown.align) == ("gpu", 40, 8)
    cpu = DeviceInfo("cpu", "AMD EPYC", "AMD EPYC", 2, facts_key="cpu").facts()
    assert cpu.kind == "cpu" and cpu.name == "AMD EPYC" and cpu.sm_count is None


def test_labels():
    assert _gpu().label == "NVIDIA H100 PCIe (114 SMs, 80 GiB)"
    assert DeviceInfo("cpu", "AMD EPYC", "AMD EPYC", 2).label == "AMD EPYC (2 cores)"


def test_detect_on_this_machine():
    info = detect()
    assert detect() is info  # cached: the manifest, the report and plots see one answer
    import onnxruntime

    assert info.onnxruntime == onnxruntime.__version__
    assert info.cpu_cores == len(os.sched_getaffinity(0))
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        assert info.cpu_model == parse_cpuinfo(f.read())
    n, why = gpu_count()
    if n:
        assert info.kind == "gpu" and info.sm_count and info.memory_bytes
        assert info.name and info.compute_capability
    else:
        assert info.kind == "cpu" and info.name == info.cpu_model and info.facts_key == "cpu"
        assert "libcuda" in why or "GPU" in why
    # the manifest stores it as JSON: it must survive the trip
    assert DeviceInfo.from_json(json.loads(json.dumps(info.to_json()))) == info
