"""`tuner inspect MODEL.onnx [--json] [--device cpu|a100|h100|h200] [--tokens 4096]`."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from tuner.cli.app import app, roles_option, with_roles, write_out
from tuner.errors import BadInput

if TYPE_CHECKING:
    from tuner.graph.roles import InputSpec
    from tuner.graph.shape import ModelShape


def _ffn_value(shape: ModelShape) -> str:
    if not shape.ffn_size and shape.sites.experts:
        return f"{shape.sites.experts[0].width} per expert"
    return f"{shape.ffn_size}{' gated' if shape.ffn_gated else ''} {shape.activation}"


def _where(shape: ModelShape) -> dict[str, str]:
    """A short "where it lives" for each dim, from layer 0's sites."""
    sites = shape.sites
    first = sites.layers[0] if sites.layers else None
    attn = first.attention if first else None
    ffn = first.ffn if first else None
    out: dict[str, str] = {"layers": f"{sum(1 for l in sites.layers if l.attention)} attention + "
                                     f"{sum(1 for l in sites.layers if l.ffn)} FFN blocks"
                                     + (f" + {len(sites.experts)} expert blocks"
                                        if sites.experts else "")}
    if sites.embedding:
        out["hidden_size"] = f"token embedding {sites.embedding}"
    if attn is not None:
        proj = (f"fused qkv {attn.qkv}" if attn.qkv else f"q {attn.q}, k {attn.k}, v {attn.v}")
        out["num_heads"] = proj + (f" ({attn.fused_op})" if attn.fused_op else "")
        out["head_dim"] = f"{len(attn.reshapes)} Reshape/Split/Slice nodes, o {attn.o}"
        value = f" {attn.scale.value:.6g}" if attn.scale.value is not None else ""
        out["scale"] = f"{attn.scale.kind}{value} at {', '.join(attn.scale.nodes[:2]) or '-'}"
        rot = attn.rotary + (f" ({attn.rotary_dim} of {shape.head_dim} dims)" if attn.rotary_dim else "")
        out["rotary"] = rot
    if ffn is not None:
        gate = f", gate {ffn.gate}" if ffn.gate else ""
        out["ffn_size"] = f"up {ffn.up}{gate}, down {ffn.down}"
    elif sites.experts:
        e = sites.experts[0]
        out["ffn_size"] = (f"{e.count} experts of width {e.width} (up {e.up}, down {e.down}): "
                           "a mixture of experts, not padded")
    if sites.lm_head:
        tied = " (tied to the embedding)" if sites.tied else ""
        out["vocab_size"] = f"{sites.lm_head}, weight {sites.lm_head_weight}{tied}"
    return out


def _cache_lines(shape: ModelShape) -> list[str]:
    """The KV cache in a few lines: what a serving engine must allocate, and its names."""
    c = shape.cache
    if c is None:
        return ["KV cache: none (no past key/value inputs)"]
    per_token = f"{c.bytes_per_token} bytes per token" if c.bytes_per_token else "size unknown"
    first, last = c.layers[0], c.layers[-1]
    lines = [
        f"KV cache: {c.num_layers} layers x {c.num_kv_heads} kv heads x head dim {c.head_dim}"
        + (f" (keys; values {c.value_head_dim}: multi-head latent attention)"
           if c.value_head_dim else "") + f", layout {c.layout}, {c.dtype}, {per_token} (K and V)",
        f"  axes: batch {c.batch_dim or '-'}, past {c.past_dim or '-'}, "
        f"present {c.present_dim or '-'}",
        f"  layer 0: {first.past_key}, {first.past_value} -> "
        f"{first.present_key or '-'}, {first.present_value or '-'}",
    ]
    if c.num_layers > 1:
        lines.append(f"  layer {last.index}: {last.past_key}, {last.past_value} -> "
                     f"{last.present_key or '-'}, {last.present_value or '-'}")
    if c.named_by == "names":
        lines.append("  (key/value told apart by input names: the structure left it open)")
    if c.mask == "lengths":
        lines.append("  mask read as lengths (GroupQueryAttention's seqlens_k): each row's "
                     "entries start at 0, right padding")
    if c.windowed_layers:
        lines.append(f"  windowed cache (onnxruntime-genai's): layer(s) "
                     f"{', '.join(map(str, c.windowed_layers))} hold only the last {c.window} "
                     "positions; `tuner optimize` makes them full-length first")
    return lines
def render_inputs(specs: list[InputSpec], console: Console) -> None:
    table = Table(title="inputs (roles found from the graph's structure)", title_justify="left")
    for col in ("input", "role", "dtype", "dims", "batch axis", "seq axis"):
        table.add_column(col)
    for s in specs:
        dims = "(" + ", ".join(str(d) if d is not None else "?" for d in s.dims) + ")"
        table.add_row(s.name, s.role, s.dtype, dims,
                      "-" if s.batch_axis is None else str(s.batch_axis),
                      "-" if s.seq_axis is None else str(s.seq_axis))
    console.print(table)


def render(shape: ModelShape, console: Console) -> None:
    where = _where(shape)
    kind = shape.kind + (" (of an encoder-decoder)" if shape.cross_attention else "")
    kind += (" (ORT-optimized: " + ", ".join(shape.fused_ops) + ")") if shape.optimized else ""
    head = " with a masked LM's head" if shape.kind == "encoder" and shape.vocab_size else ""
    table = Table(title=f"{kind} transformer{head}", title_justify="left")
    table.add_column("dimension")
    table.add_column("value", justify="right")
    table.add_column("where it lives (layer 0)", overflow="fold")
    rows = [
        ("layers", shape.num_layers, where.get("layers", "")),
        ("hidden size", shape.hidden_size, where.get("hidden_size", "")),
        ("heads", shape.num_heads, where.get("num_heads", "")),
        ("kv heads", shape.num_kv_heads, ""),
        ("head dim", shape.head_dim, where.get("head_dim", "")),
        ("softmax scale", "", where.get("scale", "")),
        ("rotary", "", where.get("rotary", "none")),
        ("FFN width", _ffn_value(shape), where.get("ffn_size", "")),
        ("vocabulary", shape.vocab_size if shape.vocab_size is not None else "- (encoder)",
         where.get("vocab_size", "")),
    ]
    if shape.cross_attention:
        source = (f"keys and values from the encoder's output {shape.encoder_input}"
                  if shape.encoder_input else "keys and values fed as a cache of the encoder's "
                  "length (computed once per request by the decoder's first step)")
        rows.insert(7, ("cross-attention", shape.cross_attention, f"{source}; not padded"))
    for name, value, place in rows:
        table.add_row(name, str(value), place)
    console.print(table)
    if shape.kind == "decoder":
        for line in _cache_lines(shape):
            console.print(line, highlight=False, markup=False)
    if not shape.findings:
        console.print("findings: none")
        return
    found = Table(title="findings", title_justify="left")
    found.add_column("severity")
    found.add_column("rule")
    found.add_column("what to change, and why", overflow="fold")
    for f in shape.findings:
        found.add_row(f.severity, f.rule, f.message)
    console.print(found)


@app.command("inspect")
@with_roles
def inspect(
    model: Path = typer.Argument(..., help="the exported model (.onnx; external data beside "
                                 "it), or an export folder (each of its graphs)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object (docs/design.md contract)"),
    device: str = typer.Option("cpu", "--device", help="hardware facts for the findings: "
                               "a100, h100, h200 or cpu"),
    tokens: int = typer.Option(4096, "--tokens", min=1,
                               help="rows per GEMM (batch x sequence) for the wave findings"),
    roles: list[str] = roles_option(),
) -> None:
    """Find the transformer's dimensions, where each lives in the graph, and shape findings.
    Given an export folder (an Optimum encoder-decoder), each of its graphs in turn."""
    from tuner.hardware.facts import device_facts

    device_facts(device)  # an unknown device is bad input before any file is read
    if model.is_dir():
        write_out(_folder_text(model, as_json, device, tokens))
        return
    shape, specs = _read(model, device, tokens)
    if as_json:
        text = json.dumps(_as_json(shape, specs), indent=2) + "\n"
    else:
        # rendered to a string, then written in one go: rich would turn a reader that went
        # away (`tuner inspect X | head`) into its own silent exit 1; a plain write raises
        # BrokenPipeError, which the entry point answers with 141 like any other command
        buffer = io.StringIO()
        console = Console(file=buffer, width=160, force_terminal=sys.stdout.isatty())
        render(shape, console)
        render_inputs(specs, console)
        text = buffer.getvalue()
    write_out(text)


def _read(model, device: str, tokens: int):
    """(audited shape, input specs) of a path or a loaded onnx_ir model."""
    from tuner.graph.inspect import inspect_model
    from tuner.graph.load import load_model
    from tuner.graph.roles import input_specs
    from tuner.plan.findings import audited

    if isinstance(model, Path):
        model = load_model(model)
    return audited(inspect_model(model), device=device, tokens=tokens), input_specs(model)


def _as_json(shape: ModelShape, specs: list[InputSpec]) -> dict:
    return {**shape.to_json(), "inputs": [s.to_json() for s in specs]}


def _folder_text(folder: Path, as_json: bool, device: str, tokens: int) -> str:
    """Every graph of an export folder (a merged decoder named, not read: its branches are
    the plain decoders beside it); --json: {"graphs": {file: inspect's object}, ...}."""
    from tuner.graph.load import folder_graphs

    plain, merged_paths = folder_graphs(folder, lambda model: _read(model, device, tokens))
    if not plain and not merged_paths:
        raise BadInput(f"{folder}: a folder without .onnx graphs")
    merged = [p.name for p in merged_paths]
    read = {p.name: shape_and_specs for p, shape_and_specs in plain.items()}
    if as_json:
        return json.dumps({"graphs": {n: _as_json(*r) for n, r in read.items()},
                           "merged": merged}, indent=2) + "\n"
    buffer = io.StringIO()
    console = Console(file=buffer, width=160, force_terminal=sys.stdout.isatty())
    for name, (shape, specs) in read.items():
        console.rule(name)
        render(shape, console)
        render_inputs(specs, console)
    for name in merged:
        console.print(f"{name}: a merged decoder (layers inside an If): its branches are the "
                      "plain decoders beside it", highlight=False, markup=False)
    return buffer.getvalue()
