"""Which graph input plays which role (token ids, mask, positions, token types, KV cache,
inputs_embeds) and which of its axes is batch and which is sequence, found from the graph's
structure; names only break ties. The feeds, the gate, the benchmark's shapes and the server
all read roles here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from tuner.graph.dtypes import NUMPY_BY_ONNX, np_dtype  # noqa: F401 - np_dtype: callers' name
from tuner.graph.encoder_side import EncoderSide, find_encoder_side
from tuner.graph.kv_cache import find_kv_cache
from tuner.graph.load import load_model
from tuner.graph.pixels import PixelInput, pixel_input
from tuner.graph.role_names import (ATTENTION_MASK, ENCODER_CACHE, ENCODER_MASK,
                                    ENCODER_ROLES, ENCODER_STATES, INPUTS_EMBEDS, KV_CACHE,
                                    OTHER, PIXEL_VALUES, POSITION_IDS, ROLES, TOKEN_IDS,
                                    TOKEN_TYPE_IDS)
from tuner.graph.role_overrides import checked, with_overrides
from tuner.graph.tables import embedding_tables, gathered_table, tiled_table

_SEARCH_DEPTH = 24  # nodes followed from an input when looking for the mask or rotary path
_LARGE_NEGATIVE = -1e4  # a constant this negative (or finfo.min) marks an attention bias
# Fused ops' input slots that take the positions (they index their own cos/sin caches: no Cos
# or Sin is left to reach) and the mask (no Where or Softmax is left outside them: ONNX's
# Attention, as torch's dynamo export writes SDPA at opset 23, and ONNX Runtime's)
_POSITION_SLOTS = {("com.microsoft", "RotaryEmbedding"): 1, ("", "RotaryEmbedding"): 3,
                   ("com.microsoft", "GroupQueryAttention"): 9}
_MASK_SLOTS = {("", "Attention"): 3, ("com.microsoft", "Attention"): 3,
               ("com.microsoft", "MultiHeadAttention"): 4,
               ("com.microsoft", "GroupQueryAttention"): 5}
_SHAPE_ONLY = {"Shape", "Size"}  # their output is the input's shape, not its values: not followed

@dataclass(frozen=True)
class InputSpec:
    """One graph input: name, dtype name (numpy's, or "bfloat16"), dims (int, or a str/None
    for a dynamic axis), its role and which axes are batch and sequence (None: none)."""

    name: str
    dtype: str
    dims: tuple[int | str | None, ...]
    role: str = OTHER
    batch_axis: int | None = None
    seq_axis: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("input spec needs a name")
        np_dtype(self.dtype)  # raises TypeError on an unknown dtype
        if self.role not in ROLES:
            raise ValueError(f"input {self.name!r}: unknown role {self.role!r}")
        for what, axis in (("batch", self.batch_axis), ("sequence", self.seq_axis)):
            if axis is not None and not 0 <= axis < max(len(self.dims), 1):
                raise ValueError(f"input {self.name!r}: {what} axis {axis} is outside its "
                                 f"{len(self.dims)} dims")
        if self.batch_axis is not None and self.batch_axis == self.seq_axis:
            raise ValueError(f"input {self.name!r}: batch and sequence are the same axis")

    def fixed(self, axis: int | None) -> int | None:
        """The static size of `axis`, None when it is dynamic (or there is no such axis)."""
        if axis is None or axis >= len(self.dims):
            return None
        d = self.dims[axis]
        return d if isinstance(d, int) and d > 0 else None

    def to_json(self) -> dict:
        return {"name": self.name, "role": self.role, "dtype": self.dtype,
                "dims": [d if isinstance(d, int) else (d or None) for d in self.dims],
                "batch_axis": self.batch_axis, "seq_axis": self.seq_axis}


def _dims_of(v: ir.Value) -> tuple:
    return tuple(d if isinstance(d, int) else (str(d) if d is not None else None)
                 for d in (v.shape.dims if v.shape is not None else ()))


def _is_large_negative(value: ir.Value | None) -> bool:
    if value is None or value.const_value is None:
        return False
    try:
        arr = value.const_value.numpy()
    except Exception:  # noqa: BLE001 - an unreadable constant is simply not a bias marker
        return False
    if arr.size == 0 or arr.size > 64 or arr.dtype.kind != "f":
        return False
    return bool(np.any(arr.astype(np.float64) <= _LARGE_NEGATIVE))


def _reach(value: ir.Value) -> tuple[set[str], bool]:
    """Op types within _SEARCH_DEPTH nodes downstream of `value`, and whether any of them
    is an attention-bias marker (a Where condition, or arithmetic with a large negative)."""
    ops, bias = set(), False
    frontier, seen, depth = [value], set(), 0
    while frontier and depth < _SEARCH_DEPTH:
        nxt = []
        for v in frontier:
            for node, index in v.uses():
                if node in seen:
                    continue
                seen.add(node)
                ops.add(node.op_type)
                if node.op_type in _SHAPE_ONLY:
                    continue
                if (node.op_type == "Where" and index == 0) or _MASK_SLOTS.get(
                        (node.domain, node.op_type)) == index:
                    bias = True
                if node.op_type in ("Mul", "Sub", "Add", "Where", "Max", "Min") and any(
                        _is_large_negative(i) for i in node.inputs):
                    bias = True
                if gathered_table(node, index) or _POSITION_SLOTS.get(
                        (node.domain, node.op_type)) == index:
                    ops.add("GatherConst")
                if node.op_type == "GatherElements" and index == 1 and tiled_table(
                        node.inputs[0]):
                    ops.add("GatherConst")  # GPT-J: torch.gather(sin/cos table, positions)
                nxt.extend(node.outputs)
        frontier, depth = nxt, depth + 1
    return ops, bias


def _name_role(name: str) -> str:
    """The role a name suggests (the tie-breaker only)."""
    n = name.lower()
    if "input_ids" in n or n in ("ids", "tokens"):
        return TOKEN_IDS
    if "position" in n:
        return POSITION_IDS
    if "token_type" in n or "segment" in n:
        return TOKEN_TYPE_IDS
    if "mask" in n:
        return ATTENTION_MASK
    if "past" in n or "cache" in n:
        return KV_CACHE
    if "embeds" in n:
        return INPUTS_EMBEDS
    return OTHER


def _cache_inputs(model: ir.Model) -> set[str]:
    """The past key/value inputs tuner.graph.kv_cache finds (the one cache detector)."""
    cache = find_kv_cache(model.graph)
    if cache is None:
        return set()
    return cache.pasts


def _length_is_total(v: ir.Value, ref_seq: str | None) -> bool:
    """True when `v`'s length axis (its last) is past + seq: a symbol other than the token
    ids' sequence (a mask beside a KV cache), or one spelled as a sum."""
    dims = _dims_of(v)
    if len(dims) < 2 or not isinstance(dims[-1], str):
        return False
    return "+" in dims[-1] or (ref_seq is not None and dims[-1] != ref_seq)


def _integer_roles(ints: list[ir.Value], has_cache: bool, ref_seq: str | None) -> dict[str, str]:
    """Mask, positions or a name's guess for the integer inputs that index no table.

    The evidence is ranked (transformers 4.5x routes position ids into the mask construction
    too, so "reaches a Where" alone cannot tell them apart): reaching Cos/Sin or a constant
    table (a rotary cache, position embeddings) says positions; a length of past + seq beside
    a cache, with a path to the bias (Where, large negative, Softmax), says mask. An input
    with both kinds of evidence but a seq length is positions when another input is plainly
    the mask, else the mask (a model whose mask also builds its positions)."""
    evidence = {}
    for v in ints:
        ops, bias = _reach(v)
        rotary = bool({"Cos", "Sin", "GatherConst"} & ops)
        masky = bias or "Where" in ops or "Softmax" in ops
        total = has_cache and _length_is_total(v, ref_seq)
        evidence[v.name] = (rotary, masky, total)
    plain_mask = {n for n, (rot, masky, total) in evidence.items() if masky and (total or not rot)}
    roles = {}
    for v in ints:
        rot, masky, total = evidence[v.name]
        if rot and not masky:
            roles[v.name] = POSITION_IDS
        elif masky and (total or not rot):
            roles[v.name] = ATTENTION_MASK
        elif rot and masky:
            roles[v.name] = POSITION_IDS if plain_mask - {v.name} else ATTENTION_MASK
        else:
            guess = _name_role(v.name)
            roles[v.name] = guess if guess in (ATTENTION_MASK, POSITION_IDS, TOKEN_TYPE_IDS) else OTHER
    return roles


def _float_role(v: ir.Value, pasts: set[str]) -> str:
    """The KV cache (concatenated with the new keys/values), a float mask, or embeddings."""
    rank = len(_dims_of(v))
    if v.name in pasts:
        return KV_CACHE
    if rank == 2 and _reach(v)[1]:
        return ATTENTION_MASK  # a float mask (1 keep, 0 pad) or a bias
    if rank == 3:
        return INPUTS_EMBEDS
    return _name_role(v.name) if _name_role(v.name) in (KV_CACHE, INPUTS_EMBEDS) else OTHER


def _encoder_roles(side: EncoderSide | None) -> dict[str, str]:
    """The roles of what an encoder-decoder's decoder takes from its encoder."""
    if side is None:
        return {}
    roles = {name: ENCODER_CACHE for name in side.cache}
    if side.states:
        roles[side.states] = ENCODER_STATES
    if side.mask:
        roles[side.mask] = ENCODER_MASK
    return roles


def _roles(model: ir.Model, inputs: list[ir.Value]
           ) -> tuple[dict[str, str], EncoderSide | None, PixelInput | None]:
    """Each input's role from the structure around it (see the module's docstring), an
    encoder-decoder's encoder side (tuner.graph.encoder_side) and an image transformer's
    pixels (tuner.graph.pixels); None for the others."""
    roles: dict[str, str] = {}
    tables = {v.name: embedding_tables(v) for v in inputs}
    kinds = {v.name: (v.dtype.name if v.dtype is not None else "FLOAT") for v in inputs}
    integer = [v for v in inputs if kinds[v.name] in ("INT64", "INT32", "INT16", "INT8", "UINT8")]
    indexing = [v for v in integer if tables[v.name]]
    # token ids index the largest table; a name breaks a tie
    if indexing:
        def rows(v):
            return max(shape[0] for _, shape in tables[v.name])
        token = max(indexing, key=lambda v: (rows(v), _name_role(v.name) == TOKEN_IDS))
        roles[token.name] = TOKEN_IDS
        for v in indexing:
            if v is token:
                continue
            small = rows(v) <= 16 and _name_role(v.name) != POSITION_IDS
            roles[v.name] = TOKEN_TYPE_IDS if small else POSITION_IDS
    token = next((v for v in inputs if roles.get(v.name) == TOKEN_IDS), None)
    pasts = _cache_inputs(model)
    side = find_encoder_side(model.graph, token, pasts)
    roles.update(_encoder_roles(side))
    pixels = pixel_input(model.graph)
    if pixels is not None:
        roles[pixels.name] = PIXEL_VALUES
    floats = [v for v in inputs if kinds[v.name] in ("FLOAT", "FLOAT16", "BFLOAT16", "DOUBLE")
              and v.name not in roles]
    roles.update({v.name: _float_role(v, pasts) for v in floats})
    token_dims = _dims_of(token) if token is not None else ()
    ref_seq = token_dims[-1] if token_dims and isinstance(token_dims[-1], str) else None
    has_cache = KV_CACHE in roles.values()
    rest = [v for v in inputs if v.name not in roles]  # integer and bool inputs
    roles.update(_integer_roles(rest, has_cache, ref_seq))
    return roles, side, pixels


def _axes(spec_dims: tuple, role: str, ref: tuple,
          encoder_length: str | None = None) -> tuple[int | None, int | None]:
    """(batch axis, sequence axis) of one input: symbols shared with the reference input
    (the token ids, else the embeddings) first, the (batch, seq, ...) convention after. What
    a decoder takes from its encoder runs along the encoder's length instead."""
    rank = len(spec_dims)
    if rank == 0:
        return None, None
    if role in ENCODER_ROLES and encoder_length in spec_dims:
        return 0, spec_dims.index(encoder_length)
    if role == PIXEL_VALUES:
        return 0, None  # (batch, channels, height, width): no sequence
    if role == OTHER and not any(isinstance(d, str) for d in spec_dims):
        return None, None
    b_sym = ref[0] if len(ref) >= 2 and isinstance(ref[0], str) else None
    s_sym = ref[1] if len(ref) >= 2 and isinstance(ref[1], str) else None
    batch = spec_dims.index(b_sym) if b_sym and b_sym in spec_dims else None
    seq = spec_dims.index(s_sym) if s_sym and s_sym in spec_dims and \
        spec_dims.index(s_sym) != batch else None
    if rank == 1:
        return None, (seq if seq is not None else 0)
    if batch is None:
        batch = 0
    if seq is None:
        if role == KV_CACHE and rank >= 3:
            dynamic = [i for i, d in enumerate(spec_dims) if not isinstance(d, int) and i != batch]
            seq = dynamic[0] if dynamic else rank - 2
        else:
            seq = 1 if batch != 1 else 0
    return batch, seq


def input_specs(model) -> list[InputSpec]:
    """The input specs of an onnx_ir.Model, a path to a .onnx file, or a list of InputSpec:
    dtype, dims, role and (batch, seq) axes of every graph input."""
    if isinstance(model, (list, tuple)) and all(isinstance(s, InputSpec) for s in model):
        return [_completed(s) for s in model]
    if isinstance(model, (str, os.PathLike)):
        model = load_model(model)
    initializers = set(model.graph.initializers)
    inputs = [v for v in model.graph.inputs if v.name not in initializers]
    found, side, pixels = _roles(model, inputs)
    roles = checked(with_overrides(found, [v.name for v in inputs]))
    ref_value = next((v for v in inputs if roles[v.name] == TOKEN_IDS), None) or next(
        (v for v in inputs if roles[v.name] == INPUTS_EMBEDS), None)
    ref = _dims_of(ref_value) if ref_value is not None else ()
    specs = []
    for v in inputs:
        dtype = NUMPY_BY_ONNX.get(v.dtype.name if v.dtype is not None else "FLOAT", "float32")
        dims = _dims_of(v)
        if roles[v.name] == PIXEL_VALUES and pixels is not None and v.name == pixels.name:
            dims = _pixel_dims(dims, pixels)
        batch, seq = _axes(dims, roles[v.name], ref, side.length if side else None)
        specs.append(InputSpec(v.name, dtype, dims, roles[v.name], batch, seq))
    return specs


def _pixel_dims(dims: tuple, pixels: PixelInput) -> tuple:
    """(batch, channels, height, width) with the one size the graph takes filled in (its
    export declares every axis symbolic: tuner.graph.pixels reads them)."""
    return (dims[0], pixels.channels, pixels.height, pixels.width)


def _completed(spec: InputSpec) -> InputSpec:
    """A spec built by hand (no role, no axes: no graph to read them from) gets what its name
    suggests and the (batch, seq, ...) convention; specs read from a graph stay as they are."""
    if spec.role != OTHER or spec.batch_axis is not None or spec.seq_axis is not None:
        return spec
    role = _name_role(spec.name)
    batch, seq = _axes(spec.dims, role, ())
    return replace(spec, role=role, batch_axis=batch, seq_axis=seq)


def role_of(name: str, specs: Sequence[InputSpec] | None = None) -> str:
    """The role of the input called `name`: from `specs` (structure) when given, else what
    the name suggests."""
    for s in specs or ():
        if s.name == name:
            return s.role
    return _name_role(name)


def with_role(specs: Sequence[InputSpec], role: str) -> InputSpec | None:
    """The first input that plays `role`, None when none does."""
    return next((s for s in specs if s.role == role), None)


def token_input(names_or_specs) -> str | None:
    """The input that holds token ids: from specs (structure), or among names (by name)."""
    items = list(names_or_specs)
    if items and all(isinstance(s, InputSpec) for s in items):
        found = with_role(items, TOKEN_IDS)
        return found.name if found else None
    return next((n for n in items if _name_role(n) == TOKEN_IDS), None)


def mask_in(feed: Mapping[str, np.ndarray],
            specs: Sequence[InputSpec] | None = None) -> np.ndarray | None:
    """The (batch, seq) attention mask of a feed, if it has one: the input whose role is the
    mask when `specs` are given, else the one named like a mask."""
    if specs:
        mask = with_role(specs, ATTENTION_MASK)
        arr = feed.get(mask.name) if mask is not None else None
        return arr if arr is not None and arr.ndim == 2 else None
    for name, arr in feed.items():
        if _name_role(name) == ATTENTION_MASK and arr.ndim == 2:
            return arr
    return None


def batch_limit(specs: Sequence[InputSpec]) -> int | None:
    """The batch size every input fixes (1 for a batch-1 export), None when it is dynamic."""
    fixed = {s.fixed(s.batch_axis) for s in specs if s.batch_axis is not None}
    fixed.discard(None)
    return min(fixed) if fixed else None


def seq_limit(specs: Sequence[InputSpec]) -> int | None:
    """The sequence length the token inputs fix (a fully static export), None if dynamic."""
    fixed = {s.fixed(s.seq_axis) for s in specs
             if s.seq_axis is not None and s.role in (TOKEN_IDS, ATTENTION_MASK, POSITION_IDS,
                                                      TOKEN_TYPE_IDS, INPUTS_EMBEDS)}
    fixed.discard(None)
    return min(fixed) if fixed else None


def accepted_shapes(specs: Sequence[InputSpec], shapes) -> list[tuple[int, int]]:
    """`shapes` ((batch, seq) pairs) mapped onto what the model takes, in order, without
    repeats: a fixed batch or sequence replaces the asked one."""
    b_fix, s_fix = batch_limit(specs), seq_limit(specs)
    out: list[tuple[int, int]] = []
    for b, s in shapes:
        shape = (b_fix or b, s_fix or s)
        if shape not in out:
            out.append(shape)
    return out


def accepts(specs: Sequence[InputSpec], batch: int, seq: int) -> bool:
    """True when the model takes a (batch, seq) feed."""
    b_fix, s_fix = batch_limit(specs), seq_limit(specs)
    return (b_fix is None or batch == b_fix) and (s_fix is None or seq == s_fix)
