"""Run INSIDE the Optimum environment (bench/seq2seq_generate.py starts it): the generation
loop users write around an encoder-decoder export, Optimum's ORTModelForSeq2SeqLM (or
ORTModelForSpeechSeq2Seq, given features) and its greedy `generate`, timed on the workloads of a JSON file; one JSON line of results on
stdout. Imports nothing of ours.

    python -P _optimum_seq2seq_worker.py FOLDER THREADS WORKLOADS.json

WORKLOADS.json: {"new": N, "workloads": {name: [[source ids], ...], ...}} (or, with
"features": a .npy of (rows, bins, frames), each workload's rows). Every workload is
one `generate` call on all its sources at once (a static batch, right-padded with pad 0 and
masked, as a tokenizer pads them), N tokens each (min_new_tokens = N: no early end).
"""

import json
import resource
import sys
import time

import numpy as np
import onnxruntime as ort
import torch
from optimum.onnxruntime import ORTModelForSeq2SeqLM, ORTModelForSpeechSeq2Seq


def batch(sources: list) -> dict:
    longest = max(len(s) for s in sources)
    ids = np.zeros((len(sources), longest), np.int64)
    mask = np.zeros_like(ids)
    for i, s in enumerate(sources):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}


def main(folder: str, threads: int, path: str) -> int:
    spec = json.load(open(path))
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    features = np.load(spec["features"]) if spec.get("features") else None
    cls = ORTModelForSpeechSeq2Seq if features is not None else ORTModelForSeq2SeqLM
    model = cls.from_pretrained(folder, use_cache=True, use_merged=False,
                                session_options=options)

    def inputs(sources: list) -> dict:  # token ids, or rows of the features file
        if features is None:
            return batch(sources)
        return {"input_features": torch.from_numpy(features[sources])}

    new, out = spec["new"], {}
    model.generate(**inputs([0] if features is not None else [[5, 6, 7]]),
                   max_new_tokens=2)  # warm up
    for name, sources in spec["workloads"].items():
        began = time.perf_counter()
        made = model.generate(**inputs(sources), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, num_beams=1)
        seconds = time.perf_counter() - began
        # exactly `new` tokens a row (min = max); the decoder's start token before them is
        # in the sequences of ORTModelForSeq2SeqLM, not in those of Whisper's generate
        out[name] = {"seconds": seconds, "tokens": new * made.shape[0]}
        if name == "1 stream":
            out["first_tokens"] = made[0, -new:].tolist()
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
