"""No-op stand-ins for the CUDA, cuBLAS, cuDNN and TensorRT shared libraries, so that the real
onnxruntime-gpu provider libraries load on a machine without a GPU and run their own host code:
the option parsers, the graph partitioning, the CUDA-graph checks and the IO-binding paths.

Nothing is computed (a kernel launch returns success and does nothing, so every output is
garbage): tests built on this judge what ONNX Runtime accepts, refuses and reports, never
values. Each stub library is compiled with gcc from the symbol list `nm` reads out of the
installed provider libraries, under the sonames and symbol versions they ask for; a handful of
functions get a body that hands back a plausible device (one GPU, warp size 32, a graph
handle). Use the libraries only in a child process (LD_LIBRARY_PATH): a stub libcuda.so.1 in
this process would shadow the real driver.
"""

from __future__ import annotations

import collections
import shutil
import subprocess
from pathlib import Path

PROVIDERS = ("libonnxruntime_providers_cuda.so", "libonnxruntime_providers_tensorrt.so")

# Bodies for the functions whose outputs the host code reads; every other symbol returns 0
# (cudaSuccess, CUBLAS_STATUS_SUCCESS, ...). The cudaDeviceProp offsets are CUDA 12/13's
# (name[256], uuid, luid, mask, totalGlobalMem at 288, ..., warpSize at 308).
_BODIES = {
    "cudaGetDeviceCount": "int cudaGetDeviceCount(int* c) { *c = 1; return 0; }",
    "__cudaRegisterFatBinary":
        "static void* fatbin[8]; void** __cudaRegisterFatBinary(void* f) { return fatbin; }",
    "cudaMalloc": "int cudaMalloc(void** p, size_t n) { *p = malloc(n ? n : 1); return 0; }",
    "cudaStreamCreate": "int cudaStreamCreate(void** s) { *s = malloc(8); return 0; }",
    "cudaStreamCreateWithFlags":
        "int cudaStreamCreateWithFlags(void** s, unsigned f) { *s = malloc(8); return 0; }",
    "cudaEventCreateWithFlags":
        "int cudaEventCreateWithFlags(void** s, unsigned f) { *s = malloc(8); return 0; }",
    "cublasCreate_v2": "int cublasCreate_v2(void** s) { *s = malloc(8); return 0; }",
    "cublasLtCreate": "int cublasLtCreate(void** s) { *s = malloc(8); return 0; }",
    "cudnnCreate": "int cudnnCreate(void** s) { *s = malloc(8); return 0; }",
    "cudaRuntimeGetVersion": "int cudaRuntimeGetVersion(int* v) { *v = 13000; return 0; }",
    "cudaDriverGetVersion": "int cudaDriverGetVersion(int* v) { *v = 13000; return 0; }",
    "cudaGetDeviceProperties":
        "int cudaGetDeviceProperties(char* p, int d) { memset(p, 0, 1024); strcpy(p, \"stub\");"
        " *(size_t*)(p + 288) = (size_t)80 << 30; *(size_t*)(p + 296) = 49152;"
        " *(int*)(p + 304) = 65536; *(int*)(p + 308) = 32; *(int*)(p + 320) = 1024;"
        " int* t = (int*)(p + 324); t[0] = 1024; t[1] = 1024; t[2] = 64;"
        " int* g = (int*)(p + 336); g[0] = 2147483647; g[1] = 65535; g[2] = 65535; return 0; }",
    "cudaDeviceGetAttribute":  # warp size 32, 1024 threads, CC 9.x, 132 SMs, else 1
        "int cudaDeviceGetAttribute(int* v, int a, int d) { *v = a == 10 ? 32 : a == 1 ? 1024"
        " : a == 75 ? 9 : a == 16 ? 132 : 1; return 0; }",
    "cudaStreamEndCapture":
        "int cudaStreamEndCapture(void* s, void** g) { *g = malloc(8); return 0; }",
    "cudaGraphInstantiate":
        "int cudaGraphInstantiate(void** e, void* g, unsigned long long f) { *e = malloc(8);"
        " return 0; }",
    # TensorRT: a plugin registry, runtime and builder whose every method returns 0
    "getPluginRegistry": "void* getPluginRegistry(void) { return fake_object(); }",
    "createInferRuntime_INTERNAL":
        "void* createInferRuntime_INTERNAL(void) { return fake_object(); }",
    "createInferBuilder_INTERNAL":
        "void* createInferBuilder_INTERNAL(void) { return fake_object(); }",
    "getInferLibVersion": "int getInferLibVersion(void) { return 101600; }",
}
_PRELUDE = """#include <stdlib.h>
#include <string.h>
static long ret0(void) { return 0; }
static void* fake_object(void) {
    static void* vtable[512]; static void* object[1];
    for (int i = 0; i < 512; i++) vtable[i] = (void*)ret0;
    object[0] = vtable; return object;
}
"""


def _library_for(symbol: str) -> str | None:
    """Where an unversioned symbol lives (the versioned ones name their library)."""
    if "NvOnnxParser" in symbol:
        return "libnvonnxparser.so"
    if "Infer" in symbol or "PluginRegistry" in symbol:
        return "libnvinfer.so"
    if symbol.startswith("cu") and not symbol.startswith("cuda"):
        return "libcuda.so.1"
    return None


def _needed(lib: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
    return [line.split("[")[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


def build(out_dir: Path, capi: Path) -> Path | None:
    """Compile the stubs for the provider libraries in `capi` (onnxruntime/capi) into
    `out_dir`; None when gcc, nm or readelf is missing, or onnxruntime has no GPU providers."""
    if not all(shutil.which(t) for t in ("gcc", "nm", "readelf")):
        return None
    providers = [capi / p for p in PROVIDERS if (capi / p).exists()]
    if len(providers) != len(PROVIDERS):
        return None
    symbols: dict[str, set[str]] = collections.defaultdict(set)
    versioned: set[str] = set()
    sonames = {n for p in providers for n in _needed(p)}
    for lib in providers:
        out = subprocess.run(["nm", "-D", "--undefined-only", str(lib)], capture_output=True,
                             text=True, check=True).stdout
        for name in (line.split()[-1] for line in out.splitlines() if line.strip()):
            sym, _, version = name.partition("@")
            if version in sonames:
                symbols[version].add(sym)
                versioned.add(version)
            elif not version and (target := _library_for(sym)):
                soname = next((s for s in sonames if s.startswith(target)), target)
                symbols[soname].add(sym)
    out_dir.mkdir(parents=True, exist_ok=True)
    system = ("libc.", "libm.", "libdl.", "librt.", "libpthread.", "libstdc++", "libgcc_s",
              "ld-linux")
    for soname in sorted(s for s in sonames | set(symbols) if not s.startswith(system)):
        names = sorted(symbols.get(soname, ()))
        body = [_BODIES.get(n, f"long {n}(void) {{ return 0; }}") for n in names]
        src = out_dir / f"{soname}.c"
        src.write_text(_PRELUDE + "\n".join(body) + "\n")
        cmd = ["gcc", "-shared", "-fPIC", "-w", "-o", str(out_dir / soname), str(src),
               f"-Wl,-soname,{soname}"]
        if soname in versioned:  # the providers ask for cudaMalloc@libcudart.so.13 and so on
            script = out_dir / f"{soname}.map"
            exported = " ".join(n + ";" for n in names)
            script.write_text(f"{soname} {{ global: {exported} local: *; }};\n")
            cmd.append(f"-Wl,--version-script={script}")
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            return None
    return out_dir


def run_child(lib_dir: Path, code: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run `code` in a fresh Python with the stubs first on the library path (no core file if
    it dies: the stub TensorRT has no builder, so a TensorRT EP session ends in a crash once
    the EP has parsed and logged its options)."""
    import os
    import resource
    import sys

    env = dict(os.environ, LD_LIBRARY_PATH=str(lib_dir))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=Path(__file__).resolve().parent.parent,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))
