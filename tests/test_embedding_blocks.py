"""Token embeddings stored in 4-bit blocks: ONNX Runtime's GatherBlockQuantized (com.microsoft),
what its 4-bit quantizer writes when asked for Gather beside MatMul, and what
onnxruntime-genai's builder writes at int4 for every model that ties its embedding to the LM
head (Llama 3.2 1B / 3B, Qwen2.5's small ones, Phi-4-mini): there the embedding is read out
of the LM head's own 4-bit weight through a Reshape.

Before 2026-12-05 neither was read: no input reached a constant table through a Gather, so
the token ids were not found ("input_ids and attention_mask both look like the mask", or "no
token-id input"), and every command but inspect exited 2. The builder's tied graph runs
through every command as a cell of tests/test_genai_graphs.py (inspect, verify and a
corrupted copy, optimize, serve token-identical to a plain loop); here: the roles, and
padding that leaves the embedding as it is.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from models import genai_builder
from tuner.cli import main
from tuner.graph.inspect import inspect_model
from tuner.graph.load import load_model
from tuner.graph.roles import input_specs

pytestmark = pytest.mark.venv(*genai_builder.VENV)  # built beside the first tests (conftest)


def _quantized_with_embedding(tmp_path) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    q = MatMulNBitsQuantizer(onnx.load(str(genai_builder.cached("llama", "fp32"))),
                             block_size=32, op_types_to_quantize=("MatMul", "Gather"),
                             quant_axes=(("MatMul", 0), ("Gather", 1)))
    q.process()
    return q.model.model


def _embedding(model: onnx.ModelProto) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.op_type == "GatherBlockQuantized")


def _tensor(path, name: str) -> np.ndarray:
    model = onnx.load(str(path))
    init = {i.name: i for i in model.graph.initializer}
    return onnx.numpy_helper.to_array(init[name])


@pytest.mark.parametrize("source", ["ort-quantizer", "genai-tied"])
def test_the_ids_are_found_and_padding_leaves_the_embedding_as_it_is(source, tmp_path):
    if source == "ort-quantizer":
        src = tmp_path / "model.onnx"
        onnx.save(_quantized_with_embedding(tmp_path), str(src), save_as_external_data=True,
                  location="model.onnx.data")
    else:
        src = genai_builder.cached("llama_tied", "int4")
    node = _embedding(onnx.load(str(src), load_external_data=False))
    roles = {s.name: s.role for s in input_specs(load_model(src))}
    assert roles["input_ids"] == "token_ids" and roles["attention_mask"] == "attention_mask"
    out = tmp_path / "padded.onnx"
    assert main(["pad", str(src), "-o", str(out), "--vocab-multiple", "64",
                 "--ffn-multiple", "64"]) == 0  # gated: greedy rollouts against src
    shape = inspect_model(load_model(out))
    assert (shape.vocab_size, shape.ffn_size) == (1024, 256)
    padded = onnx.load(str(out))
    kept = _embedding(padded)
    assert list(kept.input) == list(node.input)  # the same table, scales and shape
    table = kept.input[0]
    if source == "genai-tied":  # the LM head's blocks, reshaped: the head got its own copy
        reshape = next(n for n in padded.graph.node if n.output[0] == table)
        table = reshape.input[0]
        head = next(n for n in padded.graph.node if n.op_type == "MatMulNBits"
                    and "lm_head" in n.name)
        assert head.input[1] != table  # padded copy-on-write: the embedding reads the old
    assert np.array_equal(_tensor(out, table), _tensor(src, table))
