"""Optimum's exports as transformers.js' conversions leave them: run through onnxslim, which
folds every static shape read (`x.shape[-1]`, a head's 24) into a constant and keeps the
arithmetic after it. Before 2026-12-07 every padding of such a graph but the vocabulary's was
refused: rotate-half's `// 2` bound and the attention's reshape targets, computed from
constants alone, were read as computed from a shape that does not change ("computed slice
bound becomes 12, needs 16"), and Phi-3's fused gate/up split ends at a folded
`2 * (ffn + 1) // 2` (tuner/rewrite/axis: ShapeMath.folded); Gemma's rotary MatMul met a
constant operand, its folded inverse frequencies, and took it for a weight. Exact now, and
optimized.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import onnx
import pytest

from models import optimum
from models.build import IR_VERSION
from tuner.cli import main
from tuner.jobs.pad import pad_file
from tuner.rewrite.compose import PadRequest

pytestmark = pytest.mark.venv(*optimum.VENV)  # built beside the first tests (conftest)

# rotate-half and GQA reshapes; a fused gate/up split; Gemma's inverse frequencies folded
# with their Expand into one constant operand of the rotary's MatMul (with onnxruntime)
NAMES = ("llama", "phi3", "gemma")
# onnxslim folds more where onnxruntime is installed (transformers.js' environment has it)
# than as `pip install onnxslim` alone leaves it: both are what users run
MODES = ("bare", "with-ort")
CELLS = [(m, n) for m in MODES for n in NAMES]
SLIM = """import sys
if sys.argv[3] == "bare":
    sys.modules["onnxruntime"] = None  # as if not installed: onnxslim folds without it
import onnx, onnxslim
proto = onnxslim.slim(sys.argv[1])
proto.ir_version = min(proto.ir_version, int(sys.argv[4]))
onnx.save(proto, sys.argv[2])
"""


@pytest.fixture(scope="module")
def slimmed(tmp_path_factory) -> dict:
    folder, out = tmp_path_factory.mktemp("slimmed"), {}
    for mode, name in CELLS:
        dst = folder / f"{mode}-{name}.onnx"
        r = subprocess.run([sys.executable, "-c", SLIM, str(optimum.cached(name, optimum.TASKS[0])),
                            str(dst), mode, str(IR_VERSION)], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        out[mode, name] = dst
    return out


def _shapes_read(path) -> int:
    return Counter(n.op_type for n in onnx.load(str(path)).graph.node)["Shape"]


@pytest.mark.parametrize("mode, name", CELLS, ids=[f"{m}-{n}" for m, n in CELLS])
def test_every_padding_of_a_slimmed_export_is_exact(slimmed, mode, name, tmp_path):
    # the slimmer folded shape reads away: what this test is about
    assert _shapes_read(slimmed[mode, name]) < _shapes_read(optimum.cached(name, optimum.TASKS[0]))
    result = pad_file(slimmed[mode, name], tmp_path / "padded.onnx",
                      PadRequest(ffn_size=256, vocab_size=1024, head_dim=32))  # gated
    assert result.accuracy.passed and max(o.max_abs for o in result.accuracy.outputs) == 0
    assert set(result.transforms) == {"ffn 200->256", "vocab 1003->1024", "head_dim 24->32"}


def test_optimize_builds_the_padded_variants_of_a_slimmed_export(slimmed, tmp_path):
    out = tmp_path / "out"
    assert main(["optimize", str(slimmed["bare", "llama"]), "-o", str(out), "--rounds", "2",
                 "--warmup", "0", "--bucket-rounds", "1", "--no-probe", "--no-fuse",
                 "--max-variants", "4", "--no-cache", "--max-buckets", "2", "-q",
                 "--no-plots"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    built = {v["name"].split("-")[0] for v in manifest["variants"] if v["accuracy"]["passed"]}
    assert {"ffn", "vocab", "head_dim"} <= built, manifest["notes"]
    assert not [n for n in manifest["notes"] if n.startswith("skipped")], manifest["notes"]
