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


class FuseFailed(BadInput):
    """The optimizer could not process the graph; the fused candidate is skipped."""


def fuse_file(src: str | os.PathLike, dst: str | os.PathLike, num_heads: int,
              hidden_size: int) -> dict[str, int]:
    """Write the fused form of `src` to `dst`; returns the fused-op counts (empty: nothing
    fused, and nothing written)."""
    from onnxruntime.transformers.optimizer import optimize_model

    src, dst = Path(src), Path(dst)
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
        size = src.stat().st_size + sum(p.stat().st_size for p in src.parent.glob("*.data"))
        m.save_model_to_file(str(dst), use_external_data_format=size > LARGE_BYTES)
        return stats
    except (ValueError, IndexError, KeyError, AttributeError, RuntimeError, AssertionError) as e:
        raise FuseFailed(f"ONNX Runtime's transformer optimizer failed on {src.name}: "
                         f"{type(e).__name__}: {e}") from None
    finally:
        quiet.setLevel(level)
