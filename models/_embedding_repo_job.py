"""Run INSIDE the Optimum environment (models/embedding_repos.py starts it): for each job of
a JSON list [[checkpoint folder, output onnx/ folder, extras], ...] export the checkpoint
with Optimum's main_export (task feature-extraction, what sentence-transformers' ONNX backend
runs), then write the copies sentence-transformers' export functions add beside it, with the
same Optimum calls: `model_O2.onnx` (export_optimized_onnx_model: ORTOptimizer, level O2)
and `model_qint8_avx512_vnni.onnx` (export_dynamic_quantized_onnx_model: ORTQuantizer,
avx512_vnni, dynamic, per channel). `extras` names which copies to write. Only the graphs
stay in the folder, as on the hub. A checkpoint folder holding `random_model.json`
({"model_type", "config", "seed"}) gets random weights here first, from this environment's
transformers (the version Optimum pins reads what it writes). Imports nothing of ours."""

import json
import shutil
import sys
import tempfile
from pathlib import Path

from optimum.exporters.onnx import main_export
from optimum.onnxruntime import ORTModelForFeatureExtraction, ORTOptimizer, ORTQuantizer
from optimum.onnxruntime.configuration import AutoOptimizationConfig, AutoQuantizationConfig


def _copy(onnx_dir: Path, suffix: str, write) -> None:
    """`write(model, tmp)` saves `model_{suffix}.onnx` into tmp; moved beside model.onnx."""
    model = ORTModelForFeatureExtraction.from_pretrained(onnx_dir, file_name="model.onnx")
    with tempfile.TemporaryDirectory(dir=onnx_dir.parent) as tmp:
        write(model, tmp)
        shutil.move(Path(tmp) / f"model_{suffix}.onnx", onnx_dir / f"model_{suffix}.onnx")


def _random_weights(checkpoint: Path) -> None:
    spec_file = checkpoint / "random_model.json"
    if not spec_file.exists():
        return
    import torch
    import transformers

    spec = json.loads(spec_file.read_text())
    torch.manual_seed(spec["seed"])
    config = transformers.AutoConfig.for_model(spec["model_type"], **spec["config"])
    model = transformers.AutoModel.from_config(config).eval()
    with torch.no_grad():  # beyond the init's: biases and norms too, so padding shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(checkpoint, safe_serialization=True)
    spec_file.unlink()


def main(jobs_file: str) -> int:
    for checkpoint, out, extras in json.loads(open(jobs_file).read()):
        _random_weights(Path(checkpoint))
        onnx_dir = Path(out)
        main_export(checkpoint, onnx_dir, task="feature-extraction", local_files_only=True,
                    do_validation=False, device="cpu")
        if "O2" in extras:
            _copy(onnx_dir, "O2", lambda m, tmp: ORTOptimizer.from_pretrained(m).optimize(
                AutoOptimizationConfig.with_optimization_level("O2"), save_dir=tmp,
                file_suffix="O2"))
        if "qint8" in extras:
            config = AutoQuantizationConfig.avx512_vnni(is_static=False, per_channel=True)
            _copy(onnx_dir, "qint8_avx512_vnni", lambda m, tmp: ORTQuantizer.from_pretrained(
                m).quantize(config, save_dir=tmp, file_suffix="qint8_avx512_vnni"))
        for f in onnx_dir.iterdir():  # the hub's onnx/ holds the graphs alone
            if f.suffix != ".onnx":
                f.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
