"""onnxruntime-genai's own graphs of tiny random-weight decoders, built by its model builder:

    python -m models.genai_builder llama --precision int4      # prints the .onnx path
    python -m models.genai_builder --list

From one Hugging Face folder (a random-weight model saved with `save_pretrained` by this venv,
plus a byte-level BPE tokenizer made with `tokenizers`; no hub download), the builder writes

    python -m onnxruntime_genai.models.builder -i HF -o OUT -p fp32|int4 -e cpu
    python -m onnxruntime_genai.models.builder -i HF -o OUT -p fp16 -e cuda   # `fp16`
    python -m onnxruntime_genai.models.builder -i HF -o OUT -p int4 -e cuda   # `int4-cuda`

(`fp16` is the build for a GPU, fp16 weights and cache, which ONNX Runtime's CPU provider
also runs: what most of genai's users export), a graph with GroupQueryAttention (seqlens_k /
total_sequence_length computed from the mask inside the graph), RotaryEmbedding,
SkipSimplifiedLayerNormalization, and for int4 MatMulNBits weights; its I/O is `input_ids`, `attention_mask`, `past_key_values.{i}.key|value` in and
`logits`, `present.{i}.key|value` out.

onnxruntime-genai needs the `onnxruntime` CPU wheel, which writes the same module as our
`onnxruntime-gpu`: so the builder runs in its OWN virtual environment
($SHAPETUNER_CACHE/venvs/genai, made on first use), never in the test venv. Everything is cached
under $SHAPETUNER_CACHE by (family, precision, this file's BUILD version).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from models.build import _cache_dir
from models.once import build_once
from models.venvs import ensure_venv

BUILD = 2  # bump when what this file builds changes: it is part of the cache key
GENAI_REQUIREMENTS = ("onnxruntime-genai==0.18.*", "torch==2.13.0", "transformers>=4.45",
                      "onnx", "onnx-ir", "onnxscript")
VENV = ("genai", GENAI_REQUIREMENTS)  # the environment: models/venvs.py
PRECISIONS = ("fp32", "int4", "fp16", "int4-cuda")
# the builder's (precision, execution provider) by our name, else (ours, "cpu"): its GPU
# builds carry fp16, or MatMulNBits without an accuracy level (no int8 activations)
_BUILD = {"fp16": ("fp16", "cuda"), "int4-cuda": ("int4", "cuda")}
VOCAB, POSITIONS = 1003, 256  # an odd vocabulary: the padding has work to do
# Tiny configs: 2 layers, GQA, an FFN width that is not a multiple of 64.
FAMILIES: dict[str, dict] = {
    "llama": dict(model_type="llama", num_hidden_layers=2, hidden_size=128,
                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=200,
                  tie_word_embeddings=False),
    # tied embeddings (Llama 3.2 1B/3B, Qwen2.5's small ones, Phi-4-mini): at int4 the builder
    # reads the embedding out of the LM head's 4-bit weight (Reshape -> GatherBlockQuantized)
    "llama_tied": dict(model_type="llama", num_hidden_layers=2, hidden_size=128,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=200,
                       tie_word_embeddings=True),
    "qwen2_tied": dict(model_type="qwen2", num_hidden_layers=2, hidden_size=128,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=200,
                       tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2", num_hidden_layers=2, hidden_size=128,
                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=200,
                  tie_word_embeddings=False),
    "phi3": dict(model_type="phi3", num_hidden_layers=2, hidden_size=128,
                 num_attention_heads=4, num_key_value_heads=2, intermediate_size=200,
                 tie_word_embeddings=False, pad_token_id=0,
                 original_max_position_embeddings=POSITIONS),  # one rotary cache, not two
    "mistral": dict(model_type="mistral", num_hidden_layers=2, hidden_size=128,
                    num_attention_heads=4, num_key_value_heads=2, intermediate_size=200,
                    tie_word_embeddings=False, sliding_window=None),
    # q/k norms: the builder splits the packed QKV, then normalizes each head
    "qwen3": dict(model_type="qwen3", num_hidden_layers=2, hidden_size=128,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  intermediate_size=200, tie_word_embeddings=False),
    # Gemma (tied: GatherBlockQuantized at int4, gelu_tanh), Phi-2 (parallel attention and
    # MLP, partial rotary, no GQA), Nemotron (an ungated relu2 FFN), Granite (Llama with
    # multipliers)
    "gemma": dict(model_type="gemma", num_hidden_layers=2, hidden_size=128,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  intermediate_size=200),
    "phi": dict(model_type="phi", num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                intermediate_size=200, tie_word_embeddings=False),
    "nemotron": dict(model_type="nemotron", num_hidden_layers=2, hidden_size=128,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     intermediate_size=200, tie_word_embeddings=False),
    "granite": dict(model_type="granite", num_hidden_layers=2, hidden_size=128,
                    num_attention_heads=4, num_key_value_heads=2, intermediate_size=200,
                    tie_word_embeddings=False),
    # sliding-window layers keep a windowed cache of their own length (tuner.rewrite.unwindow)
    "gemma2": dict(model_type="gemma2", num_hidden_layers=2, hidden_size=128,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   intermediate_size=200, sliding_window=16),
    # experts in ONNX Runtime's fused MoE op, sliding-window layers as Gemma 2's (fp32 only:
    # the builder's int4 reads the MXFP4 tensors of OpenAI's own checkpoint)
    "gpt_oss": dict(model_type="gpt_oss", num_hidden_layers=2, hidden_size=128,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                    tie_word_embeddings=False),
}


def venv_python() -> Path:
    """The genai environment's python, made (and its packages installed) on first use."""
    return ensure_venv(*VENV)


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps([BUILD, VOCAB, POSITIONS, *parts]).encode()).hexdigest()[:12]


def _corpus() -> list[str]:
    import numpy as np

    rng = np.random.default_rng(0)
    words = ["".join(chr(int(c)) for c in rng.integers(97, 123, int(n)))
             for n in rng.integers(2, 9, 2000)]
    return [" ".join(rng.choice(words, 100)) for _ in range(100)]


def save_tokenizer(folder: Path, vocab: int) -> None:
    """A byte-level BPE tokenizer of `vocab` entries, trained on random words."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                         bos_token="<s>", eos_token="</s>").save_pretrained(folder)


def hf_folder(family: str) -> Path:
    """The cached Hugging Face folder (config, safetensors, tokenizer) of a tiny family."""
    import torch
    import transformers

    folder = _cache_dir() / _key("hf", family, FAMILIES[family]) / "hf"

    def build() -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        config = dict(FAMILIES[family])
        kind = config.pop("model_type")
        with tempfile.TemporaryDirectory(dir=_cache_dir()) as tmp:
            staging = Path(tmp) / "hf"
            torch.manual_seed(0)
            cfg = transformers.AutoConfig.for_model(
                kind, **config, vocab_size=VOCAB, max_position_embeddings=POSITIONS,
                bos_token_id=1, eos_token_id=2)
            model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
            model.save_pretrained(staging)
            save_tokenizer(staging, VOCAB)
            os.replace(staging, folder)

    build_once(folder, (folder / "config.json").is_file, build)
    return folder


def cached(family: str, precision: str = "fp32") -> Path:
    """The builder's model.onnx for `family` at `precision` (built once, then cached)."""
    return build_all([(family, precision)])[0]


def build_all(cells: Sequence[tuple[str, str]]) -> list[Path]:
    """The builder's model.onnx for each (family, precision), those not cached yet built in
    ONE builder process (models/_genai_job.py): importing torch, transformers and the builder
    is ~9 s of a tiny model's ~10 s build, so a test file asks for all its builds at once.
    Each build's folder is written whole or not at all."""
    for family, precision in cells:
        if family not in FAMILIES or precision not in PRECISIONS:
            raise KeyError(f"no genai build {family}/{precision}; families {sorted(FAMILIES)}, "
                           f"precisions {PRECISIONS}")
    outs = [_out_dir(family, precision) for family, precision in cells]

    def missing() -> list[tuple[tuple[str, str], Path]]:
        return [(cell, out) for cell, out in zip(cells, outs) if not (out / "model.onnx").is_file()]

    # one builder process at a time: another asking meanwhile waits, then finds its builds
    build_once(_cache_dir() / "genai-builds", lambda: not missing(),
               lambda: _build(dict(missing())))
    return [out / "model.onnx" for out in outs]


def _out_dir(family: str, precision: str) -> Path:
    return _cache_dir() / _key("genai", family, FAMILIES[family], precision) / "genai"


def _build(todo: dict[tuple[str, str], Path]) -> None:
    hf = {family: hf_folder(family) for family, _ in todo}
    python = venv_python()
    with tempfile.TemporaryDirectory(dir=_cache_dir()) as tmp:
        staging = {cell: Path(tmp) / f"genai{i}" for i, cell in enumerate(todo)}
        jobs = [[str(hf[family]), str(staging[family, precision]),
                 *_BUILD.get(precision, (precision, "cpu")), str(Path(tmp) / "cache")]
                for family, precision in todo]
        (Path(tmp) / "jobs.json").write_text(json.dumps(jobs))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "PYTHONPATH": ""}
        # -P: the script's folder (models/) stays off sys.path, as in models/optimum.py
        run = subprocess.run([str(python), "-P", str(Path(__file__).with_name("_genai_job.py")),
                              str(Path(tmp) / "jobs.json")],
                             env=env, capture_output=True, text=True)
        if run.returncode != 0 or not all((s / "model.onnx").is_file() for s in staging.values()):
            raise RuntimeError(f"the genai model builder failed ({run.returncode}) on "
                               f"{list(todo)}:\n{run.stderr[-4000:]}")
        for (family, precision), out in todo.items():
            made = staging[family, precision]
            # the builder writes genai_config.json and the tokenizer's files, no config.json:
            # the folder stays as users have it (a copied config.json once hid that the
            # server took no positions from a genai folder)
            if not (made / "tokenizer.json").is_file():
                shutil.copyfile(hf[family] / "tokenizer.json", made / "tokenizer.json")
            out.parent.mkdir(parents=True, exist_ok=True)
            if out.exists():  # a folder left without its model.onnx
                shutil.rmtree(out)
            os.replace(made, out)


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m models.genai_builder", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("family", nargs="?", choices=sorted(FAMILIES))
    p.add_argument("--precision", choices=PRECISIONS, default="fp32")
    p.add_argument("--list", action="store_true")
    a = p.parse_args(argv)
    if a.list or not a.family:
        for name, config in FAMILIES.items():
            print(f"{name:8s} {json.dumps(config)} vocab {VOCAB}")
        return 0
    print(cached(a.family, a.precision))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
