"""Run INSIDE the Optimum environment (models/optimum.py's `seq2seq_greedy` starts it): load
each encoder-decoder export folder the way its users do (Optimum's ORTModelForSeq2SeqLM;
ORTModelForSpeechSeq2Seq where the folder holds a feature extractor's config;
ORTModelForVision2Seq for a VisionEncoderDecoder, random pixels), generate
greedily from fixed inputs (two rows, the second's source padded) and save the tokens and
every step's scores (and the inputs) into an .npz per folder. Imports nothing of ours.

    python -P _optimum_generate.py NEW_TOKENS OUT_DIR OPTIONS_JSON FOLDER [FOLDER ...]

OPTIONS_JSON: more arguments of `generate` (`{}`: greedy, NEW_TOKENS exactly; e.g.
`{"num_beams": 4, "min_new_tokens": 0}`; Whisper's `prompt_ids` as a list). With
`return_timestamps`, Whisper's generate seeks through the audio window by window: what is
saved is each row's first window (`window_0`, `window_1`: its decoder ids, prefix included).
"""

import json
import os
import sys

import numpy as np
import torch
from optimum.onnxruntime import (ORTModelForSeq2SeqLM, ORTModelForSpeechSeq2Seq,
                                 ORTModelForVision2Seq)


def _inputs(folder: str, config: dict) -> tuple[type, dict]:
    g = torch.Generator().manual_seed(0)
    if config["model_type"] == "vision-encoder-decoder":  # pixels of the encoder's image size
        size = config["encoder"]["image_size"]
        return ORTModelForVision2Seq, {"pixel_values": torch.randn(2, 3, size, size, generator=g)}
    if os.path.exists(os.path.join(folder, "preprocessor_config.json")):  # speech: mel features
        return ORTModelForSpeechSeq2Seq, {"input_features": torch.randn(2, 80, 3000, generator=g)}
    vocab = config["vocab_size"]
    ids = torch.randint(4, vocab, (2, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # the second source is 8 tokens, right-padded to 11
    return ORTModelForSeq2SeqLM, {"input_ids": ids, "attention_mask": mask}


def main(new_tokens: int, out_dir: str, folders: list[str], options: dict) -> int:
    for i, folder in enumerate(folders):
        cls, inputs = _inputs(folder, json.load(open(os.path.join(folder, "config.json"))))
        model = cls.from_pretrained(folder, use_cache=True)
        asked = {"min_new_tokens": new_tokens, "num_beams": 1, **options}
        if "prompt_ids" in asked:
            asked["prompt_ids"] = torch.tensor(asked["prompt_ids"])
        if asked.get("return_timestamps"):
            out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False,
                                 return_dict_in_generate=True, **asked)
            np.savez(os.path.join(out_dir, f"{i}.npz"), **{
                f"window_{b}": row[0]["result"]["sequences"].numpy()
                for b, row in enumerate(out["segments"])},
                **{f"input_{k}": v.numpy() for k, v in inputs.items()})
            continue
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, **asked)
        np.savez(os.path.join(out_dir, f"{i}.npz"), tokens=out.sequences.numpy(),
                 scores=np.stack([s.numpy() for s in out.scores]),
                 **{f"input_{k}": v.numpy() for k, v in inputs.items()},
                 files=np.array(sorted(f for f in os.listdir(folder) if f.endswith(".onnx"))))
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2], sys.argv[4:], json.loads(sys.argv[3])))
