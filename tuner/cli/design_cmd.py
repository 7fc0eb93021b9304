"""`tuner design --params 2.7e9 ...`: the paper's co-design search (tuner.design)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from tuner.cli.app import app
from tuner.errors import BadInput
from tuner.util.files import ensure_writable_dir
from tuner.util.progress import rich_progress


def _parse_params(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise BadInput(f"--params must be a number like 125e6 or 2.7e9, not {text!r}") from None
    if not value >= 1:
        raise BadInput(f"--params must be a positive count, not {text!r}")
    return int(value)


@app.command("design")
def design(
    params: Optional[str] = typer.Option(None, "--params", help="Target parameter count, e.g. 2.7e9 (default: the starting shape's)."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Search this depth only."),
    layers_range: Optional[str] = typer.Option(None, "--layers-range", help="Search depths A:B (inclusive)."),
    seq: Optional[int] = typer.Option(None, "--seq", help="Sequence length (default 2048 on a GPU, 128 on the CPU)."),
    batch: Optional[int] = typer.Option(None, "--batch", help="Batch size (default 8 on a GPU, 1 on the CPU)."),
    vocab: Optional[int] = typer.Option(None, "--vocab", help="Vocabulary size (default: the start's, else 50257); candidates pad it to a multiple of 64."),
    ffn: Optional[str] = typer.Option(None, "--ffn", help="plain (GELU, GPT-NeoX-style) or swiglu (Llama-style)."),
    family: Optional[str] = typer.Option(None, "--family", help="gpt2 | gpt_neox | llama: biases, norms, tied head."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | gpu | a100 | h100 | h200."),
    top: int = typer.Option(10, "--top", help="Rows to show."),
    out: Optional[Path] = typer.Option(None, "-o", "--out", help="Write design.json, design.md and design.png here."),
    from_model: Optional[Path] = typer.Option(None, "--from", help="Read the starting shape from this ONNX model (tuner inspect)."),
    hidden: Optional[int] = typer.Option(None, "--hidden", help="Starting shape: hidden size."),
    heads: Optional[int] = typer.Option(None, "--heads", help="Starting shape: attention heads."),
    ffn_size: Optional[int] = typer.Option(None, "--ffn-size", help="Starting shape: FFN width."),
    kv_heads: Optional[int] = typer.Option(None, "--kv-heads", help="Starting shape: kv heads (default: --heads)."),
    tolerance: float = typer.Option(0.05, "--tolerance", help="Parameter tolerance, 0.05 = +-5%."),
    max_candidates: int = typer.Option(24, "--max-candidates", help="Shapes measured besides the start."),
    rounds: Optional[int] = typer.Option(None, "--rounds", help="Interleaved timing rounds (default 15 on a GPU, 30 on the CPU)."),
    threads: int = typer.Option(0, "--threads", help="ONNX Runtime intra-op threads on the CPU (0: its default)."),
    json_out: bool = typer.Option(False, "--json", help="Print the ranking as JSON instead of the table."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
) -> None:
    """Rank whole transformer shapes near a parameter budget by measured throughput on this
    device: the paper's co-design search (Anthony et al. 2024)."""
    import json
    import sys

    # here, not at the top: every `tuner` command would otherwise import the search and
    # its runtime probes (0.4 s) before doing anything
    from tuner.design import report
    from tuner.design.search import (DEFAULT_VOCAB, DesignRequest, family_for, parse_layers,
                                     run, start_from_flags, start_from_model)

    if top < 1:
        raise BadInput(f"--top must be >= 1, not {top}")
    target = _parse_params(params) if params is not None else None
    depths = parse_layers(layers, layers_range)
    flags = [hidden, heads, ffn_size]
    if from_model is not None and any(v is not None for v in flags + [kv_heads]):
        raise BadInput("--from and --hidden/--heads/--ffn-size/--kv-heads both describe the "
                       "starting shape: give one")
    if any(v is not None for v in flags) and not all(v is not None for v in flags):
        raise BadInput("a starting shape needs all of --hidden, --heads and --ffn-size")
    start = None
    if from_model is not None:
        fam = family_for(ffn, family) if (ffn or family) else None
        start = start_from_model(from_model, fam)
    elif hidden is not None:
        fam = family_for(ffn, family)
        start = start_from_flags(hidden, heads, ffn_size, layers if layers_range is None else None,
                                 vocab or DEFAULT_VOCAB, fam, kv_heads, target=target)
    req = DesignRequest(target, start, depths, vocab, ffn, family, tolerance, max_candidates)
    if out is not None:  # before minutes of measuring, not at the end

        ensure_writable_dir(out, "design report")
    with rich_progress(enabled=not quiet and not json_out, title="design") as bar:
        ranking, meta = run(req, device, batch, seq, rounds, threads, bar)
    if json_out:
        print(json.dumps({**meta, **ranking.to_json()}, indent=2))
    else:
        print_ranking(ranking, meta, top)
    if out is not None:
        paths = report.write(ranking, out, meta, top)
        print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)


def print_ranking(ranking, meta: dict, top: int) -> None:
    from tuner.design import report

    console = Console()
    if not console.is_terminal:  # a file or a pipe: do not wrap the table at 80 columns
        console = Console(width=160)
    console.print(report.rich_table(ranking, top))
    for line in report.header_lines(ranking, meta):
        console.print(line, style="dim", highlight=False)
    console.print(report.verdict(ranking), highlight=False)
    for note in ranking.best.notes:
        console.print(f"  - {note}", highlight=False)
