"""report.md and report.html (with matplotlib plots) for an artifact: what was measured, what
won and by how much, with the interval, and how the buckets cover the traffic."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Mapping

from tuner.artifact.records import Manifest, parse_shape_key
from tuner.artifact.report_html import render

Shape = tuple[int, int]


def _fmt_ci(sp) -> str:
    return "-" if sp is None else f"{sp.ratio:.3f}x [{sp.low:.3f}, {sp.high:.3f}]"


def _shared_shapes(m: Manifest) -> list[str]:
    keys = set.intersection(*(set(v.latency) for v in m.variants)) if m.variants else set()
    return sorted(keys, key=parse_shape_key)


def markdown(m: Manifest, coverage: Mapping[int, float] | None = None,
             with_plots: bool = True) -> str:
    sel = m.selected_variant()
    lines = [f"# shapetuner report: {Path(m.source_path).name}", "",
             f"- device: {m.device_label}", f"- backend: {m.backend}, settings: "
             + ", ".join(f"{k}={v}" for k, v in m.settings.items()),
             f"- source sha256: `{m.source_sha256}`",
             f"- **selected: `{m.selected}`** ({sel.path})", f"- why: {m.selection}", "",
             "## Variants", "",
             "Speedup = time(original) / time(variant): median of per-round paired ratios, "
             f"95% bootstrap interval; a variant wins only if the interval lies above "
             f"{1 + m.margin:.2f}x. Variants were compared at "
             f"{', '.join(_shared_shapes(m)) or '-'} (batch x seq); the selected one was then "
             "timed at every bucket shape.", "",
             "| variant | exact | gate | max abs err | transforms | speedup [95% CI] | latency (median, IQR) |",
             "|---|---|---|---|---|---|---|"]
    for v in m.variants:
        lat = "; ".join(f"{k}: {x.median_ms:.2f} ms (IQR {x.spread_ms:.2f})"
                        for k, x in sorted(v.latency.items(), key=lambda kv: parse_shape_key(kv[0]))[:4])
        more = "" if len(v.latency) <= 4 else f" (+{len(v.latency) - 4} shapes)"
        err = "-" if v.accuracy.max_abs_error is None else f"{v.accuracy.max_abs_error:.2g}"
        lines.append(f"| {v.name} | {v.exact} | {'pass' if v.accuracy.passed else 'FAIL'} | {err} | "
                     f"{', '.join(t.label() for t in v.transforms) or '-'} | {_fmt_ci(v.speedup)} | "
                     f"{lat}{more} |")
    if m.advice:
        lines += ["", "## What a retrain would buy (--advise)", "",
                  "Not exact: these change trained weights' meaning, so they are never selected "
                  "or served. Measured at the GEMM level with random weights.", "",
                  "| reshape | changes | speedup [95% CI] | how |", "|---|---|---|---|"]
        lines += [f"| {a.name} | {', '.join(t.label() for t in a.transforms)} | "
                  f"{_fmt_ci(a.speedup)} | {a.note} |" for a in m.advice]
    b = m.buckets
    lines += ["", "## Buckets", "", f"- batch: {list(b.batch)}", f"- sequence: {list(b.seq)}",
              f"- traffic: {b.source}" + (f" ({b.requests} requests)" if b.requests else "")]
    if b.expected is not None:
        e = b.expected
        lines += [f"- expected latency per request: **{e.chosen_ms:.2f} ms** with these buckets, "
                  f"{e.pad_to_max_ms:.2f} ms padding every request to the maximum, "
                  f"{e.no_buckets_ms:.2f} ms running each at its own shape (interpolated "
                  "between measured shapes; no batching possible)"]
    if coverage:
        lines += ["", "| seq bucket | share of requests |", "|---|---|"]
        lines += [f"| {s} | {w:.1%} |" for s, w in sorted(coverage.items())]
    if m.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in m.notes]
    lines += ["", "Plots: report.html." if with_plots else "Tables: report.html (no plots drawn).",
              ""]
    return "\n".join(lines)


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def plots(m: Manifest, req=None, grid_latency: Mapping[Shape, float] | None = None,
          coverage: Mapping[int, float] | None = None) -> dict[str, str]:
    """Base64 PNGs: latency per variant and bucket, speedup with CI, bucket coverage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {}
    # 1. latency per variant at the comparison shapes
    fig, ax = plt.subplots(figsize=(7, 3.2))
    shared = _shared_shapes(m)
    width = 0.8 / max(len(m.variants), 1)
    for i, v in enumerate(m.variants):
        xs = [j + i * width for j in range(len(shared))]
        med = [v.latency[k].median_ms for k in shared]
        err = [[v.latency[k].median_ms - v.latency[k].q1_ms for k in shared],
               [v.latency[k].q3_ms - v.latency[k].median_ms for k in shared]]
        ax.bar(xs, med, width, yerr=err, label=v.name, capsize=2)
    ax.set_xticks([j + width * (len(m.variants) - 1) / 2 for j in range(len(shared))], shared)
    ax.set_xlabel("shape (batch x seq)")
    ax.set_ylabel("ms (median, IQR)")
    ax.legend(fontsize=7)
    ax.set_title("latency per variant")
    out["latency"] = _png(fig)
    # 2. speedup with its interval
    vs = [v for v in m.variants if v.speedup is not None]
    if vs:
        fig, ax = plt.subplots(figsize=(7, 0.5 + 0.4 * len(vs)))
        for i, v in enumerate(vs):
            s = v.speedup
            ax.errorbar([s.ratio], [i], xerr=[[s.ratio - s.low], [s.high - s.ratio]], fmt="o", capsize=3)
        ax.axvline(1.0, color="gray", lw=1)
        ax.axvline(1.0 + m.margin, color="red", lw=1, ls="--", label=f"win threshold {1 + m.margin:.2f}x")
        ax.set_yticks(range(len(vs)), [v.name for v in vs])
        ax.set_xlabel("speedup over original (95% CI)")
        ax.legend(fontsize=7)
        out["speedup"] = _png(fig)
    # 3. latency of the selected variant on the bucket grid
    if grid_latency:
        fig, ax = plt.subplots(figsize=(7, 3))
        for b in sorted({x for x, _ in grid_latency}):
            pts = sorted((s, t) for (bb, s), t in grid_latency.items() if bb == b)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"batch {b}")
        for s in m.buckets.seq:
            ax.axvline(s, color="gray", lw=0.8, ls=":")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("ms (median)")
        ax.set_title(f"{m.selected} on the bucket grid (dotted: chosen buckets)")
        ax.legend(fontsize=7)
        out["buckets"] = _png(fig)
    # 4. coverage: the request lengths against the buckets
    if req is not None:
        fig, ax = plt.subplots(figsize=(7, 3))
        seqs: dict[int, float] = {}
        for (_, s), w in req.weights.items():
            seqs[s] = seqs.get(s, 0.0) + w
        total = sum(seqs.values())
        ax.bar(list(seqs), [w / total for w in seqs.values()], width=1.0, color="tab:blue")
        for s in m.buckets.seq:
            share = f" {coverage.get(s, 0):.0%}" if coverage else ""
            ax.axvline(s, color="red", lw=1)
            ax.text(s, ax.get_ylim()[1] * 0.9, share, color="red", fontsize=7, ha="right")
        ax.set_xlabel("request sequence length")
        ax.set_ylabel("share of requests")
        ax.set_title("bucket coverage (red: bucket tops, with the share each serves)")
        out["coverage"] = _png(fig)
    return out


def write_report(root: Path, m: Manifest, req=None, grid_latency=None, coverage=None,
                 phases=None, with_plots: bool = True) -> None:
    """OUT/report.md (markdown, for humans and CI logs) and OUT/report.html (the rendered page
    with the plots, or its tables alone without `with_plots`; `phases`: optional
    tuner.artifact.report_html.PhaseRow list for decoders)."""
    md = markdown(m, coverage, with_plots)
    (root / "report.md").write_text(md, encoding="utf-8")
    imgs = plots(m, req, grid_latency, coverage) if with_plots else {}
    page = render(m, images=imgs, coverage=coverage, phases=phases)
    (root / "report.html").write_text(page, encoding="utf-8")
