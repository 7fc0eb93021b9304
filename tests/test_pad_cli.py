"""`tuner pad` and `tuner verify` end to end: exit codes, tables, atomic writes."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tuner.cli import main
from tuner.graph.inspect import inspect_path
from tuner.jobs.pad import NotExact, pad_file
from tuner.rewrite.compose import PadRequest


def test_pad_then_verify(reference_model, tmp_path, capsys):
    src = reference_model("llama", "awkward", "torchscript")
    out = tmp_path / "padded.onnx"
    rc = main(["pad", str(src), "-o", str(out), "--ffn-multiple", "64", "--vocab-multiple", "64",
               "--head-dim", "96"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "PASS" in text and "vocab 1003->1024" in text and "ffn 426->448" in text
    assert "head_dim 80->96" in text
    shape = inspect_path(out)
    assert (shape.ffn_size, shape.vocab_size, shape.head_dim) == (448, 1024, 96)
    assert main(["verify", str(src), str(out)]) == 0
    assert "max abs" in capsys.readouterr().out
    # Another model is not the same model: exit 1 with the table.
    other = reference_model("qwen2", "awkward", "torchscript")
    assert main(["verify", str(src), str(other)]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_verify_with_user_inputs(reference_model, tmp_path, capsys):
    src = reference_model("bert", "awkward", "dynamo")
    npz = tmp_path / "in.npz"
    np.savez(npz, input_ids=np.array([[1, 2, 3, 4]], np.int64),
             attention_mask=np.array([[1, 1, 1, 0]], np.int64))
    assert main(["verify", str(src), str(src), "--inputs", str(npz)]) == 0
    assert "1 feed(s)" in capsys.readouterr().out
    bad = tmp_path / "bad.npz"
    np.savez(bad, input_ids=np.array([[1, 2]], np.int32))
    assert main(["verify", str(src), str(src), "--inputs", str(bad)]) == 2
    assert "missing ['attention_mask']" in capsys.readouterr().err


def test_bad_input_exits_2_with_one_line(reference_model, tmp_path, capsys):
    src = reference_model("llama", "awkward", "dynamo")
    assert main(["pad", str(src), "-o", str(tmp_path / "x.onnx"), "--hidden-multiple", "64"]) == 2
    err = capsys.readouterr().err
    assert "never padded" in err and len(err.strip().splitlines()) == 1
    assert main(["pad", str(src), "-o", str(tmp_path / "x.onnx")]) == 2
    assert "nothing to pad" in capsys.readouterr().err
    assert main(["pad", str(src), "-o", str(src), "--ffn-multiple", "64"]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert main(["verify", str(src), str(tmp_path / "missing.onnx")]) == 2
    assert main(["verify", str(src), str(src), "--atol", "-1"]) == 2
    assert not (tmp_path / "x.onnx").exists()


def test_a_failed_gate_writes_nothing(reference_model, tmp_path):
    src = reference_model("gpt2", "awkward", "dynamo")
    dst = tmp_path / "never.onnx"
    with pytest.raises(NotExact, match="nothing was written") as info:
        pad_file(src, dst, PadRequest(ffn_size=640), shapes=[(1, 4)],
                 tolerance=lambda name, ref, cand: False)  # a policy nothing passes
    assert not info.value.result
    assert list(tmp_path.iterdir()) == []  # no output, no temporary folder


def test_console_script_json(reference_model, tmp_path):
    src = reference_model("gpt2", "awkward", "torchscript")
    out = tmp_path / "p.onnx"
    proc = subprocess.run([sys.executable, "-m", "tuner", "pad", str(src), "-o", str(out),
                           "--ffn-multiple", "64", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["written"] and doc["transforms"] == ["ffn 600->640"]
    assert doc["accuracy"]["passed"] is True


def test_external_data_in_and_out(reference_model, tmp_path, capsys):
    """A model stored with external data pads into OUT.onnx + OUT.onnx.data of its own (not
    references to the source's weight file)."""
    import onnx

    src_dir = tmp_path / "src"
    src_dir.mkdir()
    onnx.save(onnx.load(reference_model("llama", "awkward", "dynamo")), str(src_dir / "m.onnx"),
              save_as_external_data=True, location="m.weights", size_threshold=1024)
    out = tmp_path / "out" / "p.onnx"
    assert main(["pad", str(src_dir / "m.onnx"), "-o", str(out), "--ffn-multiple", "64"]) == 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["p.onnx", "p.onnx.data"]
    (src_dir / "m.weights").rename(src_dir / "moved")  # the padded model must not need it
    assert main(["verify", str(reference_model("llama", "awkward", "dynamo")), str(out)]) == 0
    assert "PASS" in capsys.readouterr().out
