"""Reference decoders exported WITH their KV cache, in the layout Hugging Face's ONNX export
tooling (optimum) writes for text generation and ONNX Runtime's HF integration runs:

    inputs   input_ids (batch, sequence)                           int64
             attention_mask (batch, past_sequence + sequence)      int64
             position_ids (batch, sequence)                        int64
             past_key_values.{i}.key|value (batch, kv_heads, past_sequence, head_dim)  float32
    outputs  logits (batch, sequence, vocab)
             present.{i}.key|value (batch, kv_heads, past_sequence + sequence, head_dim)

Every family gets `position_ids`, GPT-2 included: recent optimum writes them for GPT-2 too
(its GPT2OnnxConfig is a TextDecoderWithPositionIdsOnnxConfig; older releases had none), and
one layout for all four keeps feed builders free of per-family cases. The first step runs
with past_sequence 0 (past tensors of shape (batch, kv_heads, 0, head_dim)).

Used through models.build: `cached("llama-kv", "awkward", "dynamo")`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

# Axis names as they appear in the graphs (dim_param), in both exporters' graphs: dynamo
# derives "past_sequence + sequence" for present itself, and calls the mask's length by a
# fresh symbol, which _name_mask_axis renames.
BATCH, SEQ, PAST, TOTAL = "batch", "sequence", "past_sequence", "past_sequence + sequence"
TRACE_BATCH, TRACE_SEQ, TRACE_PAST = 2, 3, 5  # the example shapes the exporters trace


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """(input names, output names) of a cache export with `num_layers` layers, in graph order."""
    past = [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past], ["logits", *present]


def _filled_layer(keys, values):
    """A DynamicLayer that already holds `keys`/`values` (B, kv_heads, P, d).

    DynamicCache's own constructor fills layers through update(), which concatenates onto a
    1-D empty tensor: torch accepts that, an ONNX Concat of rank 1 with rank 4 does not. Set
    the tensors directly so the model's own update() makes the one Concat per layer per K/V
    that the graph is meant to have. get_seq_length() reads the shape unconditionally: the
    stock one branches on numel() == 0, a guard torch.export cannot keep for past >= 0.
    """
    from transformers.cache_utils import DynamicLayer

    class _Filled(DynamicLayer):
        def get_seq_length(self) -> int:
            return self.keys.shape[-2]

    layer = _Filled()
    layer.device, layer.keys, layer.values, layer.is_initialized = keys.device, keys, values, True
    return layer


def kv_wrapper(model):
    """(input_ids, attention_mask, position_ids, past) -> (logits, *present), flat tensors.

    `past` is one tuple (k0, v0, k1, v1, ...) so that both exporters see plain tensors: the
    DynamicCache object is built and unpacked inside forward and never crosses the boundary.
    """
    import torch
    from transformers import DynamicCache

    class KVWrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, past):
            # No config: every layer is a full one. Mistral's sliding window still applies
            # through the attention mask; the cache simply keeps all P + S positions, which
            # is the (B, kv_heads, P + S, d) present the layout promises.
            cache = DynamicCache()
            cache.layers = [_filled_layer(past[2 * i], past[2 * i + 1])
                            for i in range(len(past) // 2)]
            out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids, cache=cache, use_cache=True,
                             return_dict=True)
            present = []
            for layer in out.cache.layers:
                present += [layer.keys, layer.values]  # (B, kv_heads, P + S, d) each
            return (out.logits, *present)

    return KVWrapped().eval()


def num_layers_of(config: Any) -> int:
    return config.num_hidden_layers


def kv_heads_of(config: Any) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def example_inputs(config: Any, batch: int = TRACE_BATCH, seq: int = TRACE_SEQ,
                   past: int = TRACE_PAST, seed: int = 0) -> tuple[Any, ...]:
    """Example (input_ids, attention_mask, position_ids, past) for tracing, all ones mask."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    pos = torch.arange(past, past + seq, dtype=torch.int64).expand(batch, seq)  # (B, S)
    shape = (batch, kv_heads_of(config), past, head_dim_of(config))  # (B, kv_heads, P, d)
    cache = tuple(torch.randn(shape, generator=g) for _ in range(2 * num_layers_of(config)))
    return ids, mask, pos, cache


def _torchscript(model, args, path: Path, names: tuple[list[str], list[str]], opset: int) -> None:
    import torch

    inputs, outputs = names
    axes = {"input_ids": {0: BATCH, 1: SEQ}, "attention_mask": {0: BATCH, 1: TOTAL},
            "position_ids": {0: BATCH, 1: SEQ}, "logits": {0: BATCH, 1: SEQ}}
    axes |= {n: {0: BATCH, 2: PAST} for n in inputs[3:]}
    axes |= {n: {0: BATCH, 2: TOTAL} for n in outputs[1:]}
    torch.onnx.export(model, args, str(path), dynamo=False, input_names=inputs,
                      output_names=outputs, dynamic_axes=axes, opset_version=opset,
                      do_constant_folding=True)


def _dynamo(model, args, path: Path, names: tuple[list[str], list[str]], opset: int,
            optimize: bool = True) -> None:
    import torch

    inputs, outputs = names
    batch = torch.export.Dim(BATCH, min=1, max=64)
    seq = torch.export.Dim(SEQ, min=1, max=256)
    past = torch.export.Dim(PAST, min=0, max=256)
    cache_axes = {0: batch, 2: past}
    # torch.export cannot write past + seq (a sum of two dims): the mask's length is its own
    # dim, and the exporter derives from the graph that it equals past + seq.
    total = torch.export.Dim.DYNAMIC
    shapes = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: total},
              "position_ids": {0: batch, 1: seq}, "past": (cache_axes,) * len(args[3])}
    program = torch.onnx.export(model, args, dynamo=True, opset_version=opset,
                                input_names=inputs, output_names=outputs,
                                dynamic_shapes=shapes, optimize=optimize)
    program.save(str(path), external_data=False)


def _name_mask_axis(graph) -> None:
    """Give the mask's length the name present's length has (dynamo calls it e.g. "s53").

    Only a label: both are past_sequence + sequence, and one name for one quantity lets a
    reader (and `tuner inspect`) see it. Every value_info that carries the old name follows.
    """
    mask = next(v for v in graph.input if v.name == "attention_mask")
    old = mask.type.tensor_type.shape.dim[1].dim_param
    if not old or old == TOTAL:
        return
    for value in [*graph.input, *graph.output, *graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param == old:
                dim.dim_param = TOTAL


def export_kv(model, exporter: str, out: Path, opsets: dict[str, int], ir_version: int,
              optimize: bool = True) -> Path:
    """Export a transformers causal LM with its cache to `out` (temp file, then rename);
    `optimize`: dynamo's own optimizer (constant folding, fusions) on its graph."""
    import onnx
    import torch

    from models.quiet import quiet_exporters

    wrapped = kv_wrapper(model)
    args = example_inputs(model.config)
    names = io_names(num_layers_of(model.config))
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_path = Path(tmp) / out.name
        with torch.no_grad(), quiet_exporters():
            if exporter == "torchscript":
                _torchscript(wrapped, args, tmp_path, names, opsets[exporter])
            else:
                _dynamo(wrapped, args, tmp_path, names, opsets[exporter], optimize)
        proto = onnx.load(str(tmp_path))
        proto.ir_version = min(proto.ir_version, ir_version)
        _name_mask_axis(proto.graph)
        onnx.save(proto, str(tmp_path))
        os.replace(tmp_path, out)
    return out
