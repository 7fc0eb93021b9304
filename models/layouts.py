"""Input layouts users bring that are not our reference builds: the same small transformers
(random weights) exported with a fixed batch, fully static shapes, renamed inputs, int32 ids,
a bool mask, inputs_embeds only, fp16 weights and I/O, bf16 I/O, and BERT with
token_type_ids. The gate's tests (tests/test_gate_layouts.py) run each through verify, pad,
optimize and serve, beside corrupted copies that must FAIL.

    python -m models.layouts renamed -o renamed.onnx
    python -m models.layouts --list

Exports are cached under $SHAPETUNER_CACHE as models/build.py caches its own.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from models.build import IR_VERSION, OPSET_TORCHSCRIPT, SEED, _cache_dir
from models.once import build_once

# A GPT-2 with odd sizes (vocab 1003, FFN 200: both have something to pad), and a BERT MLM.
GPT2 = dict(n_layer=2, n_embd=64, n_head=4, n_inner=200, vocab_size=1003, n_positions=128,
            tie_word_embeddings=True)
BERT = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=200,
            vocab_size=1003, max_position_embeddings=128, type_vocab_size=2)


@dataclass(frozen=True)
class Layout:
    """One export: the graph's input names (in order, with what each carries), dtypes,
    which axes are dynamic, and the precision of weights and outputs."""

    inputs: tuple[tuple[str, str], ...]  # (graph name, what: ids | mask | types | embeds)
    dtypes: dict[str, str] = field(default_factory=dict)  # what -> torch dtype name
    dynamic: str = "batch+seq"  # batch+seq | seq | none
    weights: str = "float32"  # float32 | float16
    output: str = "float32"  # the logits' dtype
    family: str = "gpt2"
    note: str = ""


LAYOUTS: dict[str, Layout] = {
    "batch1": Layout((("input_ids", "ids"), ("attention_mask", "mask")), dynamic="seq",
                     note="batch fixed to 1, dynamic sequence"),
    "static": Layout((("input_ids", "ids"), ("attention_mask", "mask")), dynamic="none",
                     note="fully static [1, 16]"),
    "renamed": Layout((("tok", "ids"), ("m", "mask")), note="inputs renamed tok, m"),
    "xnames": Layout((("x0", "mask"), ("x1", "ids")), note="x0 is the mask, x1 the ids"),
    "int32": Layout((("input_ids", "ids"), ("attention_mask", "mask")),
                    dtypes={"ids": "int32", "mask": "int32"}, note="int32 ids and mask"),
    "boolmask": Layout((("input_ids", "ids"), ("attention_mask", "mask")),
                       dtypes={"mask": "bool"}, note="bool attention mask"),
    "embeds": Layout((("inputs_embeds", "embeds"),), note="inputs_embeds only"),
    "fp16": Layout((("input_ids", "ids"), ("attention_mask", "mask")), weights="float16",
                   output="float16", note="fp16 weights and logits"),
    "bf16io": Layout((("inputs_embeds", "embeds"), ("attention_mask", "mask")),
                     dtypes={"embeds": "bfloat16"}, output="bfloat16",
                     note="bf16 inputs_embeds and logits, fp32 weights"),
    "bert": Layout((("input_ids", "ids"), ("attention_mask", "mask"), ("token_type_ids", "types")),
                   family="bert", note="BERT (masked LM) with token_type_ids"),
}
STATIC_SHAPE = (1, 16)


def _torch_model(layout: Layout):
    import torch
    import transformers

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(SEED)
    if layout.family == "bert":
        config = transformers.AutoConfig.for_model("bert", **BERT)
        model = transformers.AutoModelForMaskedLM.from_config(config, attn_implementation="eager")
    else:
        config = transformers.AutoConfig.for_model("gpt2", **GPT2)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.eval()
    return model.half() if layout.weights == "float16" else model.float()


def _wrapped(layout: Layout):
    import torch

    model = _torch_model(layout)
    whats = [w for _, w in layout.inputs]
    out_dtype = getattr(torch, layout.output)

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *args):
            kw = dict(zip(whats, args))
            call = {"return_dict": True}
            if "ids" in kw:
                call["input_ids"] = kw["ids"].long()
            if "embeds" in kw:
                call["inputs_embeds"] = kw["embeds"].to(next(self.model.parameters()).dtype)
            if "mask" in kw:
                call["attention_mask"] = kw["mask"].long()
            else:  # without a mask transformers looks for packed sequences (aten::diff)
                first = kw.get("ids", kw.get("embeds"))
                call["attention_mask"] = torch.ones(first.shape[:2], dtype=torch.long)
            if "types" in kw:
                call["token_type_ids"] = kw["types"].long()
            if layout.family != "bert":
                call["use_cache"] = False
            return self.model(**call).logits.to(out_dtype)

    return Wrapped().eval()


def example_inputs(layout: Layout, batch: int = 2, seq: int = 16):
    """Torch tensors in the layout's order and dtypes."""
    import torch

    if layout.dynamic != "batch+seq":
        batch = 1
    if layout.dynamic == "none":
        batch, seq = STATIC_SHAPE
    g = torch.Generator().manual_seed(SEED)
    hidden = GPT2["n_embd"] if layout.family == "gpt2" else BERT["hidden_size"]
    out = []
    for _, what in layout.inputs:
        dtype = getattr(torch, layout.dtypes.get(what, "float32" if what == "embeds" else "int64"))
        if what == "ids":
            t = torch.randint(0, 1003, (batch, seq), generator=g)
        elif what == "mask":
            t = torch.ones(batch, seq, dtype=torch.int64)
        elif what == "types":
            t = torch.randint(0, 2, (batch, seq), generator=g)
        else:
            t = torch.randn(batch, seq, hidden, generator=g)
            if layout.weights == "float16" and what == "embeds":
                t = t.half()
        out.append(t.to(dtype))
    return tuple(out)


def export(name: str, out: Path) -> Path:
    import onnx
    import torch

    layout = LAYOUTS[name]
    model = _wrapped(layout)
    args = example_inputs(layout)
    names = [n for n, _ in layout.inputs]
    axes = {"batch+seq": {0: "batch", 1: "sequence"}, "seq": {1: "sequence"}, "none": None}[
        layout.dynamic]
    dynamic = {n: axes for n in names + ["logits"]} if axes else None
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_path = Path(tmp) / out.name
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the legacy exporter's notices (see models/build.py)
            torch.onnx.export(model, args, str(tmp_path), dynamo=False, input_names=names,
                              output_names=["logits"], dynamic_axes=dynamic,
                              opset_version=OPSET_TORCHSCRIPT, do_constant_folding=True)
        proto = onnx.load(str(tmp_path))
        proto.ir_version = min(proto.ir_version, IR_VERSION)
        onnx.save(proto, str(tmp_path))
        os.replace(tmp_path, out)
    return out


def _key(name: str) -> str:
    layout = LAYOUTS[name]
    payload = json.dumps([name, repr(layout), GPT2, BERT, SEED, OPSET_TORCHSCRIPT, IR_VERSION,
                          STATIC_SHAPE], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def cached(name: str) -> Path:
    """The cached export of one layout, built on first use."""
    if name not in LAYOUTS:
        raise KeyError(f"no layout {name!r}; known: {', '.join(LAYOUTS)}")
    path = _cache_dir() / f"layout-{_key(name)}" / f"layout-{name}.onnx"
    build_once(path, path.exists, lambda: export(name, path))
    return path


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m models.layouts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", nargs="?", help=f"one of: {', '.join(LAYOUTS)}")
    p.add_argument("-o", "--output", type=Path)
    p.add_argument("--list", action="store_true")
    a = p.parse_args(argv)
    if a.list or not a.name:
        for n, lay in LAYOUTS.items():
            print(f"{n:10s} {lay.note}")
        return 0
    if a.name not in LAYOUTS:
        print(f"error: no layout {a.name!r}", file=sys.stderr)
        return 2
    print(export(a.name, a.output or Path(f"layout-{a.name}.onnx")))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
