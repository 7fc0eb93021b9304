"""Attention blocks, found by structure: two batched MatMuls of activations with a Softmax
between them.

    x --q--> ... (B, a, S, d) --.
    x --k--> ... (B, kv->a, d, S) --MatMul--> scores (B, a, S, S) --[scale, mask]--> Softmax
    x --v--> ... (B, a, S, d) ---------------------------------------------MatMul--> (B, a, S, d)
                                                          --merge heads--> o --> (B, S, h)

From the Q/K/V MatMuls back to their projections the walk passes only head plumbing
(Reshape/Transpose/Split/Slice/Concat), rotary (Mul by cos/sin tables, Neg) and scaling
(Mul/Div by a scalar): those nodes are the sites a head-dim rewrite must touch.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from tuner.graph.dims import Dims
from tuner.graph.head_counts import head_counts
from tuner.graph.shape import AttentionSite, ScaleSite
from tuner.graph.walk import (DATA_INPUTS, Linear, as_linear, const_tensor, consumers,
                              folded_scalar, is_const, op, walk_back)

# Concat: GPT-OSS appends a learned "sink" logit per head to the scores, and Slices its
# probability off again before probs @ v
_SCORES_PATH = {"Add": None, "Sub": None, "Mul": None, "Div": None, "Where": (1, 2),
                "Cast": (0,), "Reshape": (0,), "Tanh": (0,), "Identity": (0,), "Concat": (0,),
                "QuantizeLinear": (0,), "DequantizeLinear": (0,)}
_PROBS_PATH = {"Where", "IsNaN", "Cast", "Dropout", "Identity", "Reshape",  # BLOOM: (B*a, S, S)
               "Slice", "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"}
_MERGE_PATH = {"Transpose", "Reshape", "Identity", "Cast", "DynamicQuantizeLinear", "QuantizeLinear",
               "DequantizeLinear"}
_HEAD_PLUMBING = {"Reshape", "Split", "Slice"}


@dataclass(frozen=True)
class AttnMatch:
    order: int  # position in the graph, to pair blocks with layers
    site: AttentionSite
    projection_nodes: tuple[ir.Node, ...]
    num_heads: int = 0  # 0: not found
    num_kv_heads: int = 0
    head_dim: int = 0


def _follow(table: dict[str, tuple[int, ...] | None]):
    def follow(node: ir.Node):
        kind = op(node)
        if kind not in table:
            return None
        pos = table[kind]
        return range(len(node.inputs)) if pos is None else pos
    return follow


def _is_activation_matmul(node: ir.Node | None) -> bool:
    """A MatMul of two activations (q @ k^T, probs @ v), not a projection onto a weight; or
    ONNX Runtime's dynamic quantization of one (Optimum's ORTQuantizer quantizes these too):
    MatMulInteger of two DynamicQuantizeLinear outputs, then Cast -> Mul (`_float_output`)."""
    if node is None or op(node) not in ("MatMul", "MatMulInteger") or len(node.inputs) < 2:
        return False
    if is_const(node.inputs[0]) or is_const(node.inputs[1]) or as_linear(node) is not None:
        return False
    return op(node) == "MatMul" or all(
        op(i.producer()) == "DynamicQuantizeLinear" for i in node.inputs[:2] if i is not None)


def _dequantizing_tail(node: ir.Node) -> list[ir.Node]:
    """The Cast -> Mul(scale) after a MatMulInteger of activations (its float result is the
    Mul's output); [] for a plain MatMul."""
    if op(node) != "MatMulInteger":
        return []
    cast = consumers(node.outputs[0])
    if len(cast) != 1 or op(cast[0]) != "Cast":
        return []
    mul = consumers(cast[0].outputs[0])
    return [cast[0], mul[0]] if len(mul) == 1 and op(mul[0]) == "Mul" else []


def _float_output(node: ir.Node) -> ir.Value:
    """An activation MatMul's float result (after a MatMulInteger's dequantizing Mul)."""
    tail = _dequantizing_tail(node)
    return tail[-1].outputs[0] if tail else node.outputs[0]


def _forward(start: ir.Value, through: set[str], want, depth: int = 8):
    """First consumer `want(node, value)` accepts, walking forward through `through` ops."""
    frontier, walked = [start], []
    for _ in range(depth):
        nxt = []
        for v in frontier:
            for user in consumers(v):
                if want(user, v):
                    return user, walked
                if op(user) in through:
                    walked.append(user)
                    nxt.extend(user.outputs)
        frontier = nxt
    return None, walked


@dataclass
class _Path:
    """What one walk from a Q/K/V MatMul input back to its projection passed through."""

    linears: list[Linear]
    plumbing: list[ir.Node]
    scale_const: float  # product of constant factors applied along the way
    scale_nodes: list[ir.Node]
    computed: bool  # a factor computed at run time (TorchScript: from the shape)
    rotary: list[ir.Node]  # Mul nodes by cos/sin tables


def operand_kind(v: ir.Value, depth: int = 32) -> str:
    """What a non-constant Mul/Div operand beside the Q/K data is made of: "data" (it comes
    from a projection), "rotary" (a cos/sin table), "computed" (a scalar computed from a
    shape, TorchScript's 1/sqrt(d)), or "other". Walks producers without entering Shape's
    input, so a scale computed from q's own shape does not count as q, nor Cos/Sin's input
    (HF builds the tables from a MatMul of inv_freq by the positions, not from the data).
    Deep enough for Gemma 3's K: projection, q/k RMSNorm, rotary, GQA repeat, scale."""
    kinds: set[str] = set()
    frontier, seen = [v], set()
    for _ in range(depth):
        nxt = []
        for value in frontier:
            node = value.producer()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            if as_linear(node) is not None or _is_activation_matmul(node):
                return "data"
            kinds.add(op(node))
            if _table_lookup(node):
                kinds.add("Cos")  # GPT-J: sin/cos precomputed as a table, gathered by position
                continue
            if op(node) not in ("Shape", "Cos", "Sin"):
                nxt.extend(i for i in node.inputs if i is not None)
        frontier = nxt
    if kinds & {"Cos", "Sin"}:
        return "rotary"
    if "Sqrt" in kinds and "Shape" in kinds:
        return "computed"
    return "other"


def _table_lookup(node: ir.Node) -> bool:
    """A Gather of rows from a 2-D float constant (a precomputed sin/cos position table;
    dynamo writes GatherND)."""
    if op(node) not in ("Gather", "GatherND") or len(node.inputs) < 2:
        return False
    t = const_tensor(node.inputs[0])
    return t is not None and len(t.shape) == 2 and t.dtype.is_floating_point()


def _factor(node: ir.Node) -> tuple[str, float | None]:
    """("const", f) / ("computed", None) / ("rotary", None) / ("", None) for a Mul/Div."""
    kind = op(node)
    if kind not in ("Mul", "Div"):
        return "", None
    for i, v in enumerate(node.inputs):
        f = folded_scalar(v)
        if f is not None:
            if kind == "Div":
                if i == 0:
                    return "", None  # c / x is not a scale
                f = 1.0 / f
            return "const", f
    kinds = [operand_kind(v) for v in node.inputs if v is not None and not is_const(v)]
    if "rotary" in kinds:
        return "rotary", None
    if "computed" in kinds:
        return "computed", None
    return "", None


ROTARY_OPS = {"RotaryEmbedding", "com.microsoft.RotaryEmbedding"}


def _projection_follow(node: ir.Node):
    """DATA_INPUTS, except that a Mul/Div does not lead into its cos/sin or scale operand."""
    kind = op(node)
    if kind in ROTARY_OPS:
        return (0,)
    if kind in ("LayerNormalization", "RMSNormalization"):
        return (0,)  # q/k LayerNorm over the head dim (Phi and StableLM with qk_layernorm)
    if kind in ("Gather", "GatherND") and is_const(node.inputs[1]):
        # Falcon picks k and v out of the fused qkv by constant index: qkv[..., [-2], :]
        # (TorchScript: Gather; dynamo: Transpose, GatherND, Transpose).
        return (0,)
    if kind not in DATA_INPUTS:
        return None
    if kind in ("Mul", "Div"):
        return [i for i, v in enumerate(node.inputs)
                if v is not None and not is_const(v) and operand_kind(v) == "data"]
    pos = DATA_INPUTS[kind]
    return range(len(node.inputs)) if pos is None else pos


def walk_projection(start: ir.Value, by_output: dict[int, Linear]) -> _Path:
    """From a Q/K/V tensor back to its projection(s), noting plumbing, scales and rotary."""
    hits, walked = walk_back(start, _projection_follow, lambda v: id(v) in by_output, limit=200)
    lins: list[Linear] = []
    for v in hits:
        if by_output[id(v)] not in lins:
            lins.append(by_output[id(v)])
    path = _Path(lins, [n for n in walked if op(n) in _HEAD_PLUMBING], 1.0, [], False, [])
    for n in walked:
        kind, f = _factor(n)
        if kind == "const" and f is not None:
            path.scale_const *= f
            path.scale_nodes.append(n)
        elif kind == "computed":
            path.computed = True
            path.scale_nodes.append(n)
        elif kind == "rotary" or op(n) in ROTARY_OPS:
            path.rotary.append(n)
    return path


def _scores_matmul(softmax: ir.Node) -> tuple[ir.Node | None, list[ir.Node]]:
    """The q @ k^T MatMul feeding `softmax`, and the nodes between them on the scores' own
    path (a scale applied after the MatMul lives there; the mask's branch does not)."""
    hits, _ = walk_back(softmax.inputs[0], _follow(_SCORES_PATH),
                        lambda v: _is_activation_matmul(v.producer()), limit=40)
    nodes = {id(v.producer()): v.producer() for v in hits}
    if len(nodes) != 1:
        return None, []
    scores = next(iter(nodes.values()))
    _, between = _forward(_float_output(scores), set(_SCORES_PATH), lambda n, v: n is softmax)
    return scores, between


def _rotated_dims(node: ir.Node, dims: Dims) -> int:
    if op(node) in ROTARY_OPS:
        attr = node.attributes.get("rotary_embedding_dim")
        if attr is not None and attr.value:
            return int(attr.value)
    return dims.static(node.outputs[0], -1) or 0


def rotary_of(q: _Path, d: int, dims: Dims) -> tuple[str, int | None]:
    """("none" | "full" | "partial", rotated dims per head) for a Q path."""
    if not q.rotary:
        return "none", None
    r = max(_rotated_dims(n, dims) for n in q.rotary) or None
    if r is not None and 2 * r == d and sum(op(n) == "Mul" for n in q.rotary) >= 4:
        r = d  # both halves rotated apart, each by cos and by sin, then joined (GPT-OSS)
    if r is None or not d:
        # No shapes: partial rotary concatenates the rotated part with a pass-through slice.
        partial = any(op(n) == "Slice" for n in q.plumbing) and len(q.plumbing) > 4
        return ("partial" if partial else "full"), None
    return ("partial" if r < d else "full"), r


def match_attention(softmax: ir.Node, by_output: dict[int, Linear], dims: Dims,
                    order: int) -> AttnMatch | None:
    scores, scores_walk = _scores_matmul(softmax)
    if scores is None:
        return None
    pv, _ = _forward(softmax.outputs[0], _PROBS_PATH,
                     lambda n, v: _is_activation_matmul(n) and n.inputs[0] is v)
    if pv is None:
        return None
    q = walk_projection(scores.inputs[0], by_output)
    k = walk_projection(scores.inputs[1], by_output)
    v = walk_projection(pv.inputs[1], by_output)
    if not (q.linears and k.linears and v.linears):
        return None
    o, merge = _forward(_float_output(pv), _MERGE_PATH,
                        lambda n, val: id(n.outputs[0]) in by_output
                        and by_output[id(n.outputs[0])].node is n and n.inputs[0] is val)
    if o is None:
        return None
    fused_qkv = q.linears[0] is k.linears[0] is v.linears[0]

    computed = q.computed or k.computed
    factors = q.scale_const * k.scale_const
    scale_nodes = q.scale_nodes + k.scale_nodes
    for n in scores_walk:
        kind, f = _factor(n)
        if kind == "const" and f is not None:
            factors *= f
            scale_nodes.append(n)
        elif kind == "computed":
            computed = True
            scale_nodes.append(n)
    if computed:
        scale = ScaleSite("computed", None, tuple(n.name for n in scale_nodes))
    elif scale_nodes:
        scale = ScaleSite("constant", factors, tuple(n.name for n in scale_nodes))
    else:
        scale = ScaleSite("none", 1.0, ())
    a, kv, d = head_counts(scores.inputs[0], q, k, fused_qkv, dims,
                           scale.value if scale.kind == "constant" else None)
    rotary, rotary_dim = rotary_of(q, d, dims)
    reshapes = []
    for n in q.plumbing + k.plumbing + v.plumbing + [m for m in merge if op(m) == "Reshape"]:
        if n.name not in reshapes:
            reshapes.append(n.name)
    qn, kn, vn = q.linears[0].node, k.linears[0].node, v.linears[0].node
    site = AttentionSite(
        q=None if fused_qkv else qn.name, k=None if fused_qkv else kn.name,
        v=None if fused_qkv else vn.name, o=o.name, qkv=qn.name if fused_qkv else None,
        reshapes=tuple(reshapes), scale=scale, rotary=rotary,  # type: ignore[arg-type]
        rotary_dim=rotary_dim, softmax=softmax.name)
    projections = tuple({id(n): n for n in (qn, kn, vn, o)}.values())
    return AttnMatch(order, site, projections, a, kv, d)


def linears_by_output(lins: list[Linear]) -> dict[int, Linear]:
    """Linear layers keyed by id() of their MatMul output and of their final output (after a
    bias Add), so a walk back from attention finds the projection from either."""
    by_output: dict[int, Linear] = {}
    for lin in lins:
        by_output[id(lin.node.outputs[0])] = lin
        by_output[id(lin.output)] = lin
    return by_output


def find_attention(graph: ir.Graph, lins: list[Linear], dims: Dims) -> list[AttnMatch]:
    """Every unfused attention block (Softmax between two activation MatMuls), in order."""
    by_output = linears_by_output(lins)
    found = []
    for i, node in enumerate(graph):
        if op(node) == "Softmax":
            m = match_attention(node, by_output, dims, i)
            if m is not None:
                found.append(m)
    return found
