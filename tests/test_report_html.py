"""report.html is a rendered page: real tables with the manifest's rows, no markdown left over,
the plots embedded, and text from the model or the traffic escaped, never markup."""

from __future__ import annotations

from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tuner.artifact.records import (Accuracy, Advice, Buckets, ExpectedLatency, Latency, Manifest,
                                    Speedup, Transform, Variant)
from tuner.artifact.report import write_report
from tuner.artifact.report_html import PhaseRow, Table, render

SHA = "cd" * 32
HOSTILE = '<script>alert("x")</script> & <b>bold</b>'


class Page(HTMLParser):
    """Tables as lists of rows of cell texts, image sources, tags seen, and all text."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self.images: list[str] = []
        self.tags: list[str] = []
        self.text: list[str] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "img":
            self.images.append(dict(attrs)["src"])

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data):
        self.text.append(data)
        if self._cell is not None:
            self._cell.append(data)


def _lat(ms: float) -> Latency:
    return Latency(ms, ms * 0.8, ms * 1.3, ms * 0.9, ms * 1.1, 20)


def _manifest(note: str = HOSTILE, **kw) -> Manifest:
    original = Variant("original", "variants/original/model.onnx", True, (), {"hidden_size": 64},
                       Accuracy(True, 0.0, 0.0, "reference"),
                       {"1x64": _lat(2.0), "2x64": _lat(3.0)})
    padded = Variant("vocab-1024", "variants/vocab-1024/model.onnx", True,
                     (Transform("vocab", 1003, 1024),), {"hidden_size": 64},
                     Accuracy(True, 1.5e-6, 3e-6, "atol 1e-4"),
                     {"1x64": _lat(1.8), "2x64": _lat(2.7), "4x128": _lat(9.0)},
                     Speedup(1.11, 1.05, 1.2), {"1x64": Speedup(1.1, 1.0, 1.2)}, note=note)
    base = dict(source_path="/models/m<1>.onnx", source_sha256=SHA,
                device={"kind": "cpu", "name": "Test CPU", "cpu_cores": 2}, backend="ort-cpu",
                settings={"intra_op_threads": 2}, selected="vocab-1024",
                buckets=Buckets((1, 2, 4), (64, 128), ExpectedLatency(2.0, 3.0, 1.9), "req.jsonl", 10),
                variants=(original, padded), selection="fastest beyond noise (1.11x > 1.03x)",
                notes=("probe skipped: no GPU", HOSTILE),
                advice=(Advice("heads-2x128", (Transform("heads", 4, 2),), Speedup(1.2, 1.1, 1.3),
                               "needs retraining"),))
    base.update(kw)
    return Manifest(**base)


def _parse(page: str) -> Page:
    p = Page()
    p.feed(page)
    p.close()
    return p


def _table(p: Page, first_header: str) -> list[list[str]]:
    return next(t for t in p.tables if t and t[0] and t[0][0] == first_header)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, Page]:
    """write_report with the real matplotlib plots, as `tuner optimize` calls it."""
    root = tmp_path_factory.mktemp("report")
    grid = {(b, s): 1.0 + b * s / 64 for b in (1, 2, 4) for s in (32, 64, 128)}

    class Req:  # the two fields plots() reads from tuner.measure.buckets' request distribution
        weights = {(1, 40): 3.0, (2, 100): 1.0}

    write_report(root, _manifest(), req=Req(), grid_latency=grid, coverage={64: 0.75, 128: 0.25})
    return root, _parse((root / "report.html").read_text(encoding="utf-8"))


def test_variants_table_has_a_row_per_variant_with_its_numbers(written):
    _, p = written
    rows = _table(p, "variant")
    header, original, padded = rows
    assert header[:6] == ["variant", "exact", "transforms", "accuracy", "max abs err", "max rel err"]
    assert "1x64 (median ± IQR)" in header and "2x64 (median ± IQR)" in header
    assert "4x128 (median ± IQR)" not in header  # only the comparison shapes here
    cell = dict(zip(header, padded))
    assert cell["variant"] == "vocab-1024" and cell["exact"] == "yes"
    assert cell["transforms"] == "vocab 1003->1024" and cell["accuracy"] == "pass"
    assert cell["max abs err"] == "1.5e-06" and cell["max rel err"] == "3e-06"
    assert cell["1x64 (median ± IQR)"] == "1.80 ms ± 0.36"
    assert cell["speedup [95% CI]"] == "1.110x [1.050, 1.200]"
    assert dict(zip(header, original))["speedup [95% CI]"] == "-"
    assert all(len(r) == len(header) for r in rows)


def test_every_measured_shape_and_the_buckets_and_advice_are_tables(written):
    _, p = written
    lat = _table(p, "shape")
    assert lat[0] == ["shape", "original", "vocab-1024"]
    assert ["4x128", "-", "9.00 ms ± 1.80"] in lat  # only the selected one ran the grid
    assert _table(p, "seq bucket")[1:] == [["64", "75.0%"], ["128", "25.0%"]]
    assert _table(p, "reshape")[1][:3] == ["heads-2x128", "heads 4->2", "1.200x [1.100, 1.300]"]
    text = " ".join(p.text)
    for fact in ("Test CPU (2 cores)", "ort-cpu", "fastest beyond noise (1.11x > 1.03x)",
                 "2.00 ms", "3.00 ms", "1.90 ms", "probe skipped: no GPU"):
        assert fact in text


def test_no_markdown_is_left_and_the_plots_are_images(written):
    root, p = written
    page = (root / "report.html").read_text(encoding="utf-8")
    assert "<pre" not in page and "**" not in page
    for line in "".join(p.text).splitlines():
        assert not line.lstrip().startswith(("|", "#")), line
    assert len(p.images) == 4 and all(s.startswith("data:image/png;base64,iVBOR") for s in p.images)
    assert p.tags.count("table") >= 4 and "style" in p.tags
    # report.md stays markdown, for CI logs
    assert (root / "report.md").read_text().startswith("# shapetuner report: m<1>.onnx")


def test_without_plots_the_same_tables_and_no_image(written, tmp_path):
    """`tuner optimize --no-plots`: the page's tables as with the plots, no image, and
    report.md says that none were drawn."""
    root, with_plots = written
    write_report(tmp_path, _manifest(), coverage={64: 0.75, 128: 0.25}, with_plots=False)
    p = _parse((tmp_path / "report.html").read_text(encoding="utf-8"))
    assert p.images == [] and p.tables == with_plots.tables
    md = (tmp_path / "report.md").read_text()
    assert "no plots drawn" in md and "Plots: report.html" in (root / "report.md").read_text()


def test_text_from_the_model_is_escaped(written):
    root, p = written
    page = (root / "report.html").read_text(encoding="utf-8")
    assert "<script" not in page and "<b>bold" not in page
    assert "&lt;script&gt;" in page and "&amp;" in page
    assert p.tags.count("script") == 0 and "b" not in p.tags
    assert HOSTILE in "".join(p.text)  # shown to the reader, as text
    assert "/models/m<1>.onnx" in "".join(p.text)


def test_phases_render_prefill_and_decode_side_by_side():
    m = _manifest(note="")
    assert "Prefill and decode" not in render(m)  # absent until a decoder report passes them
    phases = [PhaseRow("original", "1x64", _lat(5.0), _lat(1.0), past=64),
              PhaseRow("vocab-1024", "1x64", _lat(4.5), None)]
    p = _parse(render(m, phases=phases))
    rows = next(t for t in p.tables if t[0][1:2] == ["prefill shape"])
    assert rows[1] == ["original", "1x64", "5.00 ms ± 1.00", "64", "1.00 ms ± 0.20"]
    assert rows[2] == ["vocab-1024", "1x64", "4.50 ms ± 0.90", "-", "-"]


def test_a_failed_variant_and_no_advice_or_expected_latency():
    m = _manifest(note="", advice=(), buckets=Buckets((1,), (64,)))
    failed = replace(m.variants[1], name="ffn-256", accuracy=Accuracy(False, 0.5, None, "max err"),
                     latency={"1x64": _lat(1.0), "2x64": _lat(1.0)})
    m = replace(m, variants=(m.variants[0], failed), selected="original")
    p = _parse(render(m))
    rows = _table(p, "variant")
    assert rows[2][3:6] == ["FAIL", "0.5", "-"]
    assert not any(t[0][0] in ("reshape", "shape") for t in p.tables)  # nothing to show
    assert "expected latency" not in " ".join(p.text) and p.images == []


def test_table_rows_must_match_the_headers():
    with pytest.raises(ValueError, match="has 1 cells, expected 2"):
        Table(("a", "b"), (("x",),))
