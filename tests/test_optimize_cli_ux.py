"""`tuner optimize` as docs/pipeline.md promises it to a pipeline: `--json` prints the same
object as OUT/manifest.json (the example CI job reads `device.name` and
`variants[].accuracy.passed` from stdout), and every documented --requests format works."""

from __future__ import annotations

import json

from tuner.artifact.store import read_manifest
from tuner.cli import main

TINY = ["--rounds", "2", "--warmup", "1", "--bucket-rounds", "1", "--max-variants", "1",
        "--no-fuse", "--no-probe", "--no-cache", "--max-batch", "1", "--quiet"]


def test_json_is_the_manifest_and_csv_requests_work(reference_model, tmp_path, capsys):
    req = tmp_path / "traffic.csv"
    req.write_text("batch,seq\n1,5\n1,12\n2,30\n")
    out = tmp_path / "out"
    code = main(["optimize", str(reference_model("bert", "small")), "-o", str(out),
                 "--requests", str(req), "--json", *TINY])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    printed = json.loads(cap.out)
    assert printed == json.loads((out / "manifest.json").read_text())
    assert printed["format"] == "shapetuner-artifact" and printed["device"]["name"]
    chosen = next(v for v in printed["variants"] if v["name"] == printed["selected"])
    assert chosen["exact"] and chosen["accuracy"]["passed"]
    assert printed["buckets"]["source"].endswith("traffic.csv")
    assert printed["buckets"]["requests"] == 3 and printed["buckets"]["batch"][-1] >= 2


def test_histogram_requests(reference_model, tmp_path, capsys):
    req = tmp_path / "hist.json"
    req.write_text(json.dumps({"seq": {"8": 90, "40": 10}, "batch": {"1": 3, "2": 1}}))
    out = tmp_path / "out"
    code = main(["optimize", str(reference_model("bert", "small")), "-o", str(out),
                 "--requests", str(req), *TINY])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    m = read_manifest(out)
    assert m.buckets.requests == 100 and m.buckets.seq[-1] >= 40 and m.buckets.batch[-1] >= 2
    assert "selected original" in cap.out and f"wrote {out}/manifest.json" in cap.out
    assert "each at its own length, unbatched" in cap.out
