"""ONNX Runtime's transformer optimizer as a candidate rewrite: fused LayerNorm, GELU,
SkipLayerNorm (and attention where its patterns match). It is not an exact rewrite by
construction, so its output goes through the accuracy gate like any other variant; padding
comes first, then fusion (the fused ops take sizes as attributes).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from tuner.errors import BadInput

LARGE_BYTES = 1_500_000_000  # beyond this, weights go to external data (protobuf's 2 GB cap)
# Peak memory of optimize_model over the model's bytes: it loads every weight into one
# ModelProto and copies it more than once on the way (shape inference, fusions, save).
# Measured on GPT-NeoX slices of Pythia-2.8B's shape: 1 layer (1.34 GB) peaked at 13.3 GB
# (9.9x); 8 layers (3.55 GB) passed 20.7 GB (5.8x) before a guard stopped it. Rounded up:
# guessing low lets the kernel's OOM killer end the whole `tuner optimize`, not just this
# candidate.
MEMORY_FACTOR = 10.0
HEADROOM_BYTES = 1 << 30  # the rest of the process (sessions of other variants, numpy feeds)


class FuseFailed(BadInput):
    """The optimizer could not process the graph; the fused candidate is skipped."""


class FuseSkipped(FuseFailed):
    """The optimizer would not fit in the memory available: skipped before it starts."""


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes; None where unknown (not Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits(src: str | os.PathLike, available: int | None = None) -> int:
    """The model's bytes; FuseSkipped (one line, with the numbers) when the optimizer's
    estimated peak would not fit in the memory available now."""
    from tuner.graph.size import model_bytes

    size = model_bytes(src)
    available = mem_available() if available is None else available
    need = int(size * MEMORY_FACTOR) + HEADROOM_BYTES
    if available is not None and need > available:
        raise FuseSkipped(f"ONNX Runtime's transformer optimizer skipped on {Path(src).name}: "
                          f"it needs about {need / 1e9:.1f} GB ({MEMORY_FACTOR:g}x the model's "
                          f"{size / 1e9:.1f} GB), {available / 1e9:.1f} GB is available")
    return size


def fuse_file(src: str | os.PathLike, dst: str | os.PathLike, num_heads: int,
              hidden_size: int) -> dict[str, int]:
    """Write the fused form of `src` to `dst`; returns the fused-op counts (empty: nothing
    fused, and nothing written)."""
    from onnxruntime.transformers.optimizer import optimize_model

    src, dst = Path(src), Path(dst)
    size = check_fits(src)
    # "bert" is the generic fusion set (it also matches GPT-2, Llama norms); "gpt2"'s
    # post-processing assumes a Gemm layout that dynamo exports do not have.
    quiet = logging.getLogger("onnxruntime.transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        m = optimize_model(str(src), model_type="bert", num_heads=num_heads,
                           hidden_size=hidden_size, opt_level=0, use_gpu=False)
        stats = {k: int(v) for k, v in m.get_fused_operator_statistics().items() if v}
        if not stats:
            return {}
        dst.parent.mkdir(parents=True, exist_ok=True)
        m.save_model_to_file(str(dst), use_external_data_format=size > LARGE_BYTES)
        return stats
    except (ValueError, IndexError, KeyError, AttributeError, RuntimeError, AssertionError) as e:
        raise FuseFailed(f"ONNX Runtime's transformer optimizer failed on {src.name}: "
                         f"{type(e).__name__}: {e}") from None
    finally:
        quiet.setLevel(level)
