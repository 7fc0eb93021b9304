"""Hardware facts the shape rules need: SM count, tile size, alignment (docs/design.md).

Figures are the vendors' published ones; `tile` is a representative output tile of a large
fp16 cuBLAS/CUTLASS GEMM on that part (128x256 on Ampere/Hopper), used to count tiles and waves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tuner.errors import BadInput

# Head dims for which ONNX Runtime has fused attention kernels (docs/design.md): another head dim
# runs the unfused path, so the head dim decides which attention kernel runs at all.
ORT_FUSED_HEAD_DIMS = (16, 32, 40, 64, 80, 128, 160, 256)


@dataclass(frozen=True)
class DeviceFacts:
    name: str
    kind: str  # "gpu" | "cpu"
    sm_count: int | None  # streaming multiprocessors; None on a CPU
    tile: tuple[int, int] | None  # (rows, cols) of one output tile
    align: int  # elements: tensor cores want multiples of this (fp16/bf16)
    best_multiple: int  # the knee of the tile-quantisation curve (64 on A100-class parts)
    peak_tflops_fp16: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("gpu", "cpu"):
            raise ValueError(f"kind must be gpu or cpu, not {self.kind!r}")
        if self.align <= 0 or self.best_multiple <= 0:
            raise ValueError("align and best_multiple must be positive")


DEVICES: dict[str, DeviceFacts] = {
    "a100": DeviceFacts("NVIDIA A100", "gpu", 108, (128, 256), 8, 64, 312.0),
    "h100": DeviceFacts("NVIDIA H100", "gpu", 132, (128, 256), 8, 64, 989.0),
    "h200": DeviceFacts("NVIDIA H200", "gpu", 132, (128, 256), 8, 64, 989.0),
    # CPUs have no tensor-core tiles; SIMD widths make multiples of 16 (fp32, AVX-512) tidy.
    "cpu": DeviceFacts("CPU", "cpu", None, None, 16, 64),
}


def device_facts(name: str) -> DeviceFacts:
    key = name.lower()
    if key not in DEVICES:

        raise BadInput(f"unknown device {name!r}; choose one of: {', '.join(DEVICES)}")
    return DEVICES[key]


@dataclass(frozen=True)
class WaveCount:
    tiles: int
    waves: float  # tiles / SMs
    efficiency: float  # useful fraction of the last wave's SMs, averaged over all waves


def waves(m: int, n: int, dev: DeviceFacts) -> WaveCount | None:
    """Tiles of an (m x n) GEMM output and how many waves of one tile per SM they take.
    109 tiles on 108 SMs take two waves: efficiency 109 / 216."""
    if dev.sm_count is None or dev.tile is None:
        return None
    tiles = math.ceil(m / dev.tile[0]) * math.ceil(n / dev.tile[1])
    full = math.ceil(tiles / dev.sm_count)
    return WaveCount(tiles, tiles / dev.sm_count, tiles / (full * dev.sm_count))


def next_multiple(x: int, m: int) -> int:
    return -(-x // m) * m


def largest_power_of_two_dividing(x: int) -> int:
    return x & -x if x > 0 else 0
