"""What `tuner optimize FOLDER` writes beside the selected encoder-decoder folder: the record
of the run (selection.json), report.md for people and CI logs, and timings.png (each
variant's request split into encoder, first step and later steps, with the spread of the
rounds). `tuner serve OUT` reads none of them: OUT is an export folder like any other."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tuner.artifact.records import Speedup

RECORD = "selection.json"


@dataclass(frozen=True)
class FolderVariant:
    """One variant of the folder as it was built, checked and timed."""

    name: str
    transforms: tuple[str, ...]  # "decoder_model.onnx: vocab 1003->1024", one per rewrite
    gate_max_abs: float  # the largest difference any padded graph showed against its own
    cache_path_max_abs: float  # the variant's cache path against its whole-sequence decoder
    request_ms: float  # median over rounds
    request_q1_ms: float
    request_q3_ms: float
    parts_ms: tuple[float, float, float]  # medians: encoder, first step, later steps (all)
    speedup: Speedup | None  # against the original, paired round by round (None: itself)
    # the parts whose graph is the original's, byte for byte, and their time ratio (original
    # / variant medians): what this run's noise alone makes of the same work (an A/A check)
    unchanged: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class FolderSelection:
    source: str
    device: str
    backend: str
    settings: dict
    workload: dict  # batch, source tokens (None: audio), output tokens, note
    rounds: int
    margin: float
    variants: tuple[FolderVariant, ...]
    selected: str
    reason: str
    notes: tuple[str, ...]

    def to_json(self) -> dict:
        return asdict(self)


def write_folder_report(root: Path, s: FolderSelection, with_plots: bool = True) -> None:
    """selection.json, report.md and (`with_plots`) timings.png into `root`."""
    (root / RECORD).write_text(json.dumps(s.to_json(), indent=2, allow_nan=False) + "\n",
                               encoding="utf-8")
    (root / "report.md").write_text(markdown(s, with_plots), encoding="utf-8")
    if with_plots:
        _plot(s, root / "timings.png")


def _ci(sp: Speedup | None) -> str:
    return "1 (itself)" if sp is None else f"{sp.ratio:.3f}x [{sp.low:.3f}, {sp.high:.3f}]"


def markdown(s: FolderSelection, with_plots: bool = True) -> str:
    w = s.workload
    source = "audio features" if w["source_tokens"] is None else f"{w['source_tokens']} tokens"
    lines = [f"# shapetuner report: {Path(s.source).name} (encoder-decoder folder)", "",
             f"- device: {s.device}", f"- backend: {s.backend}, settings: "
             + ", ".join(f"{k}={v}" for k, v in s.settings.items()),
             f"- request: {w['batch']} stream(s) of {source} in, {w['output_tokens']} tokens "
             f"out ({w['note']})", f"- {s.rounds} interleaved rounds; a variant wins only if "
             f"its whole interval lies above {1 + s.margin:.2f}x",
             f"- **selected: {s.selected}**: {s.reason}", "",
             "| variant | request ms, median [IQR] | encoder / first step / later steps ms | "
             "speedup [95% CI] | gate max abs | cache path max abs |", "|---|---|---|---|---|---|"]
    for v in s.variants:
        e, f, later = v.parts_ms
        lines.append(f"| {v.name} | {v.request_ms:.2f} [{v.request_q1_ms:.2f}, "
                     f"{v.request_q3_ms:.2f}] | {e:.2f} / {f:.2f} / {later:.2f} | {_ci(v.speedup)} "
                     f"| {v.gate_max_abs:.3g} | {v.cache_path_max_abs:.3g} |")
    for v in s.variants:
        lines += [f"- {v.name}: " + ("; ".join(v.transforms) or "the folder as given")
                  + "".join(f"; its {part} is the original's, byte for byte, and timed "
                            f"{ratio:.3f}x it: this run's noise" for part, ratio in v.unchanged)]
    lines += [f"- note: {n}" for n in s.notes]
    lines += (["", "Plot: timings.png."] if with_plots else []) + [""]
    return "\n".join(lines)


def _plot(s: FolderSelection, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [v.name for v in s.variants]
    fig, ax = plt.subplots(figsize=(7, 0.6 + 0.55 * len(names)))
    left = [0.0] * len(names)
    for i, part in enumerate(("encoder", "first step", "later steps")):
        widths = [v.parts_ms[i] for v in s.variants]
        ax.barh(names, widths, left=left, label=part)
        left = [a + b for a, b in zip(left, widths)]
    ax.errorbar([v.request_ms for v in s.variants], names, fmt="none", ecolor="black",
                xerr=[[v.request_ms - v.request_q1_ms for v in s.variants],
                      [v.request_q3_ms - v.request_ms for v in s.variants]], capsize=3)
    ax.invert_yaxis()
    ax.set_xlabel("ms per request (median of rounds; bars: the interquartile range)")
    ax.set_title(f"{Path(s.source).name}: selected {s.selected}")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize="small")
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
