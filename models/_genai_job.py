"""Run INSIDE the genai environment (models/genai_builder.py starts it): build each job of a
JSON list [[hf folder, output folder, precision, execution provider, cache folder], ...]
with onnxruntime-genai's model builder, exactly as its command line would
(`python -m onnxruntime_genai.models.builder -i HF -o OUT -p P -e EP -c CACHE`), but in one
process: importing torch, transformers and the builder is most of a tiny model's build
(~9 s of ~12), so each build after the first saves it. Imports nothing of ours.

The builder's module runs afresh for each job (`runpy`, as `-m` runs it), so nothing its
module keeps carries from one build to the next; the packages it imports are shared."""

import json
import runpy
import sys


def main(jobs_file: str) -> int:
    with open(jobs_file) as f:
        jobs = json.load(f)
    for hf, output, precision, provider, cache in jobs:
        sys.argv = ["builder", "-i", hf, "-o", output, "-p", precision, "-e", provider,
                    "-c", cache]
        runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)
        print(f"built {output}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
