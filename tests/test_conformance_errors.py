"""No internal error on a model ONNX Runtime can load: a failure inside one variant is that
variant's refusal, with the reason in the report; a failure on the original is exit 2 with
the reason (tuner/jobs/pipeline.py)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from models import optimum
from tuner.cli import main

pytestmark = pytest.mark.venv(*optimum.VENV)  # built beside the first tests (conftest)

FAST = ["--no-plots", "--rounds", "2", "--warmup", "0", "--bucket-rounds", "1", "--no-probe",
        "--no-fuse", "--max-variants", "2", "--no-cache", "--max-buckets", "1"]


def _optimize(tmp_path) -> tuple[int, str]:
    traffic = tmp_path / "t.jsonl"
    traffic.write_text('{"seq": 8}\n')
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["optimize", str(optimum.cached("gpt2", optimum.TASKS[1])), "-o",
                     str(tmp_path / "art"), "--requests", str(traffic), *FAST])
    return code, err.getvalue()


def test_a_variant_that_breaks_is_refused_in_the_report(tmp_path, monkeypatch):
    import tuner.jobs.pipeline as pipeline

    def broken(*args, **kwargs):
        raise ValueError("a rewrite met something it did not expect")

    monkeypatch.setattr(pipeline, "build_padded", broken)
    code, err = _optimize(tmp_path)
    assert code == 0, err
    notes = json.loads((tmp_path / "art" / "manifest.json").read_text())["notes"]
    assert any(n.startswith("skipped ") and "ValueError: a rewrite met something" in n
               for n in notes), notes


def test_an_original_that_fails_on_the_gate_feeds_is_bad_input(tmp_path, monkeypatch):
    import tuner.gate.entry as entry

    def fails(*args, **kwargs):
        raise RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Got invalid dimensions")

    monkeypatch.setattr(entry, "record_then_release", fails)
    code, err = _optimize(tmp_path)
    assert code == 2, err
    assert "ONNX Runtime cannot run the original on the gate's feeds" in err
    assert "internal error" not in err
