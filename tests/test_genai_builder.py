"""models/genai_builder.py, how the suite gets onnxruntime-genai's graphs: its model builder
runs in an environment of its own (it pulls the `onnxruntime` CPU wheel), and the builds a
test file asks for together are made in one builder process (models/_genai_job.py), each
the graph the builder's own command line writes when run alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import numpy_helper

from models import genai_builder
from models.build import _cache_dir

pytestmark = pytest.mark.venv(*genai_builder.VENV)  # built beside the first tests (conftest)


def test_builder_runs_in_its_own_venv():
    python = genai_builder.venv_python()
    assert python.parent.parent.absolute() != Path(sys.prefix).absolute()
    run = subprocess.run([str(python), "-c", "import onnxruntime_genai, onnxruntime; "
                          "print(onnxruntime.get_device())"], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "CPU", run.stderr
    model = onnx.load(str(genai_builder.cached("llama", "int4")), load_external_data=False)
    assert "com.microsoft" in {o.domain for o in model.opset_import}


def _graph_and_weights(path: Path) -> tuple[onnx.GraphProto, dict]:
    model = onnx.load(str(path))
    weights = {t.name: numpy_helper.to_array(t).tobytes() for t in model.graph.initializer}
    del model.graph.initializer[:]
    return model.graph, weights


def test_builds_made_together_are_what_the_builder_writes_alone(tmp_path, monkeypatch):
    """Two builds in one process (the second after the first's imports and state), then
    the second by the builder's command line in a process of its own: the same graph and
    the same weights, byte for byte."""
    venvs = _cache_dir() / "venvs"
    genai_builder.venv_python()  # made in the real cache, then lent to the empty one
    monkeypatch.setenv("SHAPETUNER_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "venvs").symlink_to(venvs)
    together = genai_builder.build_all([("llama", "fp32"), ("llama", "int4")])
    assert [p.is_file() for p in together] == [True, True]
    assert genai_builder.cached("llama", "int4") == together[1]  # found, not built again

    alone = tmp_path / "alone"
    run = subprocess.run(
        [str(genai_builder.venv_python()), "-m", "onnxruntime_genai.models.builder", "-i",
         str(genai_builder.hf_folder("llama")), "-o", str(alone), "-p", "int4", "-e", "cpu",
         "-c", str(tmp_path / "hf-cache")],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}, capture_output=True,
        text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    graph, weights = _graph_and_weights(together[1])
    graph_alone, weights_alone = _graph_and_weights(alone / "model.onnx")
    assert graph == graph_alone
    assert weights.keys() == weights_alone.keys() and len(weights) > 10
    assert all(weights[name] == weights_alone[name] for name in weights)


def test_an_unknown_build_is_refused_before_anything_runs():
    with pytest.raises(KeyError, match="no genai build llama/int3"):
        genai_builder.build_all([("llama", "fp32"), ("llama", "int3")])
