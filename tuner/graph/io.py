"""Facts about a model's inputs and files: which input plays which role, how many token ids it
takes, how long a sequence it takes, and which files make it up.

The one home for these facts: the gate's feeds, the benchmark, the pipeline and the server all
ask here instead of guessing on their own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import onnx_ir as ir

from tuner.graph.load import check_external_data, external_locations, load_model, read_proto
from tuner.graph.shape import ModelShape

# Roles of a graph input, recognised by name today (`*input_ids*`, `*attention_mask*`, ...).
TOKEN_IDS, ATTENTION_MASK, POSITION_IDS, TOKEN_TYPE_IDS, OTHER = (
    "token_ids", "attention_mask", "position_ids", "token_type_ids", "other")
# Ops a token id passes through unchanged on its way to the embedding Gather.
_PASS_THROUGH = {"Reshape", "Cast", "Identity", "Flatten", "Squeeze", "Unsqueeze"}
FALLBACK_VOCAB = 100  # token ids to draw when no table says how many there are


_NP_DTYPES = {"INT64": np.int64, "INT32": np.int32, "FLOAT": np.float32, "FLOAT16": np.float16,
              "DOUBLE": np.float64, "BOOL": np.bool_, "BFLOAT16": np.float32}


@dataclass(frozen=True)
class InputSpec:
    """One graph input: name, numpy dtype name, dims (int, or a str/None for a dynamic axis)."""

    name: str
    dtype: str
    dims: tuple[int | str | None, ...]

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("input spec needs a name")
        np.dtype(self.dtype)  # raises TypeError on an unknown dtype


def input_specs(model) -> list[InputSpec]:
    """The input specs of an onnx_ir.Model, a path to a .onnx file, or a list of InputSpec."""
    if isinstance(model, (list, tuple)) and all(isinstance(s, InputSpec) for s in model):
        return list(model)
    if isinstance(model, (str, os.PathLike)):
        model = load_model(model)
    specs = []
    initializers = set(model.graph.initializers)
    for v in model.graph.inputs:
        if v.name in initializers:
            continue
        dtype = _NP_DTYPES.get(v.dtype.name if v.dtype is not None else "FLOAT", np.float32)
        dims = tuple(d if isinstance(d, int) else (str(d) if d is not None else None)
                     for d in (v.shape.dims if v.shape is not None else ()))
        specs.append(InputSpec(v.name, np.dtype(dtype).name, dims))
    return specs


def role_of(name: str) -> str:
    """The role of an input called `name`."""
    n = name.lower()
    if "input_ids" in n or n in ("ids", "tokens"):
        return TOKEN_IDS
    if "attention_mask" in n or "mask" in n:
        return ATTENTION_MASK
    if "position_ids" in n:
        return POSITION_IDS
    if "token_type_ids" in n:
        return TOKEN_TYPE_IDS
    return OTHER


def token_input(names) -> str | None:
    """The input that holds token ids, among `names`."""
    return next((n for n in names if role_of(n) == TOKEN_IDS), None)


def mask_in(feed: Mapping[str, np.ndarray]) -> np.ndarray | None:
    """The (batch, seq) attention mask of a feed, if it has one."""
    for name, arr in feed.items():
        if "attention_mask" in name.lower() and arr.ndim == 2:
            return arr
    return None


def embedding_rows(model: ir.Model, input_name: str) -> int | None:
    """Rows of the embedding table that `input_name` indexes (a Gather on an initializer),
    following the input through reshapes and casts; None when no such Gather is found."""
    frontier, seen = [model.graph.inputs[i] for i, v in enumerate(model.graph.inputs)
                      if v.name == input_name], set()
    while frontier:
        value = frontier.pop()
        seen.add(value)
        for node, index in value.uses():
            if node.op_type == "Gather" and index == 1:
                table = node.inputs[0]
                if table is not None and table.const_value is not None \
                        and len(table.const_value.shape) == 2:
                    return int(table.const_value.shape[0])
            elif node.op_type in _PASS_THROUGH and index == 0:
                frontier.extend(o for o in node.outputs if o not in seen)
    return None


def vocab_for_feeds(model: ir.Model, shape: ModelShape) -> int:
    """How many token ids the model takes: its vocabulary, else its embedding's rows."""
    if shape.vocab_size:
        return shape.vocab_size
    emb = model.graph.initializers.get(shape.sites.embedding or "")
    if emb is not None and emb.const_value is not None and len(emb.const_value.shape) == 2:
        return int(emb.const_value.shape[0])
    return FALLBACK_VOCAB


def max_positions(model: ir.Model, shape: ModelShape) -> int | None:
    """The rows of a learned position table (a Gather on a (P, hidden) initializer that is
    not the token embedding), i.e. the longest sequence the model takes; None if absent.
    The largest such table wins: BERT's token-type table has 2 rows."""
    best = None
    for node in model.graph:
        if node.op_type != "Gather" or not node.inputs or node.inputs[0] is None:
            continue
        data = node.inputs[0]
        if data.const_value is None or data.name == shape.sites.embedding:
            continue
        dims = data.const_value.shape
        if len(dims) == 2 and int(dims[1]) == shape.hidden_size and int(dims[0]) >= 16 \
                and int(dims[0]) != shape.vocab_size:
            best = max(best or 0, int(dims[0]))
    return best


def model_files(model_path: Path) -> list[Path]:
    """The .onnx file and the external-data files it names, in a stable order. The locations
    are checked first (inside the model's folder, present, long enough): a crafted entry must
    not make us read /dev/zero or a file elsewhere on the machine."""
    proto = read_proto(model_path)
    check_external_data(proto, model_path.parent)
    return [model_path] + [model_path.parent / loc for loc in external_locations(proto)]
