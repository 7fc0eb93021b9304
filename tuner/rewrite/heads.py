"""Head count a -> a' > a, exactly (multi-head and grouped-query attention).

The new heads are all zeros: zero Q/K/V columns give them zero queries, keys and values, so
each new head attends uniformly to zero vectors and outputs zeros; zero output-projection rows
make sure they add nothing in any case. Every Reshape that splits (.., a*d) into (.., a, d)
or merges it back gets a' (tuner.rewrite.axis.engine carries the heads axis through transposes, the
scores and the softmax, which runs over keys, not heads).

Grouped-query attention (kv heads < heads): head h reads kv head h // (a/kv), so the new
query heads are added inside every group (a' must stay a multiple of kv): the kv projections
stay as they are and the Expand that repeats each kv head a/kv times repeats it a'/kv times.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from tuner.errors import RewriteRefused
from tuner.graph.dims import Dims
from tuner.graph.shape import AttentionSite, ModelShape
from tuner.rewrite.axis import Track, Widen
from tuner.rewrite.axis.cache import CacheInterface
from tuner.rewrite.axis.reshape import entries
from tuner.rewrite.common import projection, widen_inputs, widen_outputs
from tuner.rewrite.head_dim import neox_layout, output_rank


def _repeat_expands(start: ir.Value, limit: int = 80) -> list[ir.Node]:
    """The Expands that repeat kv heads for their groups (GQA's repeat_kv), downstream of a
    k or v (or fused qkv) projection and upstream of the attention MatMuls."""
    frontier, seen, found = [start], set(), []
    while frontier and len(seen) < limit:
        v = frontier.pop(0)
        for use in v.uses():
            n = use.node
            if n in seen:
                continue
            seen.add(n)
            if n.op_type == "Expand" and use.idx == 0:
                found.append(n)
            elif n.op_type not in ("MatMul", "Softmax", "Gemm", "Attention"):
                frontier.extend(n.outputs)
    return found


def _seed_gqa(graph: ir.Graph, widen: Widen, site: AttentionSite, a: int, kv: int, new: int,
              d: int, reached: dict[str, bool]) -> None:
    """Query heads grow per kv group (a/kv -> new/kv), keeping head h in group h // (a/kv):
    the k/v weights stay, the Expand that repeats each kv head repeats it new/kv times."""
    r, r_new = a // kv, new // kv
    slot = [(h // r) * r_new + h % r for h in range(a)]
    q_pos = [slot[h] * d + j for h in range(a) for j in range(d)]
    proj = projection(graph, site.qkv or site.q)
    if site.qkv:  # [q | k | v]: only the q block grows, k and v move along unchanged
        if proj.out_features != (a + 2 * kv) * d:
            raise RewriteRefused(f"node {site.qkv!r}: {proj.out_features} outputs are not "
                                 f"({a} + 2 x {kv}) x {d}")
        pos = q_pos + [new * d + i for i in range(2 * kv * d)]
        starts = [proj.node.outputs[0]]
    else:
        if proj.out_features != a * d:
            raise RewriteRefused(f"node {site.q!r}: {proj.out_features} outputs are not {a} x {d}")
        pos = q_pos
        starts = [projection(graph, name).node.outputs[0] for name in (site.k, site.v)]
    width = new * d + (proj.out_features - a * d)
    widen_outputs(graph, proj, width, f"heads{new}", np.array(pos))
    widen.seed(proj.node.outputs[0], Track(-1, output_rank(widen, proj), tuple(pos), width))
    expands = [e for start in starts for e in _repeat_expands(start)]
    if len(expands) != 2:
        raise RewriteRefused(f"{site.qkv or site.k!r}: expected the two Expands that repeat the "
                             f"kv heads, found {len(expands)}")
    for expand in expands:
        ents = entries(widen, expand, 1)
        if not ents or len(ents) < 3 or ents[-3].value != r:
            raise RewriteRefused(f"node {expand.name!r}: does not repeat the kv heads {r} times")
        ents[-3].setter(r_new)
        widen.seed(expand.outputs[0], Track(-3, len(ents), tuple(range(r)), r_new))
    _sink(graph, widen, site, a, d, new, reached)


def _sink(graph: ir.Graph, widen: Widen, site: AttentionSite, a: int, d: int, new: int,
          reached: dict[str, bool]) -> None:
    o = projection(graph, site.o)

    def sink(node: ir.Node, tin: list) -> None:
        t = tin[0]
        if t is None or t.axis != -1 or t.old != a * d:
            raise RewriteRefused(f"node {node.name!r}: the output projection does not receive "
                                 "the widened heads")
        widen_inputs(graph, o, t.new, f"heads{new}", np.array(t.pos))
        reached[node.name] = True

    widen.sinks[o.node] = sink
    reached.setdefault(o.node.name, False)


def _seed(graph: ir.Graph, widen: Widen, site: AttentionSite, a: int, new: int, d: int,
          reached: dict[str, bool]) -> None:
    tag = f"heads{new}"
    if site.qkv:
        proj = projection(graph, site.qkv)
        if proj.out_features != 3 * a * d:
            raise RewriteRefused(f"node {site.qkv!r}: {proj.out_features} outputs are not 3 x {a} x {d}")
        if neox_layout(proj, widen, d):  # per head [q_h k_h v_h]: new heads at the end
            pos = list(range(3 * a * d))
        else:  # [q | k | v] blocks: new heads at the end of each block
            pos = [b * new * d + i for b in range(3) for i in range(a * d)]
        widen_outputs(graph, proj, 3 * new * d, tag, np.array(pos))
        widen.seed(proj.node.outputs[0], Track(-1, output_rank(widen, proj), tuple(pos), 3 * new * d))
    else:
        for name in (site.q, site.k, site.v):
            proj = projection(graph, name)
            if proj.out_features != a * d:
                raise RewriteRefused(f"node {name!r}: {proj.out_features} outputs are not {a} x {d}")
            pos = tuple(range(a * d))
            widen_outputs(graph, proj, new * d, tag, np.array(pos))
            widen.seed(proj.node.outputs[0], Track(-1, output_rank(widen, proj), pos, new * d))
    _sink(graph, widen, site, a, d, new, reached)


FUSED_LAYOUTS = ("the fused qkv projection {!r} may keep its heads in a layout this rewrite does "
                 "not follow: it knows [q | k | v] blocks (GPT-2) and per-head [q k v] reshaped "
                 "to 3*d (GPT-NeoX), not kv groups [q.. k v] (Falcon) nor (heads, 3, d) read by "
                 "Gather (BLOOM, whose ALiBi bias would also need the new heads)")


def pad_heads(model: ir.Model, shape: ModelShape, new: int, cache_policy: str = "keep") -> int:
    """Pad every attention block to `new` heads; returns the old head count. A KV cache
    keeps its shape (`keep`) or is widened (`widen`): tuner.rewrite.axis.cache."""

    a, d = shape.num_heads, shape.head_dim
    if not a or not d:
        raise RewriteRefused("inspect found no head count / head dim to pad")
    if new < a:
        raise RewriteRefused(f"the model has {a} heads; cannot pad to the smaller {new}")
    if new == a:
        return a
    kv = shape.num_kv_heads or a
    if kv != a and (a % kv or new % kv):
        raise RewriteRefused(f"grouped-query attention ({kv} kv heads): the head count must "
                             f"stay a multiple of {kv}, so that every kv group grows alike")
    sites = [(i, layer.attention) for i, layer in enumerate(shape.sites.layers) if layer.attention]
    if not sites:
        raise RewriteRefused("no attention block found to pad")
    for i, site in sites:
        if site.fused_op:
            node = site.scale.nodes[0] if site.scale.nodes else site.o
            raise RewriteRefused(f"layer {i}: fused attention op {site.fused_op} (node "
                                 f"{node!r}: its num_heads attribute and packed weights are "
                                 "not rewritten)")
    dims = Dims(model)
    dims.inferred()  # shapes of the original graph, before any edit
    widen = Widen(model, dims, f"heads {a}->{new}",
                  cache=CacheInterface.of(model, shape.cache, cache_policy))
    reached: dict[str, bool] = {}
    try:
        for _, site in sites:
            if kv != a:
                _seed_gqa(model.graph, widen, site, a, kv, new, d, reached)
            else:
                _seed(model.graph, widen, site, a, new, d, reached)
        widen.run()
    except RewriteRefused as e:
        fused = [site.qkv for _, site in sites if site.qkv]
        if not fused:
            raise
        raise RewriteRefused(f"{e}; {FUSED_LAYOUTS.format(fused[0])}") from None
    missing = [name for name, hit in reached.items() if not hit]
    if missing:
        raise RewriteRefused(f"the new heads never reached output projection(s) {missing}")
    return a
