"""Where a widened head dim or head count meets a decoder's KV cache (docs/design.md, "Decoders
with a KV cache"): the Concat that appends the new keys/values to `past`, and `present`.

    cache = CacheInterface.of(model, shape.cache, "keep")   # or "widen"
    widen = Widen(model, dims, "head dim 80->128", cache=cache)

The past is a graph input of the original width, the new keys/values are widened (the
track's `pos` says where each original entry went: per half for full rotary, per kv group
for GQA heads), and `present` is a graph output. Two policies, both exact:

- `keep` (the default): the cache clients see keeps its shape. The past is padded inside
  the graph before the Concat (zeros in the new entries, at the track's positions:
  Slice per contiguous run, Pad, Concat), and `present` is sliced back to the original
  entries (Slice per run, Concat) under its own name.
- `widen`: the cache inputs and outputs themselves become wider (the caller feeds zeros in
  the new entries); each widened tensor is recorded in the model's metadata
  (tuner.graph.kv_cache.WIDENED_KEY) with the track's positions, so that the gate, the
  manifest and a server know where the original entries sit.

Zeros are right for both head-dim padding (new key entries meet zero query entries, new
value entries meet zero output-projection rows) and head-count padding (the new heads'
keys and values are zeros, their outputs meet zero rows).
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir

from tuner.errors import BadInput
from tuner.graph.kv_cache import WIDENED_KEY, KvCache, find_kv_cache
from tuner.rewrite.axis.engine import Track, Widen, _widened_shape
from tuner.rewrite.common import new_initializer, unique_name

POLICIES = ("keep", "widen")
_MARK = "cachepad"  # in the names of the nodes this module inserts
_THROUGH = ("Identity", "Cast")


def _runs(t: Track) -> list[tuple[int, int, int]]:
    """(old start, old end, new start) of each run of consecutive entries."""
    runs: list[tuple[int, int, int]] = []
    for i, p in enumerate(t.pos):
        if runs and p == runs[-1][2] + (i - runs[-1][0]):
            runs[-1] = (runs[-1][0], i + 1, runs[-1][2])
        else:
            runs.append((i, i + 1, p))
    return runs


def _node_name(graph: ir.Graph, pending: list[ir.Node], base: str) -> str:
    taken = {n.name for n in graph} | {n.name for n in pending}
    name, i = base, 1
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    return name


class CacheInterface:
    """The cache tensors of one model (by name) and the policy for them."""

    def __init__(self, model: ir.Model, policy: str, past: set[str], present: set[str]) -> None:
        if policy not in POLICIES:
            raise BadInput(f"cache policy must be one of {'|'.join(POLICIES)}, not {policy!r}")
        self.model, self.policy, self.past, self.present = model, policy, past, present

    @classmethod
    def of(cls, model: ir.Model, cache: KvCache | None, policy: str) -> "CacheInterface | None":
        """None when the model has no KV cache."""
        cache = cache or find_kv_cache(model.graph)
        if cache is None:
            if policy not in POLICIES:
                raise BadInput(f"cache policy must be one of {'|'.join(POLICIES)}, not {policy!r}")
            return None
        past = {n for layer in cache.layers for n in (layer.past_key, layer.past_value)}
        present = {n for layer in cache.layers for n in (layer.present_key, layer.present_value)
                   if n is not None}
        return cls(model, policy, past, present)

    # -- the past side of the Concat ----------------------------------------------------------
    def past_behind(self, v: ir.Value | None) -> ir.Value | None:
        """The past graph input behind `v` (through Identity/Cast and this module's own pad
        nodes from an earlier rewrite), or None."""
        for _ in range(12):
            if v is None:
                return None
            if v.is_graph_input():
                return v if v.name in self.past else None
            p = v.producer()
            if p is None or not (p.op_type in _THROUGH or _MARK in (p.name or "")):
                return None
            v = p.inputs[0]
        return None

    def join(self, w: Widen, node: ir.Node, index: int, t: Track) -> Track:
        """Input `index` of the cache Concat `node` is a past of the original width: pad it
        (keep) or widen the interface (widen) so that it carries track `t`."""
        v = node.inputs[index]
        assert v is not None
        if self.policy == "keep":
            padded = self._pad(w.graph, node, v, t)
            node.replace_input_with(index, padded)
            w.tracks[padded] = t
            return t
        chain = [v]
        while not chain[-1].is_graph_input():  # Identity/Cast up to the graph input
            chain.append(chain[-1].producer().inputs[0])
        for x in chain:
            w.tracks[x] = t
        self._record(chain[-1].name, t)
        return t

    def _pad(self, graph: ir.Graph, before: ir.Node, v: ir.Value, t: Track) -> ir.Value:
        """(.., old, ..) -> (.., new, ..) with zeros off the track's positions."""
        axis, rank = t.axis % t.rank, t.rank
        runs = _runs(t)
        base = f"{v.name}.{_MARK}{t.new}"
        nodes, pieces = [], []
        for k, (a, b, p) in enumerate(runs):
            x = v
            if len(runs) > 1:
                x = self._slice(graph, nodes, base, x, axis, a, b)
            end = (runs[k + 1][2] if k + 1 < len(runs) else t.new) - (p + b - a)
            pads = np.zeros(2 * rank, np.int64)  # [begin per axis.., end per axis..]
            pads[axis], pads[rank + axis] = (p if k == 0 else 0), end
            pads_v = new_initializer(graph, f"{base}.pads", pads)
            nodes.append(ir.node("Pad", [x, pads_v], name=_node_name(graph, nodes, f"{base}.Pad")))
            pieces.append(nodes[-1].outputs[0])
        if len(pieces) > 1:
            nodes.append(ir.node("Concat", pieces, {"axis": axis},
                                 name=_node_name(graph, nodes, f"{base}.Concat")))
        out = nodes[-1].outputs[0]
        out.name = unique_name(graph, f"{base}.out")
        out.dtype = v.dtype
        graph.insert_before(before, nodes)
        return out

    @staticmethod
    def _slice(graph, nodes, base, x, axis, a, b) -> ir.Value:
        consts = [new_initializer(graph, f"{base}.{what}", np.array([n], np.int64))
                  for what, n in (("starts", a), ("ends", b), ("axes", axis))]
        nodes.append(ir.node("Slice", [x, *consts], name=_node_name(graph, nodes, f"{base}.Slice")))
        return nodes[-1].outputs[0]

    # -- present ------------------------------------------------------------------------------
    def output(self, w: Widen, value: ir.Value, t: Track) -> bool:
        """A tracked graph output: True when it is a present this policy handles (sliced back
        under its own name for keep, recorded and re-annotated for widen)."""
        if value.name not in self.present:
            return False
        if self.policy == "widen":
            value.shape = _widened_shape(value.shape, t)
            self._record(value.name or "", t)
            return True
        graph = w.graph
        name, shape, dtype = value.name or "", value.shape, value.dtype
        value.name = unique_name(graph, f"{name}.{_MARK}{t.new}.wide")
        axis = t.axis % t.rank
        base = f"{name}.{_MARK}{t.new}"
        nodes: list[ir.Node] = []
        pieces = [self._slice(graph, nodes, base, value, axis, p, p + b - a)
                  for a, b, p in _runs(t)]
        if len(pieces) > 1:
            nodes.append(ir.node("Concat", pieces, {"axis": axis},
                                 name=_node_name(graph, nodes, f"{base}.Concat")))
        narrow = nodes[-1].outputs[0]
        narrow.name, narrow.shape, narrow.dtype = name, shape, dtype
        graph.extend(nodes)
        graph.outputs[graph.outputs.index(value)] = narrow
        return True

    def _record(self, name: str, t: Track) -> None:
        table = json.loads(self.model.metadata_props.get(WIDENED_KEY) or "{}")
        table.setdefault(name, []).append([t.axis % t.rank, list(t.pos), t.new])
        self.model.metadata_props[WIDENED_KEY] = json.dumps(table, separators=(",", ":"))
