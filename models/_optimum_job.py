"""Run INSIDE the Optimum environment (models/optimum.py starts it): export each job of a
JSON list [[checkpoint folder, task, output folder, optimization level or null, dtype], ...]
with optimum's main_export (`optimize`: its ONNX Runtime optimization, e.g. "O2"; dtype
"fp32" or "fp16"), in one process so that torch and transformers are imported once.
Imports nothing of ours.

A checkpoint folder holding `random_model.json` ({"model_type", "config", "seed",
"auto_class"}) instead of weights gets them here, from this environment's transformers: a
family whose weights our newer transformers saves in a layout this one cannot load
(Qwen3-MoE's experts), and the encoder-decoders (T5, BART, Whisper)."""

import json
import os
import sys
from importlib import metadata

from optimum.exporters.onnx import main_export


def _random_weights(checkpoint: str) -> None:
    spec_file = os.path.join(checkpoint, "random_model.json")
    if not os.path.exists(spec_file):
        return
    import torch
    import transformers

    spec = json.loads(open(spec_file).read())
    torch.manual_seed(spec["seed"])
    config = transformers.AutoConfig.for_model(spec["model_type"], **spec["config"])
    auto = getattr(transformers, spec.get("auto_class", "AutoModelForCausalLM"))
    model = auto.from_config(config).eval().float()
    model.save_pretrained(checkpoint, safe_serialization=True)


def main(jobs_file: str) -> int:
    versions = {p: metadata.version(p) for p in ("optimum-onnx", "optimum", "transformers", "torch")}
    for checkpoint, task, output, optimize, dtype in json.loads(open(jobs_file).read()):
        _random_weights(checkpoint)
        # do_validation=False: optimum's own check runs ORT against torch; the graph is the same
        main_export(checkpoint, output, task=task, local_files_only=True, do_validation=False,
                    optimize=optimize, dtype=dtype, device="cpu")
        with open(f"{output}/exporter.json", "w") as f:
            json.dump(versions, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
