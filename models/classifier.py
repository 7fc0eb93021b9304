"""A sequence classifier as Hugging Face Optimum exports one (`optimum-cli export onnx --task
text-classification`): a BERT with three labels (id2label negative / neutral / positive),
random weights with the classification head scaled up so that the labels' scores differ
clearly, models/cross_encoder.py's WordPiece tokenizer (BERT's pair template, for NLI-style
pairs). The folder holds what the export writes: model.onnx (inputs input_ids /
attention_mask / token_type_ids, output logits (batch, 3)), config.json, the tokenizer files;
the weights stay beside it for the tests' reference (transformers' pipeline). Cached under
$SHAPETUNER_CACHE like models/build.py's.

    python -m models.classifier OUT
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from models import optimum
from models.build import SEED, _cache_dir
from models.cross_encoder import CONFIG, CORPUS, _tokenizer
from models.once import build_once

LABELS = ("negative", "neutral", "positive")
HEAD_SCALE = 40.0  # the head's weights times this: softmax scores far from a uniform third
LAYOUT = 1  # bump when what is built changes (the cache key)


def write_folder(folder: Path) -> Path:
    """The Hugging Face folder: config, weights, tokenizer files."""
    import torch
    import transformers

    tok = _tokenizer()
    torch.manual_seed(SEED)
    config = transformers.BertConfig(
        vocab_size=tok.get_vocab_size(), **{**CONFIG, "num_labels": len(LABELS)},
        id2label=dict(enumerate(LABELS)), label2id={n: i for i, n in enumerate(LABELS)})
    model = transformers.BertForSequenceClassification(config).eval()
    with torch.no_grad():
        model.classifier.weight.mul_(HEAD_SCALE)
    model.save_pretrained(folder)
    transformers.BertTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
        cls_token="[CLS]", mask_token="[MASK]",
        model_max_length=CONFIG["max_position_embeddings"]).save_pretrained(folder)
    return folder


def cached() -> Path:
    """The folder (weights, config, tokenizer and Optimum's model.onnx), built on first use."""
    import torch
    import transformers

    key = hashlib.sha256(json.dumps([CONFIG, CORPUS[:5], LABELS, HEAD_SCALE, SEED, LAYOUT,
                                     torch.__version__, transformers.__version__,
                                     *optimum.REQUIREMENTS]).encode()).hexdigest()[:12]
    folder = _cache_dir() / f"classifier-{key}"

    def build() -> None:
        tmp = Path(tempfile.mkdtemp(prefix=".classifier-", dir=folder.parent))
        try:
            write_folder(tmp / "hf")
            job = [str(tmp / "hf"), "text-classification", str(tmp / "onnx"), None, "fp32"]
            optimum.run_jobs("_optimum_job.py", [job], tmp, "the classifier")
            shutil.copy(tmp / "onnx" / "model.onnx", tmp / "hf" / "model.onnx")
            os.replace(tmp / "hf", folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    build_once(folder, (folder / "model.onnx").is_file, build)
    return folder


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="where to copy the folder")
    args = parser.parse_args(argv)
    shutil.copytree(cached(), args.out, dirs_exist_ok=True)
    print(args.out / "model.onnx")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
