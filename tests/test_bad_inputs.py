"""Bad input that used to give a traceback, a stray warning or the wrong exit code: each is
one line on stderr and exit 2 (or 141 for a reader that went away, as SIGPIPE would)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from tuner.cli import main


def _save(graph, path):
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    path.write_bytes(model.SerializeToString())
    return path


def _io(name, shape=(2,)):
    return helper.make_tensor_value_info(name, T.FLOAT, list(shape))


def _one_line_exit_2(argv, capsys):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tuner: error: "), err
    return lines[0]


def test_two_nodes_writing_one_output(tmp_path, capsys):
    path = _save(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="a"),
         helper.make_node("Neg", ["x"], ["y"], name="b")], "g", [_io("x")], [_io("y")]),
        tmp_path / "dup.onnx")
    for cmd in (["inspect", str(path)], ["verify", str(path), str(path)]):
        assert "'y' is written twice" in _one_line_exit_2(cmd, capsys)


def test_an_input_nothing_produces_gives_our_line_not_onnx_irs(tmp_path, capsys):
    path = _save(helper.make_graph([helper.make_node("Add", ["x", "ghost"], ["y"])], "g",
                                   [_io("x")], [_io("y")]), tmp_path / "dangling.onnx")
    assert "'ghost'" in _one_line_exit_2(["inspect", str(path)], capsys)


def test_nul_byte_in_an_external_data_location(tmp_path, capsys):
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    w.data_location = T.EXTERNAL
    w.ClearField("raw_data")
    for k, v in (("location", "we\x00ird.bin"), ("offset", "0"), ("length", "64")):
        entry = w.external_data.add()
        entry.key, entry.value = k, v
    path = _save(helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                                   [_io("x", (1, 4))], [_io("y", (1, 4))], [w]),
                 tmp_path / "nul.onnx")
    for cmd in (["inspect", str(path)], ["pad", str(path), "-o", str(tmp_path / "o.onnx"),
                                         "--ffn-multiple", "64"]):
        assert "NUL byte" in _one_line_exit_2(cmd, capsys)


def test_deeply_nested_manifest_is_refused_by_serve(tmp_path, capsys):
    (tmp_path / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    assert "nested too deeply" in _one_line_exit_2(["serve", str(tmp_path)], capsys)


@pytest.mark.parametrize("as_json", [False, True])
def test_inspect_into_a_closed_pipe_exits_141_quietly(reference_model, as_json):
    src = reference_model("gpt2", "small", "torchscript")
    p = subprocess.Popen([sys.executable, "-c", "import sys; from tuner.cli import main; "
                          "sys.exit(main())", "inspect", str(src), *(["--json"] if as_json else [])],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader is gone before the first byte: `| head -0`
    err = p.stderr.read().decode()
    assert p.wait(120) == 141, err
    assert err == ""


def test_user_inputs_with_an_all_zero_mask_are_refused(reference_model, tmp_path, capsys):
    src = reference_model("gpt2", "small", "torchscript")
    npz = tmp_path / "zero.npz"
    np.savez(npz, input_ids=np.array([[1, 2, 3]], np.int64),
             attention_mask=np.zeros((1, 3), np.int64))
    line = _one_line_exit_2(["verify", str(src), str(src), "--inputs", str(npz)], capsys)
    assert "all zeros" in line


def test_a_serving_dependency_that_fails_to_import_is_one_line(tmp_path):
    """What `pip install tritonclient[grpc]` after shapetuner used to leave: protobuf's
    runtime refusing the generated stubs of grpcio-health-checking. The rest of the CLI works."""
    import os

    fake = tmp_path / "grpc_health"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "from google.protobuf.runtime_version import VersionError\n"
        "raise VersionError('Detected mismatched Protobuf Gencode/Runtime major versions')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    run = [sys.executable, "-c", "import sys; from tuner.cli import main; sys.exit(main())"]
    serve = subprocess.run([*run, "serve", str(tmp_path)], env=env, capture_output=True,
                           text=True, timeout=120)
    lines = serve.stderr.strip().splitlines()
    assert serve.returncode == 2 and len(lines) == 1, serve.stderr
    assert "grpcio-health-checking" in lines[0] and "pip install" in lines[0]
    assert "'protobuf>=6.30.0,<7'" in lines[0]
    other = subprocess.run([*run, "inspect", "--help"], env=env, capture_output=True, timeout=120)
    assert other.returncode == 0


def test_base_dependencies_bound_protobuf_and_grpc_extras_as_the_test_extra_does():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())[
        "project"]
    base = set(project["dependencies"])
    test = set(project["optional-dependencies"]["test"])
    for dep in ("protobuf>=6.30.0,<7", "grpcio-health-checking>=1.72.2,<1.82",
                "grpcio-reflection>=1.72.2,<1.82"):
        assert dep in base and dep in test, dep


def test_serve_settings_come_from_the_artifact_and_its_flags(reference_model, tmp_path, capsys):
    """--threads and --spin change only what they name of the artifact's recorded session
    settings; a negative --max-stall is refused in one line."""
    from serving_support import make_artifact

    from tuner.cli.serve_cmd import _settings

    out = make_artifact(tmp_path / "out", reference_model("gpt2", "small", "torchscript"),
                        settings={"intra_op_threads": 2, "inter_op_threads": 1,
                                  "graph_optimization": "basic", "allow_spinning": False})
    assert _settings(out, None, None) is None  # the artifact's, as they are
    spun = _settings(out, None, True)
    assert (spun.allow_spinning, spun.intra_op_threads, spun.graph_optimization) == (
        True, 2, "basic")
    assert _settings(out, 1, None).intra_op_threads == 1 and not _settings(out, 1, None).allow_spinning
    assert "max_stall must be > 0" in _one_line_exit_2(["serve", str(out), "--max-stall", "-1"],
                                                       capsys)
