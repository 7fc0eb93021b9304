"""The manifest: round trip, atomic write, and the validation that protects `tuner serve`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tuner.artifact.codec import manifest_to_json
from tuner.artifact.records import (Accuracy, Advice, Buckets, ExpectedLatency, Latency, Manifest,
                                    Speedup, Variant, parse_shape_key, shape_key)
from tuner.artifact.store import read_manifest, variant_path, write_manifest
from tuner.errors import BadInput
from tuner.graph.paddable import Transform

SHA = "ab" * 32


def _variant(name: str, path: str, exact: bool = True, passed: bool = True, **kw) -> Variant:
    return Variant(name=name, path=path, exact=exact,
                   transforms=kw.pop("transforms", ()), shape={"hidden_size": 64},
                   accuracy=Accuracy(passed, 1e-6, 2e-6, "atol 1e-4"),
                   latency={"1x64": Latency(2.0, 1.5, 3.0, 1.8, 2.2, 20)}, **kw)


def _manifest(**kw) -> Manifest:
    variants = kw.pop("variants", (
        _variant("original", "variants/original/model.onnx"),
        _variant("vocab-1024", "variants/vocab-1024/model.onnx",
                 transforms=(Transform("vocab", 1003, 1024),),
                 speedup=Speedup(1.1, 1.05, 1.2), speedup_by_shape={"1x64": Speedup(1.1, 1.0, 1.2)}),
    ))
    base = dict(source_path="/models/m.onnx", source_sha256=SHA, device={"kind": "cpu", "name": "Test CPU", "cpu_cores": 2},
                backend="ort-cpu", settings={"intra_op_threads": 2}, selected="vocab-1024",
                buckets=Buckets((1, 2), (64, 128), ExpectedLatency(2.0, 3.0, 1.9), "req.jsonl", 10),
                variants=variants, selection="fastest beyond noise", notes=("probe skipped",),
                advice=(Advice("heads-2x128", (Transform("heads", 4, 2), Transform("head_dim", 80, 128)),
                               Speedup(1.2, 1.1, 1.3), "needs retraining"),))
    base.update(kw)
    return Manifest(**base)


def _touch_graphs(out: Path, m: Manifest) -> None:
    for v in m.variants:
        p = out / v.path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x")


def test_round_trip(tmp_path):
    m = _manifest()
    _touch_graphs(tmp_path, m)
    write_manifest(tmp_path, m)
    back = read_manifest(tmp_path)
    assert back == m
    assert back.selected_variant().name == "vocab-1024"
    assert back.device_label == "Test CPU (2 cores)"
    assert back.session_settings().intra_op_threads == 2
    with pytest.raises(BadInput, match="not usable session settings"):
        _manifest(settings={"threads": 2}).session_settings()
    assert back.variant("original").latency["1x64"].spread_ms == pytest.approx(0.4)
    obj = json.loads((tmp_path / "manifest.json").read_text())
    # docs/design.md's contract fields, by their JSON names
    assert obj["source"] == {"path": "/models/m.onnx", "sha256": SHA}
    assert obj["buckets"]["batch"] == [1, 2] and obj["buckets"]["seq"] == [64, 128]
    v = obj["variants"][1]
    assert {"name", "path", "exact", "transforms", "shape", "accuracy", "latency"} <= set(v)
    assert v["transforms"] == [{"kind": "vocab", "from": 1003, "to": 1024}]
    assert v["accuracy"]["passed"] is True and v["latency"]["1x64"]["median_ms"] == 2.0
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".manifest")] == []
    assert obj["advice"][0]["exact"] is False and back.advice[0].speedup.ratio == 1.2


def test_shape_keys():
    assert shape_key(2, 128) == "2x128" and parse_shape_key("2x128") == (2, 128)
    with pytest.raises(ValueError, match="batch x seq"):
        parse_shape_key("2-128")


@pytest.mark.parametrize("kw, msg", [
    (dict(selected="nope"), "selected 'nope' is not one of"),
    (dict(source_sha256="xyz"), "sha256 must be 64"),
    (dict(device={"kind": "cpu"}), "non-empty 'name'"),
    (dict(variants=(_variant("other", "a.onnx"),), selected="other"), "'original' must be present"),
    (dict(variants=(_variant("original", "a.onnx"), _variant("x", "b.onnx", exact=False)),
          selected="x"), "must be exact"),
    (dict(variants=(_variant("original", "a.onnx"), _variant("x", "b.onnx", passed=False)),
          selected="x"), "passed the accuracy gate"),
    (dict(variants=(_variant("original", "a.onnx"), _variant("original", "b.onnx"))),
     "must be unique"),
])
def test_manifest_validation(kw, msg):
    kw.setdefault("selected", "original")
    with pytest.raises(ValueError, match=msg):
        _manifest(**kw)


@pytest.mark.parametrize("path, msg", [
    ("/etc/passwd", "must be relative"), ("../x.onnx", "stay inside"),
    ("a/../../x.onnx", "stay inside"), ("C:/x.onnx", "must be relative"), ("", "non-empty"),
])
def test_variant_paths_stay_inside(path, msg):
    with pytest.raises(ValueError, match=msg):
        _variant("original", path)


def test_value_checks():
    with pytest.raises(ValueError, match="p10 <= q1 <= median"):
        Latency(1.0, 2.0, 3.0, 1.5, 2.5, 5)
    with pytest.raises(ValueError, match="interval must contain"):
        Speedup(1.3, 1.0, 1.2)
    with pytest.raises(ValueError, match="transform kind"):
        Transform("magic", 1, 2)
    with pytest.raises(ValueError, match="strictly increasing"):
        Buckets((2, 1), (64,))
    with pytest.raises(ValueError, match="variant name"):
        _variant("bad name!", "a.onnx")
    with pytest.raises(ValueError, match="advice is never exact"):
        Advice("x", (), Speedup(1, 1, 1), exact=True)


def _write_obj(out: Path, obj) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").write_text(json.dumps(obj))


def test_read_rejects_bad_files(tmp_path):
    with pytest.raises(BadInput, match="no such directory"):
        read_manifest(tmp_path / "missing")
    with pytest.raises(BadInput, match="no manifest.json"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(BadInput, match="not valid JSON"):
        read_manifest(tmp_path)


def test_read_names_the_bad_field(tmp_path):
    m = _manifest()
    _touch_graphs(tmp_path, m)
    good = manifest_to_json(m)

    def broken(edit, message: str):
        obj = json.loads(json.dumps(good))
        edit(obj)
        _write_obj(tmp_path, obj)
        return pytest.raises(BadInput, match=re.escape(message))

    with broken(lambda o: o.pop("selected"), "missing field 'selected'"):
        read_manifest(tmp_path)
    with broken(lambda o: o["variants"][0].__setitem__("exact", "yes"), "variants[0].exact"):
        read_manifest(tmp_path)
    with broken(lambda o: o["variants"][1].__setitem__("path", "../../etc/passwd"), "stay inside"):
        read_manifest(tmp_path)
    with broken(lambda o: o.__setitem__("format", "other"), "format must be"):
        read_manifest(tmp_path)
    with broken(lambda o: o["buckets"].__setitem__("seq", []), "buckets.seq"):
        read_manifest(tmp_path)
    with broken(lambda o: o["variants"][0]["latency"]["1x64"].__setitem__("n", 1.5),
                "variants[0].latency.1x64.n"):
        read_manifest(tmp_path)


def test_missing_or_escaping_graph(tmp_path):
    m = _manifest()
    write_manifest(tmp_path, m)
    with pytest.raises(BadInput, match="graph 'variants/original/model.onnx' is missing"):
        read_manifest(tmp_path)
    assert read_manifest(tmp_path, check_files=False) == m
    # a symlink that leads out of OUT is refused even though the relative path looks fine
    outside = tmp_path.parent / f"{tmp_path.name}-outside.onnx"
    outside.write_bytes(b"x")
    link = tmp_path / "variants" / "original" / "model.onnx"
    link.parent.mkdir(parents=True)
    link.symlink_to(outside)
    with pytest.raises(BadInput, match="leaves the artifact folder"):
        variant_path(tmp_path, m.variant("original"))
