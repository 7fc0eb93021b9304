"""FFN width f -> f' > f, exactly.

The up (and gate) projections get zero output columns and zero bias entries, the down
projection zero input rows: each extra unit computes act(0) (or act(0) * 0 when gated), a
finite number that meets a zero row and adds nothing. Between the projections the widened
tensor may pass through activations, bias Adds, casts, Reshapes whose shape constants spell f
(TorchScript's Gemm form reshapes to (B, S, f)) and the Slice/Split that cuts a fused gate+up
projection in halves (Phi-3; bounds constant or computed from the shape); tuner.rewrite.axis.engine
carries the widened axis through them and refuses, naming the node, whatever else it meets.

Fused gate+up projections (one weight of 2f output columns) are padded per half, so that each
half keeps its units at the same positions.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from tuner.errors import RewriteRefused
from tuner.graph.dims import Dims
from tuner.graph.shape import FfnSite
from tuner.rewrite import quantized
from tuner.rewrite.axis import Track, Widen
from tuner.rewrite.common import projection, widen_inputs, widen_outputs


# Activations with act(0) == 0 exactly: an ungated FFN's padded units are then exactly 0.
ZERO_AT_ZERO = {"gelu", "gelu_tanh", "relu", "relu2", "silu", "quick_gelu", "tanh", "mish"}


def pad_ffns(model: ir.Model, sites: list[tuple[int, FfnSite]], new_size: int) -> list[int]:
    """Widen the FFN blocks `sites` ((layer, site) pairs) to `new_size` units; returns the
    old width of each."""

    dims = Dims(model)
    dims.inferred()  # shapes of the original graph, before any edit
    widen = Widen(model, dims, f"FFN -> {new_size}")
    reached: dict[str, bool] = {}
    olds = []
    for layer, site in sites:
        olds.append(_seed(model.graph, widen, site, new_size, layer, reached))
    if any(f != new_size for f in olds):
        widen.run()
    missing = [name for name, hit in reached.items() if not hit]
    if missing:
        raise RewriteRefused(f"the widened FFN units never reached the down projection(s) {missing}")
    return olds


def pad_ffn(model: ir.Model, site: FfnSite, new_size: int, layer: int = 0) -> int:
    """Widen one FFN block to `new_size` units; returns the old width."""
    return pad_ffns(model, [(layer, site)], new_size)[0]


def _seed(graph: ir.Graph, widen: Widen, site: FfnSite, new: int, layer: int,
          reached: dict[str, bool]) -> int:
    up = projection(graph, site.up)
    down = projection(graph, site.down)
    gate = projection(graph, site.gate) if site.gate and site.gate != site.up else None
    f = down.in_features
    if new < f:
        raise RewriteRefused(f"FFN of layer {layer} ({site.down}) has width {f}; cannot pad to "
                             f"the smaller {new}")
    if new == f:
        return f
    fused = up.out_features == 2 * f and gate is None
    if up.out_features != f and not fused:
        raise RewriteRefused(f"node {site.up!r}: {up.out_features} output features do not match "
                             f"the {f} input features of {site.down!r}")
    if gate is not None and gate.out_features != f:
        raise RewriteRefused(f"node {site.gate!r}: {gate.out_features} output features, "
                             f"expected {f}")
    if down.quantized == quantized.INTEGER and gate is None and site.activation not in ZERO_AT_ZERO:
        # DynamicQuantizeLinear takes x's range over the padded units too: they must be 0
        raise RewriteRefused(f"node {site.down!r}: quantized input of a {site.activation} FFN: "
                             "its padded units would not be exactly 0 and would change the "
                             "activation's dynamic quantization range")
    units_zero = gate is not None or fused or site.activation in ZERO_AT_ZERO  # act(.) * 0
    tag = f"ffn{new}"
    pos = list(range(f)) + ([new + i for i in range(f)] if fused else [])
    for proj in (up, gate):
        if proj is None:
            continue
        rank = widen.rank(proj.node.outputs[0]) or widen.rank(proj.node.inputs[0])
        if rank is None:
            raise RewriteRefused(f"node {proj.node.name!r}: rank of its output unknown")
        width = new * (2 if proj is up and fused else 1)
        columns = np.array(pos if proj is up else pos[:f])
        moved = tuple(pos if proj is up else pos[:f])
        if proj.quantized:  # new entries hold the zero point (tuner.rewrite.quantized)
            for scales in quantized.widen_out(graph, proj, width, tag, columns):
                widen.seed(scales, Track(-1, widen.rank(scales) or 1, moved, width))
        else:
            widen_outputs(graph, proj, width, tag, columns)
        widen.seed(proj.node.outputs[0], Track(-1, rank, moved, width))

    def sink(node: ir.Node, tin: list) -> None:
        t = tin[0]
        if t is None or t.axis != -1 or t.old != f or any(tin[1:]):
            raise RewriteRefused(f"node {node.name!r}: the down projection does not receive "
                                 f"the widened FFN units on its input")
        if down.quantized:
            if list(t.pos) != list(range(f)):
                raise RewriteRefused(f"node {node.name!r}: quantized K entries would move "
                                     "(inside their blocks, or off the activation's range)")
            quantized.widen_in(graph, down, t.new, tag, fed_zeros=units_zero)
        else:
            widen_inputs(graph, down, t.new, tag, np.array(t.pos))
        reached[node.name] = True

    widen.sinks[down.node] = sink
    reached.setdefault(down.node.name, False)
    return f
