"""`tuner pad` outputs and targets a user gets wrong: a folder or an unwritable place for -o
was an internal error at the final rename (after the rewrite and the gate); --heads 0 and
--head-dim 0 were taken as "nothing to do" and wrote an unpadded copy."""

from __future__ import annotations

import pytest

from tuner.cli import main


@pytest.mark.parametrize("where, message", [
    ("folder", "is a folder"),
    ("under-a-file", "cannot write the padded model x.onnx there"),
])
def test_bad_output_path_exits_2_before_any_work(reference_model, tmp_path, capsys, where,
                                                 message):
    src = reference_model("bert", "small", "torchscript")
    (tmp_path / "folder").mkdir()
    (tmp_path / "plain.txt").write_text("x")
    out = tmp_path / "folder" if where == "folder" else tmp_path / "plain.txt" / "x.onnx"
    assert main(["pad", str(src), "-o", str(out), "--head-dim", "32"]) == 2
    cap = capsys.readouterr()
    assert message in cap.err and len(cap.err.strip().splitlines()) == 1
    assert "Traceback" not in cap.err and "PASS" not in cap.out  # refused before the gate
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "plain.txt"]
    assert not list((tmp_path / "folder").iterdir())


@pytest.mark.parametrize("flag", ["--heads", "--head-dim"])
def test_zero_targets_are_refused(reference_model, tmp_path, capsys, flag):
    src = reference_model("bert", "small", "torchscript")
    assert main(["pad", str(src), "-o", str(tmp_path / "x.onnx"), flag, "0"]) == 2
    assert "must be a positive integer, not 0" in capsys.readouterr().err
    assert not (tmp_path / "x.onnx").exists()


def test_an_existing_output_is_kept_unless_force(reference_model, tmp_path, capsys):
    src = reference_model("bert", "small", "torchscript")
    out = tmp_path / "padded.onnx"
    out.write_bytes(b"the model being served")
    assert main(["pad", str(src), "-o", str(out), "--head-dim", "32"]) == 2
    err = capsys.readouterr().err
    assert "exists; pass --force to replace it" in err and len(err.strip().splitlines()) == 1
    assert out.read_bytes() == b"the model being served"
    assert main(["pad", str(src), "-o", str(out), "--head-dim", "32", "--force"]) == 0
    assert out.read_bytes().startswith(b"\x08")  # a ModelProto now: field 1 (ir_version)
