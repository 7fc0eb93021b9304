"""report.html: the artifact's report as a real HTML page, rendered by jinja2.

The template (tuner/artifact/templates/report.html.j2) only lays out tables; every number is formatted
here, so the page and report.md can be checked against the same Manifest. Autoescape is on:
variant notes, file paths and selection reasons come from the user's model and traffic, and
must never become markup.

A decoder report will add per-phase latencies: `render` takes an optional `phases` list
(prefill and decode side by side per variant and shape) and the template shows it when
present.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import jinja2

from tuner.artifact.records import Latency, Manifest, Speedup, Variant, parse_shape_key

TEMPLATE = "report.html.j2"
# tuner.artifact.report.plots' keys, as the page titles them
_IMAGE_TITLES = {"latency": "Latency per variant at the comparison shapes",
                 "speedup": "Speedup over the original, with its 95% interval",
                 "buckets": "The selected variant on the bucket grid",
                 "coverage": "Bucket coverage of the request lengths"}


@dataclass(frozen=True)
class Table:
    """Headers and rows of already formatted cells; `wide` tables scroll sideways."""

    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    caption: str = ""
    highlight: frozenset[int] = field(default_factory=frozenset)  # row indexes to mark

    def __post_init__(self) -> None:
        bad = [r for r in self.rows if len(r) != len(self.headers)]
        if bad:
            raise ValueError(f"table row {bad[0]!r} has {len(bad[0])} cells, expected "
                             f"{len(self.headers)}")


@dataclass(frozen=True)
class PhaseRow:
    """One variant at one shape of a decoder: prefill (b x s) and decode (b x 1 against a cache
    of length `past`) timed separately, since decode is memory-bound and prefill is not."""

    variant: str
    shape: str  # "batch x seq" of the prefill
    prefill: Latency | None
    decode: Latency | None  # per generated token
    past: int | None = None  # cache length the decode step ran against


def fmt_latency(x: Latency | None) -> str:
    return "-" if x is None else f"{x.median_ms:.2f} ms ± {x.spread_ms:.2f}"


def fmt_speedup(s: Speedup | None) -> str:
    return "-" if s is None else f"{s.ratio:.3f}x [{s.low:.3f}, {s.high:.3f}]"


def _fmt_err(x: float | None) -> str:
    return "-" if x is None else f"{x:.2g}"


def _shape_keys(variants: Sequence[Variant]) -> list[str]:
    """Every shape any variant was timed at, in (batch, seq) order."""
    return sorted({k for v in variants for k in v.latency}, key=parse_shape_key)


def _shared_keys(variants: Sequence[Variant]) -> list[str]:
    """The comparison shapes: those every variant was timed at."""
    if not variants:
        return []
    keys = set.intersection(*(set(v.latency) for v in variants))
    return sorted(keys, key=parse_shape_key)


def variants_table(m: Manifest) -> Table:
    shared = _shared_keys(m.variants)
    headers = ("variant", "exact", "transforms", "accuracy", "max abs err", "max rel err",
               *(f"{k} (median ± IQR)" for k in shared), "speedup [95% CI]", "note")
    rows = []
    for v in m.variants:
        acc = v.accuracy
        rows.append((v.name, "yes" if v.exact else "no",
                     ", ".join(t.label() for t in v.transforms) or "-",
                     "pass" if acc.passed else "FAIL", _fmt_err(acc.max_abs_error),
                     _fmt_err(acc.max_rel_error), *(fmt_latency(v.latency[k]) for k in shared),
                     fmt_speedup(v.speedup), v.note or acc.detail or ""))
    chosen = frozenset(i for i, v in enumerate(m.variants) if v.name == m.selected)
    return Table(headers, tuple(rows), "latency at the comparison shapes (batch x seq)", chosen)


def latency_table(m: Manifest) -> Table | None:
    """Every measured shape against every variant: the selected one was also timed on the whole
    bucket grid, so this is where those numbers show. None if no variant has more shapes than
    the comparison shapes (the variants table already shows them all)."""
    keys = _shape_keys(m.variants)
    if keys == _shared_keys(m.variants):
        return None
    rows = tuple((k, *(fmt_latency(v.latency.get(k)) for v in m.variants)) for k in keys)
    return Table(("shape", *(v.name for v in m.variants)), rows,
                 "median ± IQR per measured shape (batch x seq)")


def advice_table(m: Manifest) -> Table | None:
    if not m.advice:
        return None
    rows = tuple((a.name, ", ".join(t.label() for t in a.transforms), fmt_speedup(a.speedup),
                  a.note) for a in m.advice)
    return Table(("reshape", "changes", "speedup [95% CI]", "how"), rows)


def coverage_table(coverage: Mapping[int, float] | None) -> Table | None:
    if not coverage:
        return None
    return Table(("seq bucket", "share of requests"),
                 tuple((str(s), f"{w:.1%}") for s, w in sorted(coverage.items())))


def phases_table(phases: Sequence[PhaseRow] | None) -> Table | None:
    """Prefill and decode side by side: one row per (variant, shape)."""
    if not phases:
        return None
    rows = tuple((p.variant, p.shape, fmt_latency(p.prefill),
                  "-" if p.past is None else str(p.past), fmt_latency(p.decode))
                 for p in phases)
    return Table(("variant", "prefill shape", "prefill (median ± IQR)", "decode past",
                  "decode per token (median ± IQR)"), rows)


def header(m: Manifest) -> dict[str, str]:
    sel = m.selected_variant()
    return {"source": Path(m.source_path).name, "source_path": m.source_path,
            "sha256": m.source_sha256, "device": m.device_label, "backend": m.backend,
            "settings": ", ".join(f"{k}={v}" for k, v in m.settings.items()) or "-",
            "selected": m.selected, "selected_path": sel.path, "why": m.selection or "-"}


def buckets_view(m: Manifest) -> dict[str, object]:
    b, e = m.buckets, m.buckets.expected
    return {"batch": ", ".join(map(str, b.batch)), "seq": ", ".join(map(str, b.seq)),
            "traffic": b.source + (f" ({b.requests} requests)" if b.requests else ""),
            "expected": None if e is None else {
                "chosen": f"{e.chosen_ms:.2f} ms", "pad_to_max": f"{e.pad_to_max_ms:.2f} ms",
                "no_buckets": f"{e.no_buckets_ms:.2f} ms"}}


def _environment() -> jinja2.Environment:
    # PackageLoader reads the template through importlib.resources: works from a wheel too
    return jinja2.Environment(loader=jinja2.PackageLoader("tuner.artifact", "templates"),
                              autoescape=True, undefined=jinja2.StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True)


def render(m: Manifest, images: Mapping[str, str] | None = None,
           coverage: Mapping[int, float] | None = None,
           phases: Sequence[PhaseRow] | None = None) -> str:
    """The whole page. `images`: title -> base64 PNG (tuner.artifact.report.plots)."""
    return _environment().get_template(TEMPLATE).render(
        h=header(m), margin=f"{1 + m.margin:.2f}x",
        shared=", ".join(_shared_keys(m.variants)) or "-",
        variants=variants_table(m), latency=latency_table(m), advice=advice_table(m),
        buckets=buckets_view(m), coverage=coverage_table(coverage), phases=phases_table(phases),
        notes=list(m.notes),
        images={_IMAGE_TITLES.get(k, k): v for k, v in (images or {}).items()})
