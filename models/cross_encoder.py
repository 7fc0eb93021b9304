"""A cross-encoder (reranker) as sentence-transformers' CrossEncoder and rerank servers take
it: a BERT sequence classifier with one label, random weights, a WordPiece tokenizer made
with `tokenizers` (BERT's pair template: [CLS] query [SEP] document [SEP], the document's
token type 1), saved with `save_pretrained` and exported to ONNX by torch (TorchScript,
inputs input_ids / attention_mask / token_type_ids, output logits (batch, 1), as Optimum's
text-classification export names them). Cached under $SHAPETUNER_CACHE like models/build.py's.

    python -m models.cross_encoder OUT
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from models.build import IR_VERSION, OPSET_TORCHSCRIPT, SEED, _cache_dir
from models.once import build_once

CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=136,
              max_position_embeddings=128, num_labels=1)
CORPUS = ["A red fox jumps over the lazy dog.", "Foxes live in forests and eat mice.",
          "The dog sleeps all day.", "Where do foxes live?", "Cats chase mice at night."] * 20
LAYOUT = 2  # bump when what is built changes (the cache key)


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import trainers

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=200,
                                                              special_tokens=special))
    return with_bert_template(tok)


def with_bert_template(tok):
    """`tok` (trained, with [CLS] and [SEP]) given BERT's template: [CLS] A [SEP], and for a
    pair [CLS] A [SEP] B [SEP] with B's token types 1."""
    from tokenizers import processors

    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tok


def write_folder(folder: Path) -> Path:
    """The Hugging Face folder: config, weights, tokenizer files."""
    import torch
    import transformers

    tok = _tokenizer()
    torch.manual_seed(SEED)
    config = transformers.BertConfig(vocab_size=tok.get_vocab_size(), **CONFIG)
    model = transformers.BertForSequenceClassification(config).eval()
    model.save_pretrained(folder)
    save_tokenizer(tok, folder)
    return folder


def save_tokenizer(tok, folder: Path) -> None:
    """BERT's tokenizer class, as a real reranker's folder names it: transformers then passes
    the token types (a generic fast tokenizer leaves them out)."""
    import transformers

    transformers.BertTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
        cls_token="[CLS]", mask_token="[MASK]",
        model_max_length=CONFIG["max_position_embeddings"]).save_pretrained(folder)


def _export(folder: Path, out: Path) -> None:
    import onnx
    import torch
    import transformers

    from models.quiet import quiet_exporters

    model = transformers.BertForSequenceClassification.from_pretrained(folder).eval()

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.model(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).logits

    ids = torch.randint(5, model.config.vocab_size, (2, 12))
    names = ["input_ids", "attention_mask", "token_type_ids"]
    axes = {n: {0: "batch", 1: "sequence"} for n in names} | {"logits": {0: "batch"}}
    with torch.no_grad(), quiet_exporters():
        torch.onnx.export(Logits().eval(), (ids, torch.ones_like(ids), torch.zeros_like(ids)),
                          str(out), dynamo=False, input_names=names, output_names=["logits"],
                          dynamic_axes=axes, opset_version=OPSET_TORCHSCRIPT)
    proto = onnx.load(str(out))
    proto.ir_version = min(proto.ir_version, IR_VERSION)
    onnx.save(proto, str(out))


def cached() -> Path:
    """The folder (Hugging Face files and model.onnx), built once per key."""
    from importlib.metadata import version  # (the versions without importing torch: seconds)

    key = hashlib.sha256(json.dumps([CONFIG, CORPUS[:5], SEED, LAYOUT, version("torch"),
                                     version("transformers")]).encode()).hexdigest()[:12]
    folder = _cache_dir() / f"cross-encoder-{key}"

    def build() -> None:
        tmp = Path(tempfile.mkdtemp(prefix=".cross-encoder-", dir=folder.parent))
        try:
            write_folder(tmp)
            _export(tmp, tmp / "model.onnx")
            os.replace(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

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
