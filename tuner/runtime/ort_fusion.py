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
from tuner.graph.io import model_bytes
from tuner.runtime.memory import mem_available  # noqa: F401 - tests patch it here

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


def check_fits(src: str | os.PathLike, available: int | None = None) -> int:
    """The model's bytes; FuseSkipped (one line, with the numbers) when the optimizer's
    estimated peak would not fit in the memory available now."""
    size = model_bytes(src)
    available = mem_available() if available is None else available
    need = int(size * MEMORY_FACTOR) + HEADROOM_BYTES
    if available is not None and need > available:
        raise FuseSkipped(f"ONNX Runtime's transformer optimizer skipped on {Path(src).name}: "
                          f"it needs about {need / 1e9:.1f} GB ({MEMORY_FACTOR:g}x the model's "
                          f"{size / 1e9:.1f} GB), {available / 1e9:.1f} GB is available")
    return size


IN_PROCESS_BYTES = 256 << 20  # smaller models fuse in this process (a child costs ~2 s)


def fuse_file(src: str | os.PathLike, dst: str | os.PathLike, num_heads: int,
              hidden_size: int, scale: float | None = None) -> dict[str, int]:
    """Write the fused form of `src` to `dst`; returns the fused-op counts (empty: nothing
    fused, and nothing written). `scale`: the model's softmax scale, written on each fused
    attention op the optimizer left without one (see _pin_scale).

    A model past IN_PROCESS_BYTES is fused in a child process: the optimizer's ~10x peak is
    returned to the system when the child exits (freed in this process, glibc keeps much of
    it, and the variants' sessions loaded next found 4 GB of 23 free on an fp16 Pythia-2.8B
    slice), and if the kernel kills it for memory only this candidate is lost."""
    src, dst = Path(src), Path(dst)
    size = check_fits(src)
    if size <= IN_PROCESS_BYTES:
        return _fuse_here(src, dst, num_heads, hidden_size, size, scale)
    return run_in_child(_fuse_here, src, dst, num_heads, hidden_size, size, scale,
                        what=f"ONNX Runtime's transformer optimizer on {src.name}")


def run_in_child(fn, *args, what: str):
    """fn(*args) in a fresh (spawned) Python process; its exceptions come back as they are,
    its death (out of memory, a signal) as FuseFailed naming `what`."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(fn, *args).result()
        except BrokenProcessPool:
            raise FuseFailed(f"{what}: its process died (killed for memory?); the fused "
                             "candidate is skipped") from None


def _fuse_here(src: Path, dst: Path, num_heads: int, hidden_size: int, size: int,
               scale: float | None = None) -> dict[str, int]:
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    # "bert" is the generic fusion set (it also matches GPT-2, Llama norms); "gpt2"'s
    # post-processing assumes a Gemm layout that dynamo exports do not have.
    options = FusionOptions("bert")
    # Attention fed the raw (batch, seq) mask: by default it gets each row's count of ones
    # (ReduceSum, or EmbedLayerNormalization's mask index) and takes the first that many
    # tokens as the row's, wrong for a left-padded or holed mask (max abs 2.5 on MiniLM's
    # left-padded rows; the gate refused every BERT-like encoder's fused variant for it)
    options.use_raw_attention_mask(True)
    quiet = logging.getLogger("onnxruntime.transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        m = optimize_model(str(src), model_type="bert", num_heads=num_heads,
                           hidden_size=hidden_size, opt_level=0, use_gpu=False,
                           optimization_options=options)
        stats = {k: int(v) for k, v in m.get_fused_operator_statistics().items() if v}
        if not stats:
            return {}
        if scale is not None:
            _pin_scale(m.model, scale)
        _rotary_caches_as_input(m)
        _rotary_positions_per_row(m)
        dst.parent.mkdir(parents=True, exist_ok=True)
        m.save_model_to_file(str(dst), use_external_data_format=size > LARGE_BYTES)
        return stats
    except (ValueError, IndexError, KeyError, AttributeError, RuntimeError, AssertionError) as e:
        raise FuseFailed(f"ONNX Runtime's transformer optimizer failed on {src.name}: "
                         f"{type(e).__name__}: {e}") from None
    finally:
        quiet.setLevel(level)


# Fused attention ops whose `scale` defaults to 1/sqrt(their head size)
SCALED_OPS = ("Attention", "MultiHeadAttention", "GroupQueryAttention")


def _pin_scale(model, scale: float) -> None:
    """The optimizer's BERT attention fusion matches the scores' scaling and drops it,
    leaving the op's default, 1/sqrt(head size): on a head-padded variant that is the padded
    width's (1/8 for MiniLM's 32 padded to 64, where the model scales by 1/sqrt(32)), and the
    fused variant failed the gate (max abs 0.69). The model's own scale, written out, holds
    at any width."""
    from onnx import helper

    for node in model.graph.node:
        if (node.domain == "com.microsoft" and node.op_type in SCALED_OPS
                and not any(a.name == "scale" for a in node.attribute)):
            node.attribute.append(helper.make_attribute("scale", float(scale)))


FLOATS = (1, 10, 16)  # TensorProto FLOAT, FLOAT16, BFLOAT16


def _rotary_caches_as_input(m) -> None:
    """The optimizer's rotary fusion computes each RotaryEmbedding's cos/sin caches itself, in
    float32: on a half-precision graph (an fp16 export, transformers.js' q4f16 copies) the op
    then binds its type to float16 and float32 and the fused model does not load. The caches
    are made the type of the op's input."""
    import numpy as np
    from onnx import TensorProto, numpy_helper

    producers = m.output_name_to_node()
    for node in m.model.graph.node:
        if node.domain != "com.microsoft" or node.op_type != "RotaryEmbedding":
            continue
        if _elem_type(m, node.input[0], producers) != TensorProto.FLOAT16:
            continue
        for name in node.input[2:4]:
            init = m.get_initializer(name)
            if init is not None and init.data_type == TensorProto.FLOAT:
                half = numpy_helper.to_array(init).astype(np.float16)
                init.CopyFrom(numpy_helper.from_array(half, init.name))


def _elem_type(m, name: str, producers: dict, depth: int = 8) -> int | None:
    """The element type of value `name`: recorded in the graph, a Cast's target, or the first
    floating-point input of its producer whose type is recorded (a MatMul's weight, a
    MatMulNBits' scales), back through shape ops on the first input."""
    known = m.get_dtype(name)
    if known or depth == 0 or name not in producers:
        return known
    node = producers[name]
    if node.op_type == "Cast":
        return next(a.i for a in node.attribute if a.name == "to")
    for value in node.input:
        if value and m.get_dtype(value) in FLOATS:
            return m.get_dtype(value)
    return _elem_type(m, node.input[0], producers, depth - 1) if node.input else None


def _rotary_positions_per_row(m) -> None:
    """A graph without a position_ids input computes its positions once for every row,
    arange(past, past + seq) of shape (1, seq) (Optimum's Gemma, Gemma 2, Nemotron), and the
    optimizer hands that to each fused RotaryEmbedding, which wants one row of positions per
    batch row: the fused model failed at batch 2. The positions are expanded to the batch of
    the op's input (batch, heads, seq, head) first."""
    from onnx import helper

    graph, made = m.model.graph, {}
    inputs = {i.name for i in graph.input}
    for node in list(graph.node):
        if node.domain != "com.microsoft" or node.op_type != "RotaryEmbedding":
            continue
        pos, x = node.input[1], node.input[0]
        if pos in inputs:
            continue
        if pos not in made:
            base = f"{pos}.per_row"
            for k in (0, 1):  # Gather of a Shape: Shape's start/end need opset 15
                graph.initializer.append(helper.make_tensor(f"{base}.axis{k}", 7, [1], [k]))
            graph.node.extend([
                helper.make_node("Shape", [x], [f"{base}.x_shape"], name=f"{base}.Shape_x"),
                helper.make_node("Gather", [f"{base}.x_shape", f"{base}.axis0"],
                                 [f"{base}.batch"], name=f"{base}.batch", axis=0),
                helper.make_node("Shape", [pos], [f"{base}.pos_shape"], name=f"{base}.Shape_pos"),
                helper.make_node("Gather", [f"{base}.pos_shape", f"{base}.axis1"],
                                 [f"{base}.seq"], name=f"{base}.seq", axis=0),
                helper.make_node("Concat", [f"{base}.batch", f"{base}.seq"], [f"{base}.shape"],
                                 name=f"{base}.Concat", axis=0),
                helper.make_node("Expand", [pos, f"{base}.shape"], [base], name=f"{base}.Expand"),
            ])
            made[pos] = base
        node.input[1] = made[pos]
    if made:
        m.topological_sort()
