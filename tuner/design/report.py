"""The ranking as a terminal table (rich), markdown, JSON and a plot of throughput against
parameter count with the starting shape marked. Rendering only: no measuring here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.table import Table

from tuner.design.rank import RankedShape, Ranking
from tuner.util.files import atomic_write

COLUMNS = ("#", "shape", "d", "v", "params", "tokens/s", "TFLOP/s", "forward ms [q1, q3]",
           "speedup [95% CI]", "")
CPU_NOTE = ("CPU: no tensor-core tiles or waves; shape effects come from SIMD blocking and caches "
            "and are usually small, so expect many ties (docs/design.md).")
SCOPE_NOTE = ("Times are the sums of the model's GEMMs and attention matmuls (L layers + LM head), "
              "measured interleaved; element-wise ops and the embedding lookup are not included.")


def shown_rows(ranking: Ranking, top: int) -> list[tuple[int, RankedShape]]:
    """The top rows, plus the baseline (with its real rank) when it falls outside them."""
    rows = list(enumerate(ranking.rows, 1))
    shown = rows[:top]
    if all(r.name != ranking.baseline for _, r in shown):
        shown += [(i, r) for i, r in rows if r.name == ranking.baseline]
    return shown


def _cells(i: int, r: RankedShape, ranking: Ranking) -> list[str]:
    s, t, sp = r.cost.candidate.shape, r.total, r.speedup
    marks = (["baseline"] if r.name == ranking.baseline else []) + \
        (["~ next"] if r.tied_with_next else [])
    mark = ", ".join(marks)
    flops = f"{r.tflops:.1f}" if r.tflops >= 1 else f"{r.tflops:.3f}"
    return [str(i), r.name, str(s.head_dim), str(s.vocab_size),
            f"{r.cost.candidate.params / 1e6:,.1f}M", f"{r.tokens_per_s:,.0f}", flops,
            f"{t.median:.2f} [{t.q1:.2f}, {t.q3:.2f}]",
            f"{sp.ratio:.3f} [{sp.low:.3f}, {sp.high:.3f}]", mark]


def header_lines(ranking: Ranking, meta: dict[str, Any]) -> list[str]:
    s = ranking.settings
    base = ("the starting shape" if ranking.baseline_kind == "start"
            else "the slowest shape measured (no starting shape given)")
    n = meta.get('candidates', len(ranking.rows))
    lines = [f"Target {meta.get('target', 0):,} parameters +-{meta.get('tolerance', 0.05):.0%}; "
             f"{n} shape{'' if n == 1 else 's'} measured on "
             f"{ranking.device.name} ({s.backend}), batch {s.batch} x seq {s.seq}, "
             f"{s.rounds} interleaved rounds.",
             f"Speedup is over {base}, median of paired per-round ratios with a 95% bootstrap "
             f"interval; '~ next' marks a row not faster than the next by over 1% beyond noise.", SCOPE_NOTE]
    if ranking.device.kind == "cpu":
        lines.append(CPU_NOTE)
    return lines


def verdict(ranking: Ranking) -> str:
    """One line: the best shape and whether it beats the baseline beyond noise."""
    best, sp = ranking.best, ranking.best.speedup
    if len(ranking.rows) == 1:  # nothing else was measured: "none faster" would mislead
        return (f"best: {best.name}, the only shape measured: no other shape fits the parameter "
                f"target (widen --tolerance or change --layers)")
    if best.name == ranking.baseline:
        return f"best: {best.name}, the baseline itself: no shape measured faster"
    line = (f"best: {best.name}, {sp.ratio:.3f}x [{sp.low:.3f}, {sp.high:.3f}] over "
            f"{ranking.baseline}")
    if not sp.above(1.0):
        line += " (within the noise: not a measured win)"
    return line


def rich_table(ranking: Ranking, top: int) -> Table:
    """The ranking as a rich table (the CLI prints it, with header_lines and verdict)."""
    table = Table(title="tuner design: shapes ranked by measured throughput")
    for col in COLUMNS:
        table.add_column(col, justify="right" if col not in ("shape", "") else "left")
    for i, r in shown_rows(ranking, top):
        style = "bold green" if i == 1 else ("yellow" if r.name == ranking.baseline else None)
        table.add_row(*_cells(i, r, ranking), style=style)
    return table


def markdown(ranking: Ranking, meta: dict[str, Any], top: int) -> str:
    out = ["# tuner design", ""] + [f"{line}  " for line in header_lines(ranking, meta)] + [""]
    out.append("| " + " | ".join(COLUMNS[:-1]) + " | note |")
    out.append("|" + "---|" * len(COLUMNS))
    for i, r in shown_rows(ranking, top):
        out.append("| " + " | ".join(_cells(i, r, ranking)) + " |")
    out += ["", verdict(ranking), "", "## Why", ""]
    for i, r in shown_rows(ranking, top):
        out.append(f"**{i}. {r.name}** ({r.cost.candidate.shape.label()})")
        out += [f"- {n}" for n in r.notes] + [""]
    noisy = ranking.noisy_pairs()
    if noisy:
        out.append("Orders within the noise: " + "; ".join(f"{a} ~ {b}" for a, b in noisy) + ".")
    return "\n".join(out) + "\n"


def plot(ranking: Ranking, path: Path, target: int | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    toks = ranking.settings.tokens
    for r in ranking.rows:
        p = r.cost.candidate.params / 1e6
        lo, hi = toks / (r.total.q3 * 1e-3), toks / (r.total.q1 * 1e-3)
        is_base = r.name == ranking.baseline
        ax.errorbar([p], [r.tokens_per_s], yerr=[[r.tokens_per_s - lo], [hi - r.tokens_per_s]],
                    fmt="*" if is_base else "o", ms=14 if is_base else 6,
                    color="crimson" if is_base else ("green" if r is ranking.best else "tab:blue"),
                    capsize=3, label=("baseline: " + r.name) if is_base else
                    ("best: " + r.name) if r is ranking.best else None)
    if target:
        ax.axvline(target / 1e6, color="grey", ls="--", lw=1, label="target")
    ax.set_xlabel("parameters (millions)")
    ax.set_ylabel("tokens / s (whole-model GEMMs; bars: interquartile range)")
    s = ranking.settings
    ax.set_title(f"{ranking.device.name}, {s.backend}, batch {s.batch} x seq {s.seq}")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(ranking: Ranking, out_dir: Path, meta: dict[str, Any], top: int) -> dict[str, Path]:
    """design.json, design.md and design.png under out_dir; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "design.json", "markdown": out_dir / "design.md",
             "plot": out_dir / "design.png"}
    atomic_write(paths["json"], json.dumps({**meta, **ranking.to_json()}, indent=2) + "\n")
    atomic_write(paths["markdown"], markdown(ranking, meta, top))
    plot(ranking, paths["plot"], meta.get("target"))
    return paths
