"""Head dim d -> d' > d, exactly.

Per head, Q/K/V projections get zero output columns and the output projection zero input
rows; from the projections to the attention core, every Reshape/Split/Slice/Expand constant
that encodes d (or heads * d) moves with it (tuner.rewrite.axis.engine carries the widened axis and
refuses what it does not understand). Details that make it exact:

- Full rotary (Llama): rotate_half pairs dim i with i + d/2, so each half of the head is
  padded on its own (new dims at d/2.. and at d/2 + d'/2..), and the inverse-frequency table
  (length d/2) grows to d'/2 with zeros: cos/sin tables then follow the same layout.
- Partial rotary (GPT-NeoX): the rotated dims come first and keep their place; the padding
  goes after the pass-through dims.
- Fused QKV: every d-wide block (GPT-2's [q | k | v], GPT-NeoX's per-head [q_h k_h v_h],
  Falcon's kv groups [q.. k v]) is padded alike, so the block order never matters; grouped-
  query attention pads kv heads by their count.
- q/k norms over the head dim (Gemma 3's RMSNorm, Phi's LayerNorm) run on the original
  entries (tuner.rewrite.axis.reduce), so their statistics do not see the padding.
- The softmax scale stays 1/sqrt(d): a scale computed from the query's shape at run time
  (TorchScript) is pinned to the constant it evaluated to; constant scales are kept.
- ONNX's Attention op (opset 23) gets its scale attribute written (its default would be
  1/sqrt(d')); RotaryEmbedding is checked to see per-half padded heads and half-size caches.
  ONNX Runtime's com.microsoft fused attention ops are refused.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from tuner.errors import RewriteRefused
from tuner.graph.dims import Dims
from tuner.graph.shape import AttentionSite, ModelShape
from tuner.rewrite.axis import Track, Widen, identity, scatter
from tuner.rewrite.axis.cache import CacheInterface
from tuner.rewrite.axis.reshape import entries
from tuner.rewrite.common import (Projection, const_array, new_initializer, projection,
                                  widen_inputs, widen_outputs)


def per_half(d: int, new: int) -> tuple[int, ...]:
    """Full-rotary layout: first half at 0.., second half at new/2.."""
    half, nhalf = d // 2, new // 2
    return tuple(list(range(half)) + [nhalf + i for i in range(half)])


def _flat(pos_head: tuple[int, ...], heads: int, new: int, offset: int = 0) -> list[int]:
    return [offset + h * new + p for h in range(heads) for p in pos_head]


def output_rank(widen: Widen, proj: Projection) -> int:
    r = widen.rank(proj.node.outputs[0]) or widen.rank(proj.node.inputs[0])
    if r is None:
        raise RewriteRefused(f"node {proj.node.name!r}: rank of its output unknown")
    return r


def neox_layout(proj: Projection, widen: Widen, d: int) -> bool:
    """True when the fused projection is reshaped to (.., heads, 3d) (GPT-NeoX), False for
    GPT-2's three [heads * d] blocks split apart."""
    frontier = [proj.node.outputs[0]]
    for _ in range(6):
        nxt = []
        for v in frontier:
            for use in v.uses():
                n = use.node
                if n.op_type == "Reshape" and use.idx == 0:
                    ents = entries(widen, n, 1)
                    last = ents[-1].value if ents else None
                    if last == 3 * d:
                        return True
                    if last == d:
                        return False
                if n.op_type in ("Split", "Slice"):
                    return False
                if n.op_type in ("Add", "Reshape", "Identity", "Cast"):
                    nxt.extend(n.outputs)
        frontier = nxt
    return False


def _seed_block(graph: ir.Graph, widen: Widen, site: AttentionSite, layer: int, d: int,
                new: int, heads: int, kv: int, sinks: dict) -> None:
    qk = per_half(d, new) if site.rotary == "full" else identity(d)
    vv = identity(d)
    tag = f"headdim{new}"
    if site.qkv:
        proj = projection(graph, site.qkv)
        width = proj.out_features
        kv_f = (width // d - heads) // 2
        if (heads + 2 * kv_f) * d != width:
            raise RewriteRefused(f"node {site.qkv!r}: {width} outputs are not (heads + 2 kv) * {d}")
        # Every d-wide block of the fused output (q, k or v, in whatever order the family
        # stores them: GPT-2's [q | k | v], GPT-NeoX's per head [q_h k_h v_h], Falcon's per
        # kv group [q.. k v]) gets the same layout. Per-half padding is exact for V as well
        # (its padded dims are zero and meet zero rows of the output projection), so the
        # block order never needs to be known.
        pos = _flat(qk, width // d, new)
        rank = output_rank(widen, proj)
        new_width = (heads + 2 * kv_f) * new
        widen_outputs(graph, proj, new_width, tag, np.array(pos))
        widen.seed(proj.node.outputs[0], Track(-1, rank, tuple(pos), new_width))
    else:
        for name, lay, n in ((site.q, qk, heads), (site.k, qk, kv), (site.v, vv, kv)):
            proj = projection(graph, name)
            n = proj.out_features // d
            if n * d != proj.out_features:
                raise RewriteRefused(f"node {name!r}: {proj.out_features} outputs are not heads * {d}")
            pos = _flat(lay, n, new)
            rank = output_rank(widen, proj)
            widen_outputs(graph, proj, n * new, tag, np.array(pos))
            widen.seed(proj.node.outputs[0], Track(-1, rank, tuple(pos), n * new))
    o = projection(graph, site.o)

    def sink(node: ir.Node, tin: list) -> None:
        t = tin[0]
        if t is None or t.axis != -1 or t.old != int(o.weight.shape[o.in_axis]):
            raise RewriteRefused(f"node {node.name!r}: the output projection does not receive "
                                 "the widened heads")
        widen_inputs(graph, o, t.new, tag, np.array(t.pos))
        sinks[node.name] = True

    widen.sinks[o.node] = sink
    sinks.setdefault(o.node.name, False)


def _rotary_sources(node: ir.Node) -> list[ir.Value | None]:
    """Where a rotary's half-width tables lie: upstream of a Cos or Sin (the inverse
    frequencies), or the constant cos/sin caches of ONNX Runtime's fused RotaryEmbedding."""
    if node.op_type in ("Cos", "Sin"):
        return [node.inputs[0]]
    if node.op_type == "RotaryEmbedding" and node.domain == "com.microsoft":
        return list(node.inputs[2:4])
    return []


def _seed_rotary(graph: ir.Graph, widen: Widen, d: int, new: int) -> int:
    """Grow the rotary's tables (d/2 long: inverse frequencies, or a fused op's cos/sin
    caches) to new/2. The new entries meet zero query and key entries, whatever they hold."""
    half, seen, count = d // 2, set(), 0
    for node in list(graph):
        frontier = _rotary_sources(node)
        if not frontier:
            continue
        for _ in range(12):
            nxt = []
            for v in frontier:
                if v is None or v in seen:
                    continue
                seen.add(v)
                c = const_array(v)
                if c is not None:
                    if c.dtype.kind == "f" and c.size > 1 and half in c.shape and v not in widen.tracks:
                        axis = c.shape.index(half) - c.ndim
                        t = Track(axis, c.ndim, identity(half), new // 2)
                        padded = new_initializer(graph, f"{v.name or 'rotary'}.headdim{new}",
                                                 scatter(c, axis, t))
                        v.replace_all_uses_with(padded)
                        widen.seed(padded, t)
                        count += 1
                    continue
                p = v.producer()
                if p is not None and p.op_type != "Shape":
                    nxt.extend(i for i in p.inputs if i is not None)
            frontier = nxt
    return count


def pad_head_dim(model: ir.Model, shape: ModelShape, new: int, cache_policy: str = "keep") -> int:
    """Pad every attention block's head dim to `new`; returns the old head dim. A KV cache
    keeps its shape (`keep`) or is widened (`widen`): tuner.rewrite.axis.cache."""

    d = shape.head_dim
    if not d:
        raise RewriteRefused("inspect found no head dim to pad")
    if new < d:
        raise RewriteRefused(f"head dim is {d}; cannot pad to the smaller {new}")
    if new == d:
        return d
    sites = [(i, layer.attention) for i, layer in enumerate(shape.sites.layers) if layer.attention]
    if not sites:
        raise RewriteRefused("no attention block found to pad")
    # ONNX Runtime's fused attention ops never reach here: compose.apply refuses them first
    # (tuner.graph.paddable.unpadded_reason); ONNX's own Attention (opset 23) is rewritten
    for i, site in sites:
        if site.rotary == "full" and (d % 2 or new % 2):
            raise RewriteRefused(f"layer {i}: full rotary needs even head dims ({d} -> {new})")
    dims = Dims(model)
    dims.inferred()  # shapes of the original graph, before any edit
    widen = Widen(model, dims, f"head dim {d}->{new}",
                  cache=CacheInterface.of(model, shape.cache, cache_policy))
    graph = model.graph
    sinks: dict[str, bool] = {}
    for i, site in sites:
        _seed_block(graph, widen, site, i, d, new, shape.num_heads, shape.num_kv_heads, sinks)
    if any(site.rotary == "full" for _, site in sites):
        if not _seed_rotary(graph, widen, d, new):
            raise RewriteRefused("full rotary, but no inverse-frequency table of length "
                                 f"{d // 2} upstream of Cos/Sin and no fused RotaryEmbedding "
                                 "cache (sin/cos tables precomputed as constants, as GPT-J "
                                 "stores them, are not padded)")
    widen.run()
    missing = [name for name, hit in sinks.items() if not hit]
    if missing:
        raise RewriteRefused(f"the widened heads never reached output projection(s) {missing}")
    return d
