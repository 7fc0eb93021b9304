"""The KV cache of a decoder export, found from the graph's structure (read-only).

A cache export concatenates each layer's past keys/values (graph inputs) with the newly
projected ones along the sequence axis, and returns the result as `present`:

    past_k (graph input) ---------------\\
    x -> MatMul(Wk) -> ... (rotary) ---> Concat(axis=seq) --> present_k (graph output)
                                                          \\-> ... -> MatMul(q, k^T) -> Softmax
    past_v (graph input) ---------------\\
    x -> MatMul(Wv) -> ... ------------> Concat(axis=seq) --> present_v (graph output)
                                                          \\-> ... -> MatMul(Softmax, v)

So: a past tensor is a graph input that a Concat joins with a projection's output; it is a
key when the Concat's result is multiplied into scores that reach a Softmax, a value when it
is multiplied by a Softmax's output; K and V of one layer meet at the same Softmax. When the
Concat feeds a fused attention op instead (ONNX's opset-23 Attention), the op's input slot
says K or V. Graphs after ONNX Runtime's fusions have no Concat: the past goes straight into
the op's past_key/past_value slots and present comes out of it. Layers are numbered in
graph order. Names only break ties the structure leaves open, never override it.

Over 400 lines on purpose: finding the cache is one search (joins, their classification,
fused ops, GroupQueryAttention's packed dims, the widened-cache record), and its helpers
read best beside the search that uses them.
"""

from __future__ import annotations

import json
import re
from collections import deque
from dataclasses import dataclass, replace
from typing import Literal

import onnx_ir as ir

from tuner.graph.windowed import windowed_cache
from tuner.graph.walk import (DATA_INPUTS, MS, as_linear, const_array, consumers, is_const, op,
                              source, walk_back, walk_forward)

Role = Literal["key", "value"]
# Ops between a cache Concat and the attention MatMuls: head transposes, GQA's repeat_kv
# (Unsqueeze -> Expand -> Reshape), TorchScript's sqrt(scale) Mul on k, casts.
_TO_ATTENTION = {"Transpose", "Reshape", "Unsqueeze", "Squeeze", "Expand", "Tile", "Mul", "Div",
                 "Cast", "Identity", "Slice", "Gather", "QuantizeLinear", "DequantizeLinear",
                 "DynamicQuantizeLinear"}  # Optimum's ORTQuantizer: q @ k^T as MatMulInteger
# Ops between the score MatMul and the Softmax: scale, mask Add/Where, soft-capping, GPT-OSS's
# Concat of a sink logit per head.
_TO_SOFTMAX = {"Mul", "Div", "Add", "Sub", "Where", "Cast", "Identity", "Tanh", "Slice",
               "Reshape", "Transpose", "Concat", "QuantizeLinear", "DequantizeLinear"}
# Ops between a Softmax and the MatMul with v (positions of the data input): sdpa's
# Where(isnan(p), 0, p) guard for fully masked rows, dropout, casts, the Slice that drops
# GPT-OSS's sink column.
_PROBS_THROUGH = {"Cast": (0,), "Identity": (0,), "Reshape": (0,), "Dropout": (0,),
                  "Where": (1, 2), "Slice": (0,), "QuantizeLinear": (0,),
                  "DequantizeLinear": (0,), "DynamicQuantizeLinear": (0,)}
_WALK_LIMIT = 24  # nodes per walk: the patterns above are a handful of ops deep
# Fused attention ops: (K slot, V slot) of their inputs.
_FUSED_KV = {"Attention": (1, 2), f"{MS}.MultiHeadAttention": (1, 2),
             f"{MS}.GroupQueryAttention": (1, 2)}
# Fused ops that append to the cache themselves: (past_key, past_value) input slots and
# (present_key, present_value) output slots; their caches are (B, kv_heads, P, d).
_FUSED_PAST = {"Attention": ((4, 5), (1, 2)), f"{MS}.MultiHeadAttention": ((6, 7), (1, 2)),
               f"{MS}.GroupQueryAttention": ((3, 4), (1, 2))}
# Besides walk.DATA_INPUTS, ops the new keys pass through after their projection: rotary
# ops, the Gather that picks k or v out of a fused projection viewed as (..., 3, d)
# (Bloom's and Falcon's `fused_qkv[..., 1, :]`), and a norm over each head's keys (Phi's
# qk_layernorm as LayerNormalization; Gemma 3's and Qwen 3's k_norm as opset 23's
# RMSNormalization, or ONNX Runtime's fused SimplifiedLayerNormalization).
_AFTER_PROJECTION = {"RotaryEmbedding": (0,), f"{MS}.RotaryEmbedding": (0,), "Gather": (0,),
                     "LayerNormalization": (0,), "RMSNormalization": (0,),
                     f"{MS}.SimplifiedLayerNormalization": (0,)}


@dataclass(frozen=True)
class CacheLayer:
    """One layer's cache tensors (graph input/output names) and the nodes appending to them.
    `index` is the layer's place in graph order."""

    index: int
    past_key: str
    past_value: str
    present_key: str | None  # None: the graph does not return this layer's cache
    present_value: str | None
    # The nodes that append the new positions (a Concat, or a fused attention op that takes
    # the past itself), by name, so a rewrite can find them again in its own copy.
    join_key: str
    join_value: str


@dataclass(frozen=True)
class KvCache:
    """What `tuner inspect` reports as `cache`. Layout letters: b batch, h kv heads, s
    sequence (past), d head dim, in axis order; "bhsd" is the Hugging Face layout."""

    num_layers: int
    num_kv_heads: int | None  # None: not static in the graph
    head_dim: int | None  # the keys' (and, unless value_head_dim says otherwise, the values')
    layout: str
    dtype: str  # numpy name, e.g. "float32"
    itemsize: int  # bytes per element
    bytes_per_token: int | None  # layers * kv heads * (key + value head dims) * itemsize
    batch_dim: str | None  # symbolic dim names (dim_param); None when static or unnamed
    past_dim: str | None
    present_dim: str | None  # past + seq, on present
    layers: tuple[CacheLayer, ...]
    named_by: Literal["structure", "names"] = "structure"  # did names decide a K/V role?
    # "positions": the mask is read entry by entry (any padding). "lengths": only each row's
    # count of ones is read (GroupQueryAttention's seqlens_k, computed from the mask inside
    # onnxruntime-genai's graphs): a row's entries must then start at index 0 (right padding);
    # tuner.gate.right_pad moves left-padded feeds there and back.
    mask: Literal["positions", "lengths"] = "positions"
    # onnxruntime-genai's windowed caches (tuner.graph.windowed): the layers whose cache
    # holds only their window, and the window; () and None elsewhere
    windowed_layers: tuple[int, ...] = ()
    window: int | None = None
    # the values' head dim where it is not the keys' (multi-head latent attention, as
    # DeepSeek-V2/V3 and Kimi K2 export it: keys carry the rotary part, values do not);
    # None: the values are head_dim wide too
    value_head_dim: int | None = None

    def __post_init__(self) -> None:
        if self.num_layers != len(self.layers):
            raise ValueError(f"num_layers {self.num_layers} != {len(self.layers)} layers listed")
        if sorted(self.layout) != sorted("bhsd"):
            raise ValueError(f"layout must order the letters b, h, s, d, not {self.layout!r}")
        if self.value_head_dim is not None and self.value_head_dim == self.head_dim:
            raise ValueError(f"value_head_dim {self.value_head_dim} is the keys' head dim: "
                             "leave it None")

    @property
    def pasts(self) -> set[str]:
        """Every layer's past key and value input names."""
        return {n for layer in self.layers for n in (layer.past_key, layer.past_value)}

    @property
    def values(self) -> set[str]:
        """Every layer's past and present value names (the tensors of the values' width)."""
        return {n for layer in self.layers for n in (layer.past_value, layer.present_value)
                if n is not None}

    @property
    def values_dim(self) -> int | None:
        """The values' head dim: value_head_dim where they have their own, else head_dim."""
        return self.value_head_dim or self.head_dim

    def dim_of(self, name: str) -> int | None:
        """The head dim of the past or present tensor `name`: the values' for a value, the
        keys' for anything else."""
        return self.values_dim if name in self.values else self.head_dim


@dataclass(frozen=True)
class _Join:
    """A node appending new keys/values to a past input; role and the attention it feeds
    (a Softmax, or the fused op) filled in when found."""

    node: ir.Node  # the Concat, or a fused attention op with a past slot
    past: ir.Value  # the graph input
    present: ir.Value | None  # the graph output it becomes
    axis: int  # the sequence axis, non-negative
    role: Role | None
    attention: ir.Node | None


# ---------------------------------------------------------------------------------------------
# Finding the joins


def _graph_input(v: ir.Value | None, inputs: set[int], depth: int = 0) -> ir.Value | None:
    """The graph input behind `v`: through Identity/Cast (a fp16 cache fed to a fp32 graph),
    and through the zero padding a head-dim/head-count rewrite puts on a kept cache (Pad,
    Slice, and a Concat of pieces of that one input: tuner.rewrite.axis.cache)."""
    while v is not None and depth < 16:
        if id(v) in inputs:
            return v
        p = v.producer()
        if p is None:
            return None
        if op(p) == "Concat":
            found = {id(x): x for x in (_graph_input(i, inputs, depth + 1) for i in p.inputs)}
            return next(iter(found.values())) if len(found) == 1 else None
        if op(p) not in ("Identity", "Cast", "Pad", "Slice"):
            return None
        v, depth = p.inputs[0], depth + 1
    return None


def _is_projected(v: ir.Value) -> bool:
    """Whether `v` is computed from a MatMul/Gemm (the new keys/values, after any rotary)."""
    def follow(node: ir.Node):
        kind = op(node)
        if kind in _AFTER_PROJECTION:
            return _AFTER_PROJECTION[kind]
        if kind not in DATA_INPUTS:
            return None
        return DATA_INPUTS[kind] or range(len(node.inputs))  # None there: every input

    gemms = ("MatMul", "Gemm", "MatMulInteger", f"{MS}.MatMulNBits", f"{MS}.MatMulBnb4")
    hits, _ = walk_back(v, follow, lambda x: op(x.producer()) in gemms,
                        limit=_WALK_LIMIT * 4)
    return bool(hits)


def _present(v: ir.Value, outputs: set[int]) -> ir.Value | None:
    """The graph output `v` is, directly or through Identity/Cast (or a Quantize- and
    DequantizeLinear round trip: ONNX Runtime's quantize_static puts one on a value cache)."""
    queue, seen = deque([v]), set()
    while queue:
        x = queue.popleft()
        if id(x) in outputs:
            return x
        if id(x) in seen:
            continue
        seen.add(id(x))
        # (Slice and Concat: a kept cache sliced back to its original entries)
        queue.extend(n.outputs[0] for n in consumers(x)
                     if op(n) in ("Identity", "Cast", "Slice", "Concat", "QuantizeLinear",
                                  "DequantizeLinear"))
    return None


def _join(node: ir.Node, inputs: set[int], outputs: set[int]) -> _Join | None:
    if op(node) != "Concat" or len(node.inputs) != 2 or any(is_const(i) for i in node.inputs):
        return None
    pasts = [_graph_input(i, inputs) for i in node.inputs]
    if sum(p is not None for p in pasts) != 1:
        return None
    past = next(p for p in pasts if p is not None)
    new = node.inputs[1] if pasts[0] is not None else node.inputs[0]
    rank = len(past.shape) if past.shape is not None else 0
    if rank != 4 or past.dtype is None or not past.dtype.is_floating_point():
        return None
    if new is None or not _is_projected(new):
        return None
    axis = node.attributes["axis"].as_int() if "axis" in node.attributes else 0
    return _Join(node, past, _present(node.outputs[0], outputs), axis % rank, None, None)


def _fused_joins(node: ir.Node, inputs: set[int], outputs: set[int]) -> list[_Join]:
    """The past_key/past_value slots of a fused attention op that graph inputs fill."""
    slots = _FUSED_PAST.get(op(node))
    if slots is None:
        return []
    joins = []
    for role, i, o in zip(("key", "value"), *slots):
        past = _graph_input(node.inputs[i], inputs) if i < len(node.inputs) else None
        if past is None or past.shape is None or len(past.shape) != 4:
            continue
        present = _present(node.outputs[o], outputs) if o < len(node.outputs) else None
        joins.append(_Join(node, past, present, 2, role, node))  # type: ignore[arg-type]
    return joins


# ---------------------------------------------------------------------------------------------
# Key or value: what the joined tensor meets on its way to the Softmax


def _forward(start: ir.Value, through: set[str], want) -> list[ir.Node]:
    """Nodes `want(node)` reached from `start` through ops in `through` (bounded BFS)."""
    return walk_forward(start, lambda node: op(node) in through, want, limit=_WALK_LIMIT)


def _softmax_before(v: ir.Value) -> ir.Node | None:
    """The Softmax whose output `v` is (through casts/reshapes/dropout)."""
    def follow(node: ir.Node):
        return _PROBS_THROUGH.get(op(node))

    hits, _ = walk_back(v, follow, lambda x: op(x.producer()) == "Softmax", limit=8)
    return hits[0].producer() if hits else None


def _classify(j: _Join) -> _Join:
    """The role the structure shows, and the attention (Softmax or fused op) it feeds."""
    if j.role is not None:
        return j  # a fused op's past slot said so already
    want = {"MatMul", "MatMulInteger", *_FUSED_KV}
    for mm in _forward(j.node.outputs[0], _TO_ATTENTION, lambda n: op(n) in want):
        if op(mm) in _FUSED_KV:
            k_slot, v_slot = _FUSED_KV[op(mm)]
            if len(mm.inputs) > v_slot and _reaches(mm.inputs[v_slot], j.node):
                return replace(j, role="value", attention=mm)
            if len(mm.inputs) > k_slot and _reaches(mm.inputs[k_slot], j.node):
                return replace(j, role="key", attention=mm)
            continue
        other = next((i for i in mm.inputs if i is not None and not _reaches(i, j.node)), None)
        soft = _softmax_before(other) if other is not None else None
        if soft is not None:  # probabilities @ v
            return replace(j, role="value", attention=soft)
        after = _forward(mm.outputs[0], _TO_SOFTMAX, lambda n: op(n) == "Softmax")
        if after:  # q @ k^T -> Softmax
            return replace(j, role="key", attention=after[0])
    return j


def _reaches(v: ir.Value | None, join: ir.Node) -> bool:
    """Whether `v` comes from `join` through the ops _forward follows (the cache side of a
    MatMul, as opposed to the query or the probabilities)."""
    def follow(node: ir.Node):
        return (0,) if op(node) in _TO_ATTENTION else None

    if v is None:
        return False
    hits, _ = walk_back(v, follow, lambda x: x.producer() is join, limit=_WALK_LIMIT)
    return bool(hits)


# ---------------------------------------------------------------------------------------------
# Names: the tie-breaker


def _name_role(name: str) -> Role | None:
    """"key"/"value" from names like past_key_values.0.key, past.0.k, pkv_0_v, cache_v_3."""
    words = set(re.split(r"[^a-z]+", name.lower()))
    is_key, is_value = bool(words & {"key", "k", "keys"}), bool(words & {"value", "v", "values"})
    return ("key" if is_key else "value") if is_key != is_value else None


def _name_layer(name: str) -> int | None:
    digits = re.findall(r"\d+", name)
    return int(digits[0]) if digits else None


def _pair(joins: list[_Join], order: dict[int, int]) -> tuple[list[tuple[_Join, _Join]], bool]:
    """(key, value) pairs in graph order, and whether names had to decide any of them."""
    named = False
    typed: list[_Join] = []
    for j in joins:
        if j.role is None:
            role = _name_role(j.past.name or "")
            if role is None:
                continue  # neither structure nor name says: not reported as cache
            named = True
            j = replace(j, role=role)
        typed.append(j)
    keys = [j for j in typed if j.role == "key"]
    values = [j for j in typed if j.role == "value"]
    pairs: list[tuple[_Join, _Join]] = []
    for k in sorted(keys, key=lambda j: order[id(j.node)]):
        match = [v for v in values if k.attention is not None and v.attention is k.attention]
        if not match:  # no shared attention seen: the same layer number in the names
            layer = _name_layer(k.past.name or "")
            match = [v for v in values if layer is not None and _name_layer(v.past.name or "") == layer]
            named = named or bool(match)
        if match:
            values.remove(match[0])
            pairs.append((k, match[0]))
    return pairs, named


# ---------------------------------------------------------------------------------------------
# Dims


def _layout(axis: int) -> str:
    """Letters per axis: batch first, the Concat axis is the sequence; of the two left, the
    earlier is heads and the later the head dim (bhsd, bshd, and GPT-2's old bhds key)."""
    letters = ["b", "", "", ""]
    letters[axis] = "s"
    rest = [i for i in range(1, 4) if i != axis]
    letters[rest[0]], letters[rest[1]] = "h", "d"
    return "".join(letters)


def _static(values: list[ir.Value | None], axis: int) -> int | None:
    """A static size of `axis` from the first of `values` whose shape knows it."""
    for v in values:
        if v is not None and v.shape is not None and len(v.shape) > axis:
            d = v.shape[axis]
            if isinstance(d, int):
                return d
    return None


def _symbol(v: ir.Value | None, axis: int) -> str | None:
    if v is None or v.shape is None or len(v.shape) <= axis:
        return None
    d = v.shape[axis]
    return d.value if isinstance(d, ir.SymbolicDim) else None


def _layer(index: int, k: _Join, v: _Join) -> CacheLayer:
    return CacheLayer(index, k.past.name or "", v.past.name or "",
                      k.present.name if k.present is not None else None,
                      v.present.name if v.present is not None else None,
                      k.node.name or "", v.node.name or "")


def _per_token(layers: int, heads: int | None, key_dim: int | None, value_dim: int | None,
               itemsize: int) -> int | None:
    """Bytes one position of every layer's keys and values takes; None where a dim is unknown."""
    if not (heads and key_dim and value_dim):
        return None
    return layers * heads * (key_dim + value_dim) * itemsize


def _cache(pairs: list[tuple[_Join, _Join]], named: bool) -> KvCache:
    k0, v0 = pairs[0]
    layout = _layout(v0.axis)  # the value's: a transposed key (bhds) still holds the same sizes
    heads_axis, dim_axis = layout.index("h"), layout.index("d")
    tensors = [v0.past, v0.present]
    heads, value_dim = _static(tensors, heads_axis), _static(tensors, dim_axis)
    # the key's own width, on its own head-dim axis (a transposed key's is elsewhere)
    key_dim = _static([k0.past, k0.present], _layout(k0.axis).index("d"))
    if heads is None or value_dim is None:  # onnxruntime-genai: `kv_cache_dim` is symbolic
        fused_heads, fused_dim = gqa_cache_dims(v0.node)
        heads, value_dim = heads or fused_heads, value_dim or fused_dim
    head_dim = key_dim or value_dim
    own = value_dim if value_dim and head_dim and value_dim != head_dim else None
    dtype = v0.past.dtype
    assert dtype is not None  # _join kept floating-point inputs only
    per_token = _per_token(len(pairs), heads, head_dim, own or head_dim, int(dtype.itemsize))
    return KvCache(
        num_layers=len(pairs), num_kv_heads=heads, head_dim=head_dim, layout=layout,
        dtype=str(dtype.numpy()), itemsize=int(dtype.itemsize), bytes_per_token=per_token,
        value_head_dim=own,
        batch_dim=_symbol(v0.past, 0), past_dim=_symbol(v0.past, v0.axis),
        present_dim=_symbol(v0.present, v0.axis),
        layers=tuple(_layer(i, k, v) for i, (k, v) in enumerate(pairs)),
        named_by="names" if named else "structure",
        mask="lengths" if any(op(j.node) == f"{MS}.GroupQueryAttention" for pair in pairs
                              for j in pair) else "positions")


def find_kv_cache(graph: ir.Graph) -> KvCache | None:
    """The graph's KV cache, or None when it has none (no past input that a Concat or a
    fused attention op appends to)."""
    inputs = {id(v) for v in graph.inputs}
    outputs = {id(v) for v in graph.outputs}
    order = {id(node): i for i, node in enumerate(graph)}
    joins = [_classify(j) for node in graph if (j := _join(node, inputs, outputs)) is not None]
    joins += [j for node in graph for j in _fused_joins(node, inputs, outputs)]
    pairs, named = _pair(joins, order)
    if not pairs:
        return None
    cache = _cache(pairs, named)
    windowed = windowed_cache(graph)
    if windowed is None:
        return cache
    return replace(cache, window=windowed.window, windowed_layers=tuple(
        layer.index for layer in cache.layers if layer.past_key in windowed.pasts))


def with_dims(cache: KvCache, kv_heads: int, head_dim: int) -> KvCache:
    """Fill dims the graph leaves symbolic from what inspect found in the attention blocks."""
    heads = cache.num_kv_heads or kv_heads or None
    dim = cache.head_dim or head_dim or None
    if heads == cache.num_kv_heads and dim == cache.head_dim:
        return cache
    per_token = _per_token(cache.num_layers, heads, dim, cache.value_head_dim or dim,
                           cache.itemsize)
    return replace(cache, num_kv_heads=heads, head_dim=dim, bytes_per_token=per_token)


# ---------------------------------------------------------------------------------------------
# A widened cache interface (docs/design.md's `widen` policy), as the rewrite records it

# metadata_props key: JSON {tensor name: [[axis, [new index of each old entry], new size], ..]}
# for every past input and present output whose shape the rewrite widened (one entry per
# widened axis: head dim, kv heads). Feeds of the original shape are scattered by it (zeros in
# the new entries), and presents are compared on the original entries through it.
WIDENED_KEY = "shapetuner.cache_widened"
CachePads = dict[str, tuple[tuple[int, tuple[int, ...], int], ...]]


def widened_cache(model: ir.Model) -> CachePads:
    """The widened cache tensors of a padded model ({} when its cache kept its shape)."""
    raw = model.metadata_props.get(WIDENED_KEY)
    if not raw:
        return {}
    return {name: tuple((int(a), tuple(int(p) for p in pos), int(n)) for a, pos, n in entries)
            for name, entries in json.loads(raw).items()}


# Ops between a projection and a fused attention's input that keep each token's width:
# Qwen3's and Gemma 3's q/k norms over each head (Reshape -> norm -> Reshape), casts.
_PER_TOKEN = {"Reshape", "Cast", "Identity", "SimplifiedLayerNormalization",
              "LayerNormalization", "RMSNormalization"}


def _projected_width(x: ir.Value | None) -> tuple[int, bool]:
    """(width, whole) of the projection whose output `x` is, through _PER_TOKEN ops: a
    linear layer's output width (whole: all of it), or the size of the Split output that
    `x` is (onnxruntime-genai's q/k-normed graphs split the packed QKV first); (0, True)
    when not found."""
    for _ in range(8):
        producer = source(x).producer() if source(x) is not None else None
        if producer is None:
            return 0, True
        lin = as_linear(producer)
        if lin is not None:
            return lin.out_dim, True
        if op(producer) == "Split":
            sizes = (const_array(producer.inputs[1]) if len(producer.inputs) > 1 else None)
            if sizes is None and "split" in producer.attributes:
                sizes = producer.attributes["split"].as_ints()
            index = next(i for i, o in enumerate(producer.outputs) if o is source(x))
            return (int(list(sizes)[index]), False) if sizes is not None else (0, True)
        if op(producer) not in _PER_TOKEN:
            return 0, True
        x = producer.inputs[0]
    return 0, True


def gqa_cache_dims(node: ir.Node) -> tuple[int | None, int | None]:
    """(kv heads, head dim) of a GroupQueryAttention from its attributes and the width of the
    projection feeding it: packed QKV (key/value slots empty, onnxruntime-genai's builder) is
    (heads + 2 kv heads) * d wide, a separate key projection kv heads * d."""
    if op(node) != f"{MS}.GroupQueryAttention":
        return None, None
    attrs = node.attributes
    heads = attrs["num_heads"].as_int() if "num_heads" in attrs else 0
    kv = attrs["kv_num_heads"].as_int() if "kv_num_heads" in attrs else 0
    packed = len(node.inputs) < 2 or node.inputs[1] is None
    width, whole = _projected_width(node.inputs[0] if packed else node.inputs[1])
    count = heads + 2 * kv if packed and whole else kv
    if not (kv and count and width and width % count == 0):
        return kv or None, None
    return kv, width // count
