"""Facts about the machine a measurement ran on, for the manifest, findings and plots.

    info = detect()              # DeviceInfo, cached; never raises on a machine without a GPU
    info.to_json()               # what `tuner optimize` records as manifest["device"]
    info.facts()                 # tuner.hardware.facts.DeviceFacts for the shape rules (SMs, tiles)

GPU facts come from the CUDA driver itself (libcuda through ctypes: no torch needed), with the
driver's version string from nvidia-smi and library versions from the installed packages.
On a machine without an NVIDIA driver the answer is the CPU: model name from /proc/cpuinfo and
the cores this process may use.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from tuner.hardware.facts import DEVICES, DeviceFacts
from tuner.hardware.cgroup import cpu_limit


@dataclass(frozen=True)
class GpuFacts:
    """What the CUDA driver reports about one GPU."""

    name: str
    sm_count: int
    memory_bytes: int
    compute_capability: str  # "9.0"
    cuda_driver: str  # the CUDA version the driver supports, "12.4"


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "gpu" | "cpu"
    name: str  # the GPU's name, or the CPU's model name
    cpu_model: str
    cpu_cores: int  # cores this process may run on
    sm_count: int | None = None
    memory_bytes: int | None = None
    compute_capability: str | None = None
    driver: str | None = None  # NVIDIA driver version, "550.54.15"
    cuda_driver: str | None = None  # CUDA version the driver supports
    cuda_runtime: str | None = None  # CUDA runtime torch (or the nvidia wheels) were built for
    cudnn: str | None = None
    tensorrt: str | None = None
    onnxruntime: str | None = None
    torch: str | None = None
    facts_key: str | None = None  # key of tuner.hardware.facts.DEVICES this device matches

    def __post_init__(self) -> None:
        if self.kind not in ("gpu", "cpu"):
            raise ValueError(f"device kind must be gpu or cpu, not {self.kind!r}")
        if not self.name:
            raise ValueError("device name must not be empty")
        if self.cpu_cores < 1:
            raise ValueError(f"cpu_cores must be >= 1, not {self.cpu_cores}")
        if self.sm_count is not None and self.sm_count < 1:
            raise ValueError(f"sm_count must be >= 1, not {self.sm_count}")
        if self.memory_bytes is not None and self.memory_bytes < 0:
            raise ValueError(f"memory_bytes must be >= 0, not {self.memory_bytes}")
        if self.kind == "gpu" and self.sm_count is None:
            raise ValueError("a gpu device needs its sm_count")
        if self.facts_key is not None and self.facts_key not in DEVICES:
            raise ValueError(f"facts_key {self.facts_key!r} is not one of {', '.join(DEVICES)}")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "DeviceInfo":
        """Read back what to_json wrote (a manifest's `device`); unknown keys are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @property
    def label(self) -> str:
        """A short name for tables and plot titles."""
        if self.kind == "gpu":
            gib = f", {self.memory_bytes / 2**30:.0f} GiB" if self.memory_bytes else ""
            return f"{self.name} ({self.sm_count} SMs{gib})"
        return f"{self.cpu_model} ({self.cpu_cores} cores)"

    def facts(self) -> DeviceFacts:
        """The shape rules' view: the table's entry, with the SM count actually detected (an H100
        PCIe has 114 SMs, not the SXM part's 132); an unknown GPU gets the Ampere/Hopper tile."""
        if self.kind == "cpu":
            return dataclasses.replace(DEVICES["cpu"], name=self.cpu_model)
        if self.facts_key is not None:
            return dataclasses.replace(DEVICES[self.facts_key], name=self.name,
                                       sm_count=self.sm_count)
        return DeviceFacts(self.name, "gpu", self.sm_count, (128, 256), 8, 64)


# ---------------------------------------------------------------------------------------------
# Pure helpers (tested on their own)


def facts_key_for(gpu_name: str) -> str | None:
    """The DEVICES key a GPU's marketing name matches: "NVIDIA H100 80GB HBM3" -> "h100",
    "NVIDIA A100-SXM4-40GB" -> "a100"; None when the table does not know the part."""
    low = gpu_name.lower()
    for key, facts in DEVICES.items():
        if facts.kind != "gpu":
            continue
        # "h100" must not match inside "gh1000", but may be followed by "-", " " or "nvl"
        if re.search(rf"(?<![a-z0-9]){re.escape(key)}(?![0-9])", low):
            return key
    return None


def cuda_version_string(v: int) -> str:
    """The driver API's integer version (12040) as "12.4"."""
    return f"{v // 1000}.{(v % 1000) // 10}"


def parse_cpuinfo(text: str) -> str:
    """The CPU's model name from /proc/cpuinfo (x86 "model name", ARM "Model"/"CPU part")."""
    for key in ("model name", "Model", "Hardware", "cpu model"):
        m = re.search(rf"^{re.escape(key)}\s*:\s*(.+)$", text, re.MULTILINE)
        if m and m.group(1).strip():
            return m.group(1).strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def parse_nvidia_smi(csv: str) -> list[dict[str, str]]:
    """Rows of `nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader,
    nounits` as dicts."""
    rows = []
    for line in csv.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3:
            rows.append({"name": parts[0], "driver": parts[1], "memory_mib": parts[2]})
    return rows


# ---------------------------------------------------------------------------------------------
# Probing the machine


_CU_ATTR_SM_COUNT = 16  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
_CU_ATTR_CC_MAJOR = 75
_CU_ATTR_CC_MINOR = 76


@functools.lru_cache(maxsize=1)
def _libcuda() -> tuple[ctypes.CDLL | None, str]:
    """The CUDA driver library, initialised; or None and why not."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        rc = lib.cuInit(0)
    except OSError:
        return None, "no NVIDIA driver: libcuda.so.1 cannot be loaded"
    except AttributeError:  # a libcuda.so.1 that is not the driver (a stub in a build image)
        return None, "libcuda.so.1 has no cuInit: not an NVIDIA driver library"
    if rc != 0:
        return None, f"the CUDA driver failed to initialise (cuInit error {rc})"
    return lib, "ok"


def gpu_count() -> tuple[int, str]:
    """How many GPUs the CUDA driver sees, and a reason when it is none."""
    lib, why = _libcuda()
    if lib is None:
        return 0, why
    n = ctypes.c_int(0)
    rc = lib.cuDeviceGetCount(ctypes.byref(n))
    if rc != 0:
        return 0, f"cuDeviceGetCount error {rc}"
    return n.value, "ok" if n.value else "the CUDA driver sees no GPU"


def query_gpu(index: int = 0) -> GpuFacts | None:
    """One GPU's facts from the driver API; None where there is no such GPU."""
    count, _ = gpu_count()
    lib, _ = _libcuda()
    if lib is None or index >= count:
        return None
    dev = ctypes.c_int(0)
    if lib.cuDeviceGet(ctypes.byref(dev), index) != 0:
        return None
    name = ctypes.create_string_buffer(256)
    lib.cuDeviceGetName(name, 256, dev)
    mem = ctypes.c_size_t(0)
    lib.cuDeviceTotalMem_v2(ctypes.byref(mem), dev)

    def attr(a: int) -> int:
        v = ctypes.c_int(0)
        lib.cuDeviceGetAttribute(ctypes.byref(v), a, dev)
        return v.value

    ver = ctypes.c_int(0)
    lib.cuDriverGetVersion(ctypes.byref(ver))
    return GpuFacts(name.value.decode(errors="replace"), attr(_CU_ATTR_SM_COUNT), mem.value,
                    f"{attr(_CU_ATTR_CC_MAJOR)}.{attr(_CU_ATTR_CC_MINOR)}",
                    cuda_version_string(ver.value))


def _nvidia_smi_driver(index: int) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = parse_nvidia_smi(out)
    return rows[index]["driver"] if index < len(rows) else None


def _dist_version(*names: str) -> str | None:
    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            continue
    return None


def _cpu() -> tuple[str, int]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            model = parse_cpuinfo(f.read())
    except OSError:
        model = platform.processor() or platform.machine() or "unknown CPU"
    return model, usable_cores()


def affinity_cores() -> int:
    """Cores this process may run on (what a runtime's default thread count follows)."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def usable_cores() -> int:
    """Cores this process may keep busy: those it may run on, no more than its cgroup's CPU
    quota in whole CPUs (a container's `--cpus` or `limits: cpu`; a thread per host core
    would be throttled to the quota, intra-op threads waiting on each other meanwhile)."""
    cores = affinity_cores()
    quota = cpu_limit()
    if quota is not None:
        cores = min(cores, int(quota))
    return max(cores, 1)


def _torch_cuda_versions() -> tuple[str | None, str | None]:
    """(CUDA runtime, cuDNN) versions of an installed CUDA torch; imported only on a GPU host."""
    try:
        import torch
    except ImportError:
        return None, None
    cudnn = None
    if torch.version.cuda and torch.backends.cudnn.is_available():
        v = torch.backends.cudnn.version()
        cudnn = f"{v // 10000}.{(v % 10000) // 100}.{v % 100}" if v and v >= 10000 else str(v)
    return torch.version.cuda, cudnn


@functools.lru_cache(maxsize=4)
def detect(gpu_index: int = 0) -> DeviceInfo:
    """This machine's device facts. The GPU when the CUDA driver sees one, else the CPU."""
    cpu_model, cores = _cpu()
    versions = dict(
        # the `tensorrt` metapackage, or the wheels it pulls (the module comes from *-bindings)
        tensorrt=_dist_version("tensorrt", "tensorrt-cu13", "tensorrt-cu12", "tensorrt-cu11",
                               "tensorrt-cu13-bindings", "tensorrt-cu12-bindings"),
        onnxruntime=_dist_version("onnxruntime-gpu", "onnxruntime"),
        torch=_dist_version("torch"),
    )
    gpu = query_gpu(gpu_index)
    if gpu is None:
        return DeviceInfo("cpu", cpu_model, cpu_model, cores, facts_key="cpu", **versions)
    runtime, cudnn = _torch_cuda_versions()
    runtime = runtime or _dist_version("nvidia-cuda-runtime-cu13", "nvidia-cuda-runtime-cu12",
                                       "nvidia-cuda-runtime")
    cudnn = cudnn or _dist_version("nvidia-cudnn-cu13", "nvidia-cudnn-cu12")
    return DeviceInfo("gpu", gpu.name, cpu_model, cores, sm_count=gpu.sm_count,
                      memory_bytes=gpu.memory_bytes, compute_capability=gpu.compute_capability,
                      driver=_nvidia_smi_driver(gpu_index), cuda_driver=gpu.cuda_driver,
                      cuda_runtime=runtime, cudnn=cudnn, facts_key=facts_key_for(gpu.name),
                      **versions)


if __name__ == "__main__":  # python -m tuner.hardware.detect
    import json
    import os
    import sys

    try:
        print(json.dumps(detect().to_json(), indent=2), flush=True)
    except BrokenPipeError:  # `| head`: the reader left, which is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
