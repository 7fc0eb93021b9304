"""The gate's branches, each reached through `tuner.gate.kv_gate.check` (what `tuner pad`,
`tuner verify` and optimize call) on real exported graphs edited to take that branch:

- greedy tokens differ: a variant whose logits carry a bump on one vocabulary entry, so its
  argmax is that entry at every step; with a tolerance loose enough that the logits themselves
  pass, the flipped token alone fails the gate;
- the compared-elements floor: a floor above what the feeds can compare fails every output
  ("nothing compared"), for cache models as for plain ones, and the table states the floor;
- a dtype mismatch: a variant that returns fp16 logits where the original returns fp32 fails,
  although its values round to within the default tolerance, cache model and plain model.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from models.build import cached
from tuner.gate.kv_gate import CacheFeeds, check, gate_feeds
from tuner.gate.verify import Tolerance
from tuner.graph.load import load_model
from tuner.runtime.ort import OrtRunner, load_cpu

CACHE = ("llama-kv", "awkward", "torchscript")
PLAIN = ("gpt2", "small", "torchscript")
LOOSE = Tolerance(atol=1e6, rtol=0)  # any logits pass: only the tokens can fail the gate


def _edit_logits(src, dst, make_nodes) -> None:
    """Rename the node output `logits` to `logits_inner` and let `make_nodes(vocab)` compute
    the graph's `logits` from it (returns the new nodes and the output's element type)."""
    proto = onnx.load(str(src))
    for node in proto.graph.node:
        node.output[:] = ["logits_inner" if o == "logits" else o for o in node.output]
    out = next(o for o in proto.graph.output if o.name == "logits")
    vocab = out.type.tensor_type.shape.dim[2].dim_value
    nodes, elem_type = make_nodes(vocab)
    proto.graph.node.extend(nodes)
    out.type.tensor_type.elem_type = elem_type
    onnx.save(proto, str(dst))


def _bump(token: int):
    def make(vocab: int):
        bump = np.zeros(vocab, np.float32)
        bump[token] = 1e3  # (V,) broadcast over (B, S, V)
        const = helper.make_node("Constant", [], ["bump"],
                                 value=numpy_helper.from_array(bump, "bump"))
        return [const, helper.make_node("Add", ["logits_inner", "bump"], ["logits"])], \
            TensorProto.FLOAT
    return make


def _to_fp16(vocab: int):
    return [helper.make_node("Cast", ["logits_inner"], ["logits"], to=TensorProto.FLOAT16)], \
        TensorProto.FLOAT16


def _gate(src, candidate, tolerance=Tolerance(), min_compared: int = 1):
    model = load_model(src)
    vocab = next(v for v in model.graph.outputs if v.name == "logits").shape[2]
    feeds = gate_feeds(model, vocab)
    return check(OrtRunner(load_cpu(src)), OrtRunner(load_cpu(candidate)), feeds, tolerance,
                 min_compared=min_compared), feeds


def test_a_flipped_greedy_token_alone_fails_the_cache_gate(tmp_path):
    src = cached(*CACHE)
    flipped = tmp_path / "flipped.onnx"
    _edit_logits(src, flipped, _bump(token=7))
    result, feeds = _gate(src, flipped, LOOSE)
    assert isinstance(feeds, CacheFeeds)
    logits = next(o for o in result.outputs if o.name == "logits")
    assert logits.passed  # within the loose tolerance: the token is what fails
    assert not result and any(e.endswith("step 0: greedy tokens differ") for e in result.errors)
    # the control: the same loose tolerance passes the original against itself
    same, _ = _gate(src, src, LOOSE)
    assert same and not same.errors


@pytest.mark.parametrize("which", ["cache", "plain"])
def test_the_compared_elements_floor_fails_closed(which):
    src = cached(*(CACHE if which == "cache" else PLAIN))
    passed, _ = _gate(src, src)
    assert passed and passed.min_compared == 1
    most = max(o.compared for o in passed.outputs)
    result, _ = _gate(src, src, min_compared=most + 1)
    assert not result and result.min_compared == most + 1
    assert all(not o.passed and o.reason.startswith("nothing compared: ") for o in result.outputs)
    assert f"the floor is {most + 1}" in result.outputs[0].reason
    assert f"at least {most + 1} compared element(s) per output" in result.table()
    with pytest.raises(ValueError, match="min_compared must be >= 1, not 0"):
        _gate(src, src, min_compared=0)


@pytest.mark.parametrize("which", ["cache", "plain"])
def test_a_variant_with_another_output_dtype_fails(which, tmp_path):
    src = cached(*(CACHE if which == "cache" else PLAIN))
    half = tmp_path / "fp16-logits.onnx"
    _edit_logits(src, half, _to_fp16)
    # at the default tolerances: fp16 logits of this model are within atol + rtol * |ref|
    # (the cache gate passed them before it compared dtypes)
    result, _ = _gate(src, half)
    logits = next(o for o in result.outputs if o.name == "logits")
    assert not result and not logits.passed
    assert "float16" in logits.reason and "float32" in logits.reason
