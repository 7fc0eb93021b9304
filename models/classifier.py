"""BERT's task heads as Hugging Face Optimum exports them (`optimum-cli export onnx --task
TASK`), random weights, models/cross_encoder.py's WordPiece tokenizer (BERT's pair template):

- `text-classification`: a sequence classifier with an NLI model's three labels (id2label
  contradiction / neutral / entailment, as MNLI models name them), its head scaled up so that
  the labels' scores differ clearly; logits (batch, 3);
- `token-classification`: a named-entity tagger (O, B-PER, I-PER, B-LOC, I-LOC); logits
  (batch, sequence, 5); `deberta-token-classification` the same labels on DeBERTa-v2 with
  DeBERTa-v3's kind of tokenizer (a unigram model under Metaspace, as PII taggers ship);
- `fill-mask`: a masked LM; logits (batch, sequence, vocabulary); `splade_repo()` holds it
  as a SPLADE model's repository (sentence-transformers' SparseEncoder files, onnx/).

The folder holds what the export writes: model.onnx (inputs input_ids / attention_mask /
token_type_ids), config.json, the tokenizer files; the weights stay beside it for the tests'
reference (transformers' pipelines). Cached under $SHAPETUNER_CACHE like models/build.py's.

    python -m models.classifier OUT [--task TASK]
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
from models.cross_encoder import CONFIG, CORPUS, _tokenizer, save_tokenizer, with_bert_template
from models.once import build_once

LABELS = ("contradiction", "neutral", "entailment")
ENTITIES = ("O", "B-PER", "I-PER", "B-LOC", "I-LOC")
# each model: Optimum's task, the transformers class, its labels (None: a masked LM's
# vocabulary); the DeBERTa tagger has DeBERTa-v3's kind of tokenizer (a SentencePiece-style
# unigram model under Metaspace: no subword prefix, unknown characters as [UNK])
TASKS = {"text-classification": ("text-classification", "BertForSequenceClassification",
                                 LABELS),
         "token-classification": ("token-classification", "BertForTokenClassification",
                                  ENTITIES),
         "deberta-token-classification": ("token-classification",
                                          "DebertaV2ForTokenClassification", ENTITIES),
         "fill-mask": ("fill-mask", "BertForMaskedLM", None)}
DEBERTA = dict(relative_attention=True, position_buckets=16, pos_att_type=["p2c", "c2p"],
               max_relative_positions=-1, position_biased_input=False, type_vocab_size=0)
HEAD_SCALE = 40.0  # a head's weights times this: softmax scores far from uniform
LAYOUT = 2  # bump when what is built changes (the cache key)


def write_folder(folder: Path, task: str = "text-classification") -> Path:
    """The Hugging Face folder: config, weights, tokenizer files."""
    import torch
    import transformers

    _, kind, labels = TASKS[task]
    deberta = kind.startswith("Deberta")
    tok = _unigram() if deberta else _tokenizer()
    torch.manual_seed(SEED)
    named = {} if labels is None else dict(
        num_labels=len(labels), id2label=dict(enumerate(labels)),
        label2id={n: i for i, n in enumerate(labels)})
    config = (transformers.DebertaV2Config if deberta else transformers.BertConfig)(
        vocab_size=tok.get_vocab_size(), **{**CONFIG, **named, **(DEBERTA if deberta else {})})
    model = getattr(transformers, kind)(config).eval()
    if labels is not None:
        with torch.no_grad():
            model.classifier.weight.mul_(HEAD_SCALE)
    model.save_pretrained(folder)
    if deberta:
        transformers.DebertaV2TokenizerFast(
            tokenizer_object=tok, bos_token="[CLS]", eos_token="[SEP]", sep_token="[SEP]",
            cls_token="[CLS]", unk_token="[UNK]", pad_token="[PAD]", mask_token="[MASK]",
            model_max_length=CONFIG["max_position_embeddings"]).save_pretrained(folder)
    else:
        save_tokenizer(tok, folder)
    return folder


def _unigram():
    """A unigram tokenizer under Metaspace (DeBERTa-v3's kind), trained on the corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    special = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"]
    tok.train_from_iterator(CORPUS, trainers.UnigramTrainer(
        vocab_size=200, special_tokens=special, unk_token="[UNK]", show_progress=False))
    return with_bert_template(tok)


def _folder(task: str) -> Path:
    from importlib.metadata import version  # (the versions without importing torch: seconds)

    key = hashlib.sha256(json.dumps([task, TASKS[task], CONFIG, CORPUS[:5], HEAD_SCALE, SEED,
                                     LAYOUT, version("torch"), version("transformers"),
                                     *optimum.REQUIREMENTS]).encode()).hexdigest()[:12]
    return _cache_dir() / f"classifier-{key}"


def _build(tasks: list[str]) -> None:
    """Every model of `tasks` exported in one Optimum process (it imports torch once), each
    folder written whole or not at all."""
    root = _cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".classifiers-", dir=root) as tmp:
        jobs = []
        for i, task in enumerate(tasks):
            write_folder(Path(tmp) / f"hf{i}", task)
            jobs.append([str(Path(tmp) / f"hf{i}"), TASKS[task][0], str(Path(tmp) / f"onnx{i}"),
                         None, "fp32"])
        optimum.run_jobs("_optimum_job.py", jobs, Path(tmp), f"the models {tasks}")
        for i, task in enumerate(tasks):
            shutil.copy(Path(tmp) / f"onnx{i}" / "model.onnx", Path(tmp) / f"hf{i}" / "model.onnx")
            os.replace(Path(tmp) / f"hf{i}", _folder(task))


def cached(task: str = "text-classification") -> Path:
    """The folder (weights, config, tokenizer and Optimum's model.onnx), built on first use:
    every model of TASKS at once, in one Optimum process."""
    if task not in TASKS:
        raise ValueError(f"no task {task!r}; tasks: {', '.join(TASKS)}")

    def missing() -> list[str]:
        return [t for t in TASKS if not (_folder(t) / "model.onnx").is_file()]

    build_once(_cache_dir() / "classifiers", lambda: not missing(), lambda: _build(missing()))
    return _folder(task)


def splade_repo() -> Path:
    """The masked LM as a SPLADE model's hub repository holds it: sentence-transformers'
    SparseEncoder files at the top (modules.json naming SpladePooling, max pooling of
    log1p(relu(logits)); 1_SpladePooling/config.json; the weights) and the Optimum export at
    onnx/model.onnx."""
    from importlib.metadata import version

    mlm = cached("fill-mask")
    # the version from its metadata: importing the library (and torch) takes seconds
    folder = mlm.with_name(mlm.name + f"-splade-{version('sentence-transformers')}")

    def build() -> None:
        from sentence_transformers import SparseEncoder
        from sentence_transformers.sparse_encoder.modules import SpladePooling, Transformer

        tmp = Path(tempfile.mkdtemp(prefix=".splade-", dir=folder.parent))
        try:
            encoder = SparseEncoder(modules=[Transformer(str(mlm), transformer_task="fill-mask"),
                                             SpladePooling("max")], device="cpu")
            encoder.save(str(tmp))
            (tmp / "onnx").mkdir()
            shutil.copy(mlm / "model.onnx", tmp / "onnx" / "model.onnx")
            os.replace(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    build_once(folder, (folder / "onnx" / "model.onnx").is_file, build)
    return folder


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="where to copy the folder")
    parser.add_argument("--task", choices=list(TASKS), default="text-classification",
                        help="which model (its Optimum task, or deberta-token-classification)")
    args = parser.parse_args(argv)
    shutil.copytree(cached(args.task), args.out, dirs_exist_ok=True)
    print(args.out / "model.onnx")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
