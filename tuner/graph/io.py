"""Facts about a model as a whole: its precision, how many token ids it takes, how long a
sequence it takes, and which files make it up (input roles are tuner.graph.roles)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx_ir as ir

from tuner.graph.load import check_external_data, external_locations, load_model, read_proto
from tuner.graph.roles import TOKEN_IDS, input_specs, with_role
from tuner.graph.tables import embedding_tables
from tuner.graph.walk import const_scalar
from tuner.graph.shape import ModelShape

FALLBACK_VOCAB = 100  # token ids to draw when no table says how many there are


def quantizes_activations(model: ir.Model) -> bool:
    """Whether `model` quantizes activations with one range per run (ONNX Runtime's
    quantize_dynamic: DynamicQuantizeLinear), so a row's numbers depend on its run's others."""
    return any(n.op_type == "DynamicQuantizeLinear" for n in model.graph.all_nodes())


def model_precision(model) -> str:
    """"fp16" or "bf16" when the model computes in half precision (its float outputs, or most
    of its float weights, are), else "fp32". The gate's tolerances follow it."""
    if isinstance(model, (str, os.PathLike)):
        model = load_model(model)
    outs = {v.dtype.name for v in model.graph.outputs if v.dtype is not None}
    for half, name in (("FLOAT16", "fp16"), ("BFLOAT16", "bf16")):
        if half in outs:
            return name
    counts: dict[str, int] = {}
    for init in model.graph.initializers.values():
        if init.dtype is None or init.shape is None:
            continue
        size = int(np.prod([d if isinstance(d, int) else 1 for d in init.shape.dims]))
        counts[init.dtype.name] = counts.get(init.dtype.name, 0) + size
    floats = {k: v for k, v in counts.items() if k in ("FLOAT", "FLOAT16", "BFLOAT16", "DOUBLE")}
    top = max(floats, key=floats.get) if floats else "FLOAT"
    return {"FLOAT16": "fp16", "BFLOAT16": "bf16"}.get(top, "fp32")


def embedding_table(model: ir.Model, input_name: str) -> str | None:
    """The name of the embedding table that `input_name` indexes (a Gather on a 2-D
    initializer, through reshapes and casts); the largest when there are several."""
    value = next((v for v in model.graph.inputs if v.name == input_name), None)
    tables = embedding_tables(value) if value is not None else []
    return max(tables, key=lambda t: t[1][0])[0] if tables else None


def embedding_rows(model: ir.Model, input_name: str) -> int | None:
    """Rows of the embedding table that `input_name` indexes (a Gather on an initializer),
    following the input through reshapes and casts; None when no such Gather is found."""
    value = next((v for v in model.graph.inputs if v.name == input_name), None)
    tables = embedding_tables(value) if value is not None else []
    return max(shape[0] for _, shape in tables) if tables else None


def vocab_for_feeds(model: ir.Model, shape: ModelShape | None = None) -> int:
    """How many token ids the model takes: the rows of the table its token-id input indexes
    (found from the structure), else its vocabulary, else its embedding's rows."""
    token = with_role(input_specs(model), TOKEN_IDS)
    rows = embedding_rows(model, token.name) if token is not None else None
    if rows:
        return min(rows, shape.vocab_size) if shape is not None and shape.vocab_size else rows
    if shape is None:
        return FALLBACK_VOCAB
    if shape.vocab_size:
        return shape.vocab_size
    emb = model.graph.initializers.get(shape.sites.embedding or "")
    if emb is not None and emb.const_value is not None and len(emb.const_value.shape) == 2:
        return int(emb.const_value.shape[0])
    return FALLBACK_VOCAB


def _offset(indices: ir.Value | None) -> int:
    """What the positions are shifted by before they index their table: BART's, mBART's and
    OPT's learned positions start at row 2 (`arange(seq) + 2`), so 2 of the rows are never a
    position (a table of 258 takes 256 tokens). RoBERTa's (XLM-R's, CamemBERT's) count the
    tokens that are not padding, `cumsum(mask) * mask + padding_idx`: an inclusive CumSum
    starts at 1, one row more (roberta-base's table of 514 takes 512)."""
    producer = indices.producer() if indices is not None else None
    if producer is None or producer.op_type != "Add":
        return 0
    shifts = [const_scalar(v) for v in producer.inputs]
    shift = next((int(c) for c in shifts if c is not None and c == int(c) and c > 0), 0)
    counted = next((v for v, c in zip(producer.inputs, shifts) if c is None), None)
    return shift + (shift > 0 and _counts_from_one(counted))


def _counts_from_one(value: ir.Value | None, hops: int = 5) -> bool:
    """Whether `value` is an inclusive CumSum (through Casts, a Mul by the mask and an Add
    of 0: the past's length as traced)."""
    node = value.producer() if value is not None else None
    if node is None or hops == 0:
        return False
    if node.op_type == "CumSum":
        exclusive = node.attributes.get("exclusive")
        return not (exclusive is not None and exclusive.value)
    if node.op_type in ("Cast", "Mul"):
        return any(_counts_from_one(v, hops - 1) for v in node.inputs if v is not None)
    if node.op_type == "Add" and 0 in [const_scalar(v) for v in node.inputs]:  # + past length 0
        return any(_counts_from_one(v, hops - 1) for v in node.inputs if v is not None)
    return False


def max_positions(model: ir.Model, shape: ModelShape) -> int | None:
    """The longest sequence the model takes, where the graph holds its bound: the rows of a
    learned position table (a Gather on a (P, hidden) initializer that is not the token
    embedding) less the shift its indices get (`_offset`), or of a fused rotary operator's
    cos cache (`rotary_positions`), the fewer of the two; None if neither is there. The
    largest table wins: BERT's token-type table has 2 rows."""
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
            rows = int(dims[0]) - _offset(node.inputs[1] if len(node.inputs) > 1 else None)
            best = max(best or 0, rows)
    known = [n for n in (best, rotary_positions(model)) if n is not None]
    return min(known) if known else None


# Fused rotary operators and the input slot of their (positions, rotary dim / 2) cos cache:
# ONNX Runtime refuses a longer sequence ("cos_cache dimension 0 shall not be less than
# total_sequence_length"; onnxruntime-genai's builder makes it max_position_embeddings long).
_COS_CACHE_SLOT = {("com.microsoft", "GroupQueryAttention"): 7,
                   ("com.microsoft", "RotaryEmbedding"): 2,
                   ("", "RotaryEmbedding"): 1}


def rotary_positions(model: ir.Model) -> int | None:
    """The rows of the fused rotary operators' cos caches (the fewest), None without one."""
    rows = None
    for node in model.graph:
        domain = "" if node.domain == "ai.onnx" else node.domain
        slot = _COS_CACHE_SLOT.get((domain, node.op_type))
        if slot is None or len(node.inputs) <= slot or node.inputs[slot] is None:
            continue
        cos = node.inputs[slot]
        dims = cos.const_value.shape if cos.const_value is not None else cos.shape
        if dims is not None and len(dims) == 2 and isinstance(dims[0], int):
            rows = min(rows or dims[0], dims[0])
    return rows


def model_files(model_path: Path) -> list[Path]:
    """The .onnx file and the external-data files it names, in a stable order. The locations
    are checked first (inside the model's folder, present, long enough): a crafted entry must
    not make us read /dev/zero or a file elsewhere on the machine."""
    proto = read_proto(model_path)
    check_external_data(proto, model_path.parent)
    return [model_path] + [model_path.parent / loc for loc in external_locations(proto)]


def other_files(folder: Path) -> list[Path]:
    """Every file of an export folder that is no graph's and no graph's external data
    (configs, tokenizer, generation and preprocessor configs), in name order."""
    taken = {f for path in folder.glob("*.onnx") for f in model_files(path)}
    return [f for f in sorted(folder.iterdir()) if f.is_file() and f not in taken]


def model_bytes(path: str | os.PathLike) -> int:
    """The graph file plus every external-data file it names, whatever the exporter called
    them (`model.onnx.data`, `model.onnx_data`, one file per tensor): read from the graph, not
    globbed, since a folder can hold other models' data too. Missing files count 0 (the
    loader reports those)."""
    path = Path(path)
    files = {(path.parent / loc).resolve() for loc in external_locations(read_proto(path))}
    return path.stat().st_size + sum(f.stat().st_size for f in files if f.is_file())
