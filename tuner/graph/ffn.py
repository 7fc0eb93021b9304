"""Feed-forward blocks, found by structure: a "down" linear whose input is an elementwise
function (the activation, and for GLU variants a product) of one or two "up" linears that
read the same tensor, with widths h -> f -> h.

    x --up--> (B, S, f) --act--> --down--> (B, S, h)             GELU / ReLU MLPs
    x --gate--> act --.
    x --up-----------Mul--down-->                                SwiGLU / GeGLU
    x --gate_up--> Split/Slice halves: act(gate) * up --down-->    Phi-3's fused gate_up
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from tuner.graph.walk import MS, Linear, const_array, const_scalar, consumers, op, source, walk_back

NONLINEAR = {"Tanh", "Erf", "Sigmoid", "Relu", "Gelu", "Elu", "Selu", "Softplus", "HardSigmoid",
             "HardSwish", "LeakyRelu", "Clip", "Exp", "Log", "Mish", "Softsign",
             f"{MS}.FastGelu", f"{MS}.BiasGelu", f"{MS}.Gelu", f"{MS}.QuickGelu"}
_ELEMENTWISE = {"Mul", "Add", "Sub", "Div", "Pow", "Sqrt", "Neg", "Reshape", "Cast", "Identity"}


@dataclass(frozen=True)
class FfnMatch:
    up: Linear
    down: Linear
    gate: Linear | None
    activation: str
    nodes: tuple[ir.Node, ...]  # the activation's nodes between up/gate and down
    fused_gate_up: str | None = None  # "gate,up" / "up,gate" when one GEMM computes both

    @property
    def width(self) -> int:
        return self.down.in_dim


def _follow(node: ir.Node):
    kind = op(node)
    if kind in ("Reshape", "Cast", "Identity", "Pow", "Sqrt", "Neg", "Slice", "Split",
                "DynamicQuantizeLinear", "QuantizeLinear", "DequantizeLinear") or kind in NONLINEAR:
        return (0,)
    if kind in ("Mul", "Add", "Sub", "Div") or kind.startswith(f"{MS}.Bias"):
        return range(len(node.inputs))
    return None


def _reaches_nonlinear(start: ir.Value, region: set[int]) -> bool:
    """Whether `start` flows into a nonlinear op inside the activation region."""
    frontier, seen = [start], set()
    while frontier:
        v = frontier.pop()
        for user in consumers(v):
            if id(user) not in region or id(user) in seen:
                continue
            seen.add(id(user))
            if op(user) in NONLINEAR:
                return True
            frontier.extend(user.outputs)
    return False


def classify_activation(nodes: tuple[ir.Node, ...], gated: bool) -> str:
    kinds = {op(n) for n in nodes}
    consts = {round(c, 3) for n in nodes for i in n.inputs
              if (c := const_scalar(i)) is not None}
    if "Gelu" in kinds:
        approx = next((n.attributes.get("approximate") for n in nodes if op(n) == "Gelu"), None)
        return "gelu_tanh" if approx is not None and approx.value == "tanh" else "gelu"
    if f"{MS}.FastGelu" in kinds:
        return "gelu_tanh"
    if f"{MS}.QuickGelu" in kinds:  # x * sigmoid(alpha x): ORT fuses SiLU into it as alpha 1
        quick = next(n for n in nodes if op(n) == f"{MS}.QuickGelu")
        alpha = quick.attributes.get("alpha")
        return "quick_gelu" if alpha is None or round(alpha.value, 3) == 1.702 else "silu"
    if kinds & {f"{MS}.BiasGelu", f"{MS}.Gelu", "Erf"}:
        return "gelu"
    if "Tanh" in kinds:
        return "gelu_tanh" if 0.045 in consts or 0.044 in consts or "Pow" in kinds else "tanh"
    if "Sigmoid" in kinds:
        return "quick_gelu" if 1.702 in consts else "silu"
    if "Relu" in kinds:
        return "relu2" if "Pow" in kinds else "relu"
    for name in ("Elu", "Selu", "Softplus", "HardSwish", "LeakyRelu", "Mish"):
        if name in kinds:
            return name.lower()
    return "unknown"


def match_ffn(down: Linear, by_output: dict[int, Linear]) -> FfnMatch | None:
    """The FFN ending in `down`, or None when `down` is some other projection."""
    hits, walked = walk_back(down.node.inputs[0], _follow, lambda v: id(v) in by_output, limit=64)
    ups = []
    for v in hits:
        lin = by_output[id(v)]
        if lin not in ups:
            ups.append(lin)
    if not 1 <= len(ups) <= 2:
        return None
    if len(ups) == 1 and ups[0].out_dim == 2 * down.in_dim and ups[0].in_dim == down.out_dim:
        return _fused_gate_up(ups[0], down, tuple(walked))
    if any(u.out_dim != down.in_dim or u.in_dim != down.out_dim for u in ups):
        return None
    if len({id(u.node.inputs[0]) for u in ups}) != 1:
        return None  # GLU halves read the same normalised input
    nodes = tuple(walked)
    if not any(op(n) in NONLINEAR for n in nodes):
        return None  # two linears back to back are not an FFN
    region = {id(n) for n in nodes}
    if len(ups) == 1:
        return FfnMatch(ups[0], down, None, classify_activation(nodes, False), nodes)
    gates = [u for u in ups if _reaches_nonlinear(u.output, region)]
    if len(gates) != 1:
        return None
    gate = gates[0]
    up = ups[1] if ups[0] is gate else ups[0]
    return FfnMatch(up, down, gate, classify_activation(nodes, True), nodes)


def _fused_gate_up(lin: Linear, down: Linear, nodes: tuple[ir.Node, ...]) -> FfnMatch | None:
    """One GEMM of width 2f whose halves are split: act(gate half) * up half -> down (Phi-3)."""
    region = {id(n) for n in nodes}
    halves: dict[int, ir.Value] = {}  # 0: first half of the features, 1: second
    for n in nodes:
        if source(n.inputs[0]) not in (lin.output, lin.node.outputs[0]):
            continue
        if op(n) == "Split" and len(n.outputs) == 2:
            halves = {0: n.outputs[0], 1: n.outputs[1]}
        elif op(n) == "Slice":
            # TorchScript computes the second half's start from the shape: not 0 either way.
            start = const_array(n.inputs[1])
            first = start is not None and int(start.reshape(-1)[0]) == 0
            halves[0 if first else 1] = n.outputs[0]
    if len(halves) != 2 or not any(op(n) in NONLINEAR for n in nodes):
        return None
    gated = [i for i, v in halves.items() if _reaches_nonlinear(v, region)]
    if len(gated) != 1:
        return None
    order = "gate,up" if gated[0] == 0 else "up,gate"
    return FfnMatch(lin, down, lin, classify_activation(nodes, True), nodes, order)


def find_ffns(all_linears: list[Linear]) -> list[FfnMatch]:
    """Every FFN block, in graph order of the down projection."""
    by_output: dict[int, Linear] = {}
    for lin in all_linears:
        by_output[id(lin.node.outputs[0])] = lin
        by_output[id(lin.output)] = lin
    return [m for lin in all_linears if (m := match_ffn(lin, by_output)) is not None]
