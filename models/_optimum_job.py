"""Run INSIDE the Optimum environment (models/optimum.py starts it): export each job of a
JSON list [[checkpoint folder, task, output folder, optimization level or null], ...] with
optimum's main_export (`optimize`: its ONNX Runtime optimization, e.g. "O2"), in one
process so that torch and transformers are imported once. Imports nothing of ours."""

import json
import sys
from importlib import metadata

from optimum.exporters.onnx import main_export


def main(jobs_file: str) -> int:
    versions = {p: metadata.version(p) for p in ("optimum-onnx", "optimum", "transformers", "torch")}
    for checkpoint, task, output, optimize in json.loads(open(jobs_file).read()):
        # do_validation=False: optimum's own check runs ORT against torch; the graph is the same
        main_export(checkpoint, output, task=task, local_files_only=True, do_validation=False,
                    optimize=optimize)
        with open(f"{output}/exporter.json", "w") as f:
            json.dump(versions, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
