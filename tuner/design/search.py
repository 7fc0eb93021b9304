"""`tuner design` end to end, without the command line: resolve the request (start shape,
target, depths, device), enumerate candidates, measure, rank.

    req = DesignRequest(target=125_000_000, start=None, layers=None, vocab=50257, ffn="plain")
    ranking, meta = run(req, device="cpu", progress=rich_progress())
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tuner.design.candidates import SearchSpace, default_layers, enumerate_candidates
from tuner.design.measure import MeasureSettings, measure
from tuner.design.params import FAMILIES, FAMILY_FOR_FFN, DesignShape, Family, count_params
from tuner.design.rank import Ranking, rank
from tuner.errors import BadInput
from tuner.graph.inspect import inspect_path
from tuner.hardware.detect import detect
from tuner.hardware.facts import DEVICES, DeviceFacts
from tuner.plan.probe import backend_unavailable, gpu_facts
from tuner.util.progress import Progress

DEFAULT_VOCAB = 50257
# (batch, seq, rounds) per backend: the paper's setting on a GPU; on a CPU, small enough that a
# 125M search finishes in well under 5 minutes on 2 shared cores.
DEFAULTS = {"torch-cuda": (8, 2048, 15), "ort-cpu": (1, 128, 30)}


@dataclass(frozen=True)
class DesignRequest:
    target: int | None  # parameters; None: the start shape's count
    start: DesignShape | None
    layers: tuple[int, ...] | None  # depths to search; None: the start's, or a default range
    vocab: int | None = None
    ffn: str | None = None  # plain | swiglu; None: the start's, or plain
    family: str | None = None  # gpt2 | gpt_neox | llama: overrides the --ffn default family
    tolerance: float = 0.05
    max_candidates: int = 24

    def __post_init__(self) -> None:
        if self.ffn not in (None, "plain", "swiglu"):
            raise BadInput(f"--ffn must be plain or swiglu, not {self.ffn!r}")
        if self.family is not None and self.family not in FAMILIES:
            raise BadInput(f"unknown family {self.family!r}; choose one of: {', '.join(FAMILIES)}")
        if self.target is None and self.start is None:
            raise BadInput("give a parameter target (--params) or a starting shape "
                           "(--from MODEL.onnx, or --hidden/--heads/--ffn-size)")


def parse_layers(layers: int | None, layers_range: str | None) -> tuple[int, ...] | None:
    """--layers L or --layers-range A:B (inclusive), never both."""
    if layers is not None and layers_range is not None:
        raise BadInput("--layers and --layers-range contradict each other: give one")
    if layers is not None:
        if layers < 1:
            raise BadInput(f"--layers must be >= 1, not {layers}")
        return (layers,)
    if layers_range is None:
        return None
    try:
        lo, hi = (int(x) for x in layers_range.split(":"))
    except ValueError:
        raise BadInput(f"--layers-range must look like A:B (e.g. 8:16), not {layers_range!r}") from None
    if not 1 <= lo <= hi:
        raise BadInput(f"--layers-range {layers_range}: need 1 <= A <= B")
    if hi - lo > 64:
        raise BadInput(f"--layers-range {layers_range} spans over 64 depths: narrow it")
    return tuple(range(lo, hi + 1))


def family_for(ffn: str | None, family: str | None, gated: bool | None = None) -> Family:
    """The family from --family, else from --ffn, else from a start shape's gating."""
    if ffn is None and gated is not None:
        ffn = "swiglu" if gated else "plain"
    fam = FAMILIES[family or FAMILY_FOR_FFN[ffn or "plain"]]
    if ffn is not None and fam.ffn_gated != (ffn == "swiglu"):
        raise BadInput(f"--family {fam.name} has a {'gated' if fam.ffn_gated else 'plain'} FFN, "
                       f"which contradicts --ffn {ffn}")
    return fam


def start_from_flags(hidden: int, heads: int, ffn_size: int, layers: int | None,
                     vocab: int, family: Family, kv_heads: int | None = None,
                     head_dim: int | None = None, target: int | None = None) -> DesignShape:
    """The starting shape from --hidden/--heads/--ffn-size; its depth from --layers, else the
    depth whose count is nearest the target."""
    if hidden % heads and head_dim is None:
        raise BadInput(f"--hidden {hidden} is not a multiple of --heads {heads}: give --head-dim")
    d = head_dim or hidden // heads

    def make(n: int) -> DesignShape:
        try:
            return DesignShape(n, hidden, heads, kv_heads or heads, d, ffn_size, vocab, family)
        except ValueError as e:
            raise BadInput(f"starting shape: {e}") from None

    if layers is None:
        if target is None:
            raise BadInput("the starting shape needs a depth: give --layers (or --params)")
        per_layer = count_params(make(2)) - count_params(make(1))
        layers = max(1, round((target - (count_params(make(1)) - per_layer)) / per_layer))
    return make(layers)


def start_from_model(path: str | os.PathLike, family: Family | None = None) -> DesignShape:
    """The starting shape read by `tuner inspect` (tuner.graph.inspect.inspect_path)."""

    ms = inspect_path(path)
    if ms.vocab_size is None or ms.kind != "decoder":
        raise BadInput(f"{path} has no LM head (an encoder?): tuner design searches decoder shapes")
    if family is None:
        base = FAMILIES["llama" if ms.ffn_gated else "gpt_neox"]
        family = Family(f"{base.name}-like", base.ffn_gated, base.bias, base.norm, ms.sites.tied)
    elif family.ffn_gated != ms.ffn_gated:
        raise BadInput(f"{path} has a {'gated' if ms.ffn_gated else 'plain'} FFN, which "
                       f"contradicts the family {family.name}")
    return DesignShape(ms.num_layers, ms.hidden_size, ms.num_heads, ms.num_kv_heads,
                       ms.head_dim, ms.ffn_size, ms.vocab_size, family)


def resolve_device(device: str) -> tuple[str, DeviceFacts]:
    """(probe backend, hardware facts) for --device: auto (a GPU if torch sees one, else the
    CPU), cpu, or a named GPU (a100, h100, h200: needs a CUDA GPU here)."""
    name = device.lower()
    if name == "auto":
        return ("ort-cpu", DEVICES["cpu"]) if backend_unavailable("torch-cuda") else \
            ("torch-cuda", gpu_facts())
    if name == "cpu":
        return "ort-cpu", DEVICES["cpu"]
    if name not in DEVICES and name != "gpu":
        raise BadInput(f"unknown device {device!r}; choose one of: auto, gpu, {', '.join(DEVICES)}")
    reason = backend_unavailable("torch-cuda")
    if reason:
        raise BadInput(f"device {device} needs a CUDA GPU: {reason}")
    here = gpu_facts()
    if name != "gpu" and detect().facts_key != name:  # measured here, labelled there: no
        raise BadInput(f"--device {device}, but this machine's GPU is {here.name}: the probe "
                       f"measures the GPU it runs on; use --device auto or gpu")
    return "torch-cuda", here


def plan(req: DesignRequest):
    """The search space and its candidates (the start shape first, when given)."""
    start = req.start
    family = start.family if start is not None else family_for(req.ffn, req.family)
    vocab = req.vocab or (start.vocab_size if start is not None else DEFAULT_VOCAB)
    target = req.target if req.target is not None else count_params(start)
    layers = req.layers or ((start.num_layers,) if start is not None
                            else default_layers(target, vocab, family))
    kv_group = start.num_heads // start.num_kv_heads if start is not None else 1
    space = SearchSpace(int(target), layers, vocab, family, req.tolerance, kv_group=kv_group,
                        max_candidates=req.max_candidates)
    return space, enumerate_candidates(space, start)


def run(req: DesignRequest, device: str = "auto", batch: int | None = None,
        seq: int | None = None, rounds: int | None = None, threads: int = 0,
        progress: Progress | None = None) -> tuple[Ranking, dict[str, Any]]:
    """Plan, measure and rank; returns the ranking and the facts the report header needs."""
    backend, facts = resolve_device(device)
    space, candidates = plan(req)
    b, s, r = DEFAULTS[backend]
    # `is None`, not `or`: an explicit 0 is a bad flag to refuse, not a request for the default
    settings = MeasureSettings(b if batch is None else batch, s if seq is None else seq, backend,
                               r if rounds is None else rounds, threads=threads)
    costs = measure(candidates, settings, progress)
    meta = {"target": space.target, "tolerance": space.tolerance, "layers": list(space.layers),
            "family": space.family.name, "candidates": len(candidates)}
    return rank(costs, settings, facts), meta
