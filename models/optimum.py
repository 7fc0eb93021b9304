"""Decoders exported by Hugging Face Optimum (`optimum-onnx`), the usual way an LLM reaches
ONNX, for the conformance matrix (tests/test_conformance.py); and its encoder-decoders (T5,
BART, Whisper: a folder of graphs, tests/test_seq2seq.py).

    python -m models.optimum llama --task text-generation-with-past -o llama-optimum/
    python -m models.optimum gptj --task text-generation-with-past@O2   # optimized (--optimize O2)
    python -m models.optimum llama --task text-generation-with-past@fp16  # --dtype fp16
    python -m models.optimum t5 --task text2text-generation-with-past
    python -m models.optimum --list

Optimum pins the transformers it supports (optimum-onnx 0.1 pins 4.57), older than ours,
so it lives in its own virtual environment (models/venvs.py), made on first use.
No hub downloads: our environment writes a random-weight model (config.json, safetensors,
a word-level tokenizer made with `tokenizers`) into a local folder with `save_pretrained`,
and the Optimum environment exports from that folder. Exports are cached by (family, task,
config, versions) under $SHAPETUNER_CACHE like models/build.py's.

Over 400 lines on purpose: FAMILIES is one table (every family's config and what inspect
must find in it), read by the matrix and by --list.
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from models import venvs
from models.build import SEED, _cache_dir
from models.once import build_once

OPTIMUM_ONNX = "optimum-onnx==0.1.0"
# Optimum fixes the exported graph's dynamic axes through onnxruntime (the CPU wheel: this
# environment is its own, so it holds one onnxruntime too).
REQUIREMENTS = (OPTIMUM_ONNX, venvs.TORCH, "onnxruntime>=1.20")
VENV = ("optimum", REQUIREMENTS)  # the environment: models/venvs.py
TASKS = ("text-generation-with-past", "text-generation")
# The with-past export run through Optimum's own ONNX Runtime optimization (`--optimize O2`:
# fused LayerNorm/SkipLayerNorm, GELU, and attention where its optimizer knows the model)
O2_TASK = f"{TASKS[0]}@O2"
# The with-past export in half precision (`--dtype fp16`, which Optimum runs on the CPU too)
FP16_TASK = f"{TASKS[0]}@fp16"
# Encoder-decoders: a folder of encoder_model.onnx, decoder_model.onnx,
# decoder_with_past_model.onnx and decoder_model_merged.onnx (`export_all` returns the first
# decoder's path: its folder is the export)
SEQ2SEQ_TASKS = ("text2text-generation-with-past", "automatic-speech-recognition-with-past",
                 "image-to-text-with-past")
# Image transformers (ViT, CLIP's and SigLIP's vision towers): pixels in, hidden states out
VISION_TASK = "feature-extraction"
ALL_TASKS = (*TASKS, O2_TASK, FP16_TASK, *SEQ2SEQ_TASKS, VISION_TASK)
VOCAB = 1003  # odd: the vocab padding has something to do
EXPORT_LAYOUT = 2  # bump when how the folder or the export is made changes (the cache key)


@dataclass(frozen=True)
class Family:
    """One tiny decoder: transformers model_type, config overrides, what inspect must find."""

    model_type: str
    config: dict[str, Any]
    expect: dict[str, Any]
    tasks: tuple[str, ...] = TASKS  # the matrix's cells for this family
    # the random weights written by the exporter's transformers (models/_optimum_job.py):
    # ours (5) saves some families' weights in a layout the 4.57 Optimum pins cannot load
    exporter_weights: bool = False
    auto_class: str = "AutoModelForCausalLM"  # the transformers class made from the config


def _family(model_type: str, config: dict[str, Any], heads: int, kv: int, head_dim: int,
            ffn: int, gated: bool, tasks: tuple[str, ...] = TASKS) -> Family:
    hidden = config.get("hidden_size") or config.get("n_embd") or config.get("d_model")
    return Family(model_type, {**config, "vocab_size": VOCAB}, dict(
        num_layers=2, hidden_size=hidden, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        ffn_size=ffn, ffn_gated=gated, vocab_size=VOCAB), tasks)


_L = dict(num_hidden_layers=2, max_position_embeddings=256, tie_word_embeddings=False)
# Two layers, h 64-96, odd FFN widths and head dims, grouped-query heads where the family has them.
FAMILIES: dict[str, Family] = {
    "gpt2": _family("gpt2", dict(n_layer=2, n_embd=80, n_head=2, n_inner=200, n_positions=256),
                    2, 2, 40, 200, False),
    "llama": _family("llama", dict(_L, hidden_size=96, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=200), 4, 2, 24, 200, True),
    "mistral": _family("mistral", dict(_L, hidden_size=80, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=40, intermediate_size=200),
                       2, 1, 40, 200, True),
    "qwen2": _family("qwen2", dict(_L, hidden_size=96, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=200), 4, 2, 24, 200, True),
    "phi3": _family("phi3", dict(_L, hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=200, pad_token_id=0, bos_token_id=1,
                                 eos_token_id=2), 4, 2, 24, 200, True),
    "gpt_neox": _family("gpt_neox", dict(_L, hidden_size=96, num_attention_heads=4,
                                         intermediate_size=200, rotary_pct=0.25), 4, 4, 24, 200, False),
    # Gemma: head dim 24 != h/a = 16, embeddings scaled by sqrt(h), GeGLU, tied.
    "gemma": _family("gemma", dict(_L, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=24, intermediate_size=200, tie_word_embeddings=True),
                     4, 2, 24, 200, True),
}
_KV = (TASKS[0],)  # the families below: with the cache only, what generation serves
_WINDOW = dict(sliding_window=16)  # shorter than the tests' generations, so it acts
# The other decoders Optimum exports with a cache that users bring: q/k norms (Qwen3, OLMo2,
# Gemma 3), sliding windows and soft-capping (Gemma 2 and 3, no position_ids input),
# multipliers (Granite), NoPE layers (SmolLM3), partial rotary (Phi, StableLM), fused qkv
# sliced by index (Falcon multi-query, Bloom's ALiBi), multi-query (GPTBigCode), learned
# positions (OPT), GPT-J's gathered sin/cos table, GPT-Neo's local attention; and
# CodeGen's fused qkv split in 4 groups, Cohere's interleaved rotary and parallel block,
# MPT's ALiBi biased by slot, Nemotron's squared-ReLU FFN without position_ids, OLMo,
# Arcee, Helium, GLM's fused gate/up, GPT-OSS's attention sinks, window and experts.
_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # inside the vocabulary
FAMILIES.update({
    "qwen3": _family("qwen3", dict(_L, hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=24, intermediate_size=200), 4, 2, 24, 200, True, _KV),
    "gemma2": _family("gemma2", dict(_L, **_WINDOW, hidden_size=64, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=24, intermediate_size=200,
                                     tie_word_embeddings=True), 4, 2, 24, 200, True, _KV),
    "gemma3_text": _family("gemma3_text", dict(_L, **_WINDOW, hidden_size=64, num_attention_heads=4,
                                               num_key_value_heads=2, head_dim=24,
                                               intermediate_size=200, tie_word_embeddings=True),
                           4, 2, 24, 200, True, _KV),
    "granite": _family("granite", dict(_L, hidden_size=96, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=200,
                                       embedding_multiplier=12.0, logits_scaling=8.0,
                                       residual_multiplier=0.22, attention_multiplier=0.015625),
                       4, 2, 24, 200, True, _KV),
    "olmo2": _family("olmo2", dict(_L, hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=200), 4, 2, 24, 200, True, _KV),
    "smollm3": _family("smollm3", dict(_L, pad_token_id=0, hidden_size=96, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=200),
                       4, 2, 24, 200, True, _KV),
    "phi": _family("phi", dict(_L, hidden_size=96, num_attention_heads=4, intermediate_size=200,
                               partial_rotary_factor=0.5), 4, 4, 24, 200, False, _KV),
    "stablelm": _family("stablelm", dict(_L, hidden_size=96, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=200),
                        4, 2, 24, 200, True, _KV),
    "falcon": _family("falcon", dict(num_hidden_layers=2, hidden_size=96, num_attention_heads=4,
                                     multi_query=True, parallel_attn=True, alibi=False,
                                     bias=False, max_position_embeddings=256),
                      4, 1, 24, 384, False, _KV),
    "bloom": _family("bloom", dict(n_layer=2, hidden_size=96, n_head=4), 4, 4, 24, 384, False, _KV),
    "gpt_bigcode": _family("gpt_bigcode", dict(n_layer=2, n_embd=80, n_head=2, n_inner=200,
                                               n_positions=256, multi_query=True),
                           2, 1, 40, 200, False, _KV),
    "opt": _family("opt", dict(num_hidden_layers=2, hidden_size=96, num_attention_heads=4,
                               ffn_dim=200, max_position_embeddings=256, word_embed_proj_dim=96),
                   4, 4, 24, 200, False, _KV),
    "gptj": _family("gptj", dict(n_layer=2, n_embd=96, n_head=4, n_inner=200, n_positions=256,
                                 rotary_dim=12, tie_word_embeddings=False),
                   4, 4, 24, 200, False, _KV),
    "gpt_neo": _family("gpt_neo", dict(num_layers=2, hidden_size=96, num_heads=4,
                                       intermediate_size=200, max_position_embeddings=256,
                                       attention_types=[[["global", "local"], 1]], window_size=16),
                       4, 4, 24, 200, False, _KV),
    "codegen": _family("codegen", dict(_IDS, n_layer=2, n_embd=96, n_head=4, rotary_dim=12,
                                       n_positions=256, n_ctx=256, n_inner=200,
                                       tie_word_embeddings=False), 4, 4, 24, 200, False, _KV),
    "cohere": _family("cohere", dict(_L, **_IDS, hidden_size=96, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=200),
                      4, 2, 24, 200, True, _KV),
    "mpt": _family("mpt", dict(_IDS, d_model=96, n_heads=4, n_layers=2,
                               max_seq_len=256), 4, 4, 24, 384, False, _KV),
    "nemotron": _family("nemotron", dict(_L, **_IDS, hidden_size=96, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=24,
                                         intermediate_size=200), 4, 2, 24, 200, False, _KV),
    "olmo": _family("olmo", dict(_L, **_IDS, hidden_size=96, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=200),
                    4, 2, 24, 200, True, _KV),
    "arcee": _family("arcee", dict(_L, **_IDS, hidden_size=96, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=200),
                     4, 2, 24, 200, False, _KV),
    "helium": _family("helium", dict(_L, **_IDS, hidden_size=96, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=24, intermediate_size=200),
                      4, 2, 24, 200, True, _KV),
    "glm": _family("glm", dict(_L, **_IDS, hidden_size=96, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=24, intermediate_size=200),
                   4, 2, 24, 200, True, _KV),
    "gpt_oss": _family("gpt_oss", dict(_L, **_IDS, **_WINDOW, hidden_size=96,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=24, intermediate_size=72, num_local_experts=4,
                                       num_experts_per_tok=2,
                                       layer_types=["sliding_attention", "full_attention"]),
                       4, 2, 24, 0, False, _KV),
    # experts as Linear layers each, every one run on the tokens routed to it (Optimum's patch)
    "qwen3_moe": replace(_family("qwen3_moe", dict(_L, **_IDS, hidden_size=96,
                                                   num_attention_heads=4, num_key_value_heads=2,
                                                   head_dim=24, intermediate_size=200,
                                                   num_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=72,
                                                   decoder_sparse_step=1, mlp_only_layers=[]),
                                 4, 2, 24, 0, False, _KV), exporter_weights=True),
    # multi-head latent attention: keys 24 wide (16 + 8 rotary), values 16 (head dim not padded)
    "deepseek_v3": _family("deepseek_v3", dict(_L, **_IDS, hidden_size=96, num_attention_heads=4,
                                               num_key_value_heads=4, intermediate_size=200,
                                               moe_intermediate_size=72, n_routed_experts=4,
                                               num_experts_per_tok=2, n_shared_experts=1,
                                               first_k_dense_replace=1, kv_lora_rank=32,
                                               q_lora_rank=48, qk_rope_head_dim=8,
                                               qk_nope_head_dim=16, v_head_dim=16, n_group=1,
                                               topk_group=1), 4, 4, 24, 200, True, _KV),
})


# Encoder-decoders as Optimum exports them (a folder of graphs): T5 (relative position
# bias, no softmax scale, ReLU FFN), Flan-T5, Marian, BART (learned positions shifted by 2,
# GELU), ViT + GPT-2 (an image encoder, then GPT-2 with cross-attention), Whisper
# (a speech encoder on mel features, the decoder BART's). `expect`: the decoder's dims.
_S2S = dict(exporter_weights=True, auto_class="AutoModelForSeq2SeqLM")
FAMILIES.update({
    "t5": replace(_family("t5", dict(d_model=80, num_heads=2, d_kv=40, d_ff=200, num_layers=2,
                                     num_decoder_layers=2, decoder_start_token_id=0,
                                     pad_token_id=0, eos_token_id=2),
                          2, 2, 40, 200, False, SEQ2SEQ_TASKS[:1]), **_S2S),
    # Flan-T5 (T5 v1.1): a gated GELU FFN and an untied LM head
    "flan_t5": replace(_family("t5", dict(d_model=80, num_heads=2, d_kv=40, d_ff=200,
                                          num_layers=2, num_decoder_layers=2,
                                          decoder_start_token_id=0, pad_token_id=0,
                                          eos_token_id=2, feed_forward_proj="gated-gelu",
                                          tie_word_embeddings=False),
                               2, 2, 40, 200, True, SEQ2SEQ_TASKS[:1]), **_S2S),
    # Marian (OPUS-MT): sinusoidal positions (a constant table), a bias on the logits
    "marian": replace(_family("marian", dict(d_model=80, encoder_attention_heads=2,
                                             decoder_attention_heads=2, encoder_ffn_dim=200,
                                             decoder_ffn_dim=200, encoder_layers=2,
                                             decoder_layers=2, max_position_embeddings=256,
                                             decoder_start_token_id=0, pad_token_id=0),
                              2, 2, 40, 200, False, SEQ2SEQ_TASKS[:1]), **_S2S),
    "bart": replace(_family("bart", dict(d_model=80, encoder_attention_heads=2,
                                         decoder_attention_heads=2, encoder_ffn_dim=200,
                                         decoder_ffn_dim=200, encoder_layers=2, decoder_layers=2,
                                         max_position_embeddings=256),
                            2, 2, 40, 200, False, SEQ2SEQ_TASKS[:1]), **_S2S),
    "whisper": replace(_family("whisper", dict(d_model=80, encoder_attention_heads=2,
                                               decoder_attention_heads=2, encoder_ffn_dim=200,
                                               decoder_ffn_dim=200, encoder_layers=2,
                                               decoder_layers=2, num_mel_bins=80,
                                               max_source_positions=1500,
                                               max_target_positions=64, **_IDS,
                                               decoder_start_token_id=1),
                               2, 2, 40, 200, False, SEQ2SEQ_TASKS[1:2]),
                       exporter_weights=True, auto_class="AutoModelForSpeechSeq2Seq"),
    # VisionEncoderDecoder (ViT + GPT-2 with cross-attention, as image captioners ship):
    # GPT-2's Conv1D flattens the encoder's output before its cross keys' Gemm
    "vit_gpt2": replace(_family("vision-encoder-decoder", dict(
        encoder=dict(model_type="vit", hidden_size=80, num_hidden_layers=2,
                     num_attention_heads=2, intermediate_size=200, image_size=32,
                     patch_size=8),
        decoder=dict(model_type="gpt2", n_embd=80, n_layer=2, n_head=2, n_inner=200,
                     vocab_size=VOCAB, n_positions=128, add_cross_attention=True,
                     is_decoder=True, **_IDS),
        decoder_start_token_id=1, pad_token_id=0, hidden_size=80),
        2, 2, 40, 200, False, SEQ2SEQ_TASKS[2:]),
        exporter_weights=True, auto_class="AutoModelForVision2Seq"),
})
# Vision towers with SigLIP-so400m's awkward head dim (72) on a 4 x 4 grid of 8-pixel patches
# (ViT and CLIP add a class token: 17 positions; SigLIP 16); no LM head, no tokenizer
_VISION = dict(hidden_size=144, num_hidden_layers=2, num_attention_heads=2,
               intermediate_size=200, image_size=32, patch_size=8)
FAMILIES.update({
    name: replace(_family(kind, dict(_VISION), 2, 2, 72, 200, False, (VISION_TASK,)),
                  expect=dict(num_layers=2, hidden_size=144, num_heads=2, head_dim=72,
                              ffn_size=200, kind="encoder"),
                  exporter_weights=True, auto_class="AutoModel")
    for name, kind in (("vit", "vit"), ("clip_vision", "clip_vision_model"),
                       ("siglip_vision", "siglip_vision_model"))})


# Benchmark-only families (bench/seq2seq_generate.py): full-size shapes, not in the tests'
# matrix. T5-small's: 6 + 6 layers, d_model 512, 8 heads of 64, FFN 2048, 32128 tokens.
BENCH_FAMILIES: dict[str, Family] = {
    "t5_small": replace(Family("t5", dict(d_model=512, num_heads=8, d_kv=64, d_ff=2048,
                                          num_layers=6, num_decoder_layers=6,
                                          decoder_start_token_id=0, pad_token_id=0,
                                          eos_token_id=2, vocab_size=32128),
                               dict(num_layers=6, hidden_size=512, num_heads=8, head_dim=64,
                                    ffn_size=2048, vocab_size=32128), SEQ2SEQ_TASKS[:1]),
                        **_S2S),
    # Whisper-tiny's: 4 + 4 layers, d_model 384, 6 heads of 64, FFN 1536, 51865 tokens
    "whisper_tiny": replace(Family("whisper", dict(d_model=384, encoder_attention_heads=6,
                                                   decoder_attention_heads=6,
                                                   encoder_ffn_dim=1536, decoder_ffn_dim=1536,
                                                   encoder_layers=4, decoder_layers=4,
                                                   num_mel_bins=80, max_source_positions=1500,
                                                   max_target_positions=448,
                                                   vocab_size=51865, pad_token_id=50257,
                                                   bos_token_id=50257, eos_token_id=50257,
                                                   decoder_start_token_id=50258),
                                   dict(num_layers=4, hidden_size=384, num_heads=6,
                                        head_dim=64, ffn_size=1536, vocab_size=51865),
                                   SEQ2SEQ_TASKS[1:2]),
                            exporter_weights=True, auto_class="AutoModelForSpeechSeq2Seq"),
}


def family(name: str) -> Family:
    """A family of the tests' matrix or of the benchmarks'."""
    return FAMILIES.get(name) or BENCH_FAMILIES[name]


def main_file(task: str) -> str:
    """The graph `export_all` returns for a task: the decoder of an encoder-decoder's folder."""
    return "decoder_model.onnx" if task in SEQ2SEQ_TASKS else "model.onnx"


def ensure_venv() -> Path:
    """The Optimum environment's python (models/venvs.py), made on first use."""
    return venvs.ensure_venv(*VENV)


# ---------------------------------------------------------------------------------------------
# The random-weight checkpoint (written by OUR environment) and the export (by Optimum's)


def write_checkpoint(name: str, folder: Path) -> Path:
    """config.json + model.safetensors + a word-level tokenizer for family `name`."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    fam = family(name)
    folder.mkdir(parents=True, exist_ok=True)
    if fam.exporter_weights:
        (folder / "random_model.json").write_text(json.dumps(
            {"model_type": fam.model_type, "config": fam.config, "seed": SEED,
             "auto_class": fam.auto_class}))
    else:
        torch.manual_seed(SEED)
        config = transformers.AutoConfig.for_model(fam.model_type, **fam.config)
        model = transformers.AutoModelForCausalLM.from_config(config).eval().float()
        model.save_pretrained(folder, safe_serialization=True)
    if fam.auto_class in ("AutoModelForVision2Seq", "AutoModel"):  # pixels in: no tokenizer
        return folder
    if fam.auto_class == "AutoModelForSpeechSeq2Seq":  # mel features in, no tokenizer
        transformers.WhisperFeatureExtractor(
            feature_size=fam.config["num_mel_bins"]).save_pretrained(folder)
        return folder
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3,
             **{f"w{i}": i for i in range(4, fam.config["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
        eos_token="</s>").save_pretrained(folder)
    # transformers 5 names the class "TokenizersBackend", which the 4.57 that Optimum pins
    # cannot load, and Optimum then leaves the tokenizer out of its export without a word;
    # the hub's checkpoints name a class every version reads, as this one now does
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()),
                                  "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))
    return folder


def _key(name: str, task: str) -> str:
    """The cache key: what the checkpoint is and which exporter wrote it."""
    payload = json.dumps([name, task, family(name).model_type, family(name).config, SEED,
                          *REQUIREMENTS, EXPORT_LAYOUT], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def _out_dir(name: str, task: str) -> Path:
    short = {TASKS[0]: "kv", TASKS[1]: "nokv", O2_TASK: "kv-o2", FP16_TASK: "kv-fp16",
             SEQ2SEQ_TASKS[0]: "s2s",
             SEQ2SEQ_TASKS[1]: "asr", SEQ2SEQ_TASKS[2]: "i2t", VISION_TASK: "vision"}[task]
    return _cache_dir() / f"optimum-{_key(name, task)}" / f"{name}-optimum-{short}"


def _job(checkpoint: Path, task: str, out: Path) -> tuple[str, str, str, str | None, str]:
    """[checkpoint, task, output, optimization level or None, dtype]: one line of jobs.json
    (a task's "@O2" is an optimization level, its "@fp16" a dtype)."""
    base, _, option = task.partition("@")
    dtype = option if option == "fp16" else "fp32"
    return str(checkpoint), base, str(out), (option or None) if dtype == "fp32" else None, dtype


def export_all(cells: list[tuple[str, str]], outs: list[Path] | None = None) -> list[Path]:
    """Export each (family, task) with Optimum into its cache folder (or `outs`), in one
    Optimum process; returns each model.onnx. Each folder is written whole or not at all.
    A task is one of TASKS, O2_TASK (the with-past export, optimized), FP16_TASK (in half
    precision) or one of SEQ2SEQ_TASKS (returned: the folder's decoder_model.onnx)."""
    for name, task in cells:
        if name not in {**FAMILIES, **BENCH_FAMILIES} or task not in ALL_TASKS:
            raise ValueError(f"no Optimum export {name!r} / {task!r}; families: "
                             f"{', '.join(FAMILIES)}; tasks: {', '.join(ALL_TASKS)}")
    outs = outs or [_out_dir(n, t) for n, t in cells]

    def missing() -> list[tuple[tuple[str, str], Path]]:
        return [(c, o) for c, o in zip(cells, outs) if not (o / main_file(c[1])).exists()]

    # one Optimum process at a time: another asking for the same exports waits, then finds them
    build_once(_cache_dir() / "optimum-exports", lambda: not missing(),
               lambda: _export(missing()))
    return [out / main_file(task) for (_, task), out in zip(cells, outs)]


def run_jobs(script: str, jobs: list, tmp: Path, what: str) -> None:
    """Run models/`script` in Optimum's environment on `jobs` (written to tmp/jobs.json),
    offline; RuntimeError with its output's tail when it fails."""
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    # -P: the script's folder (models/, which has an optimum.py) stays off sys.path
    done = subprocess.run([str(ensure_venv()), "-P", str(Path(__file__).with_name(script)),
                           str(tmp / "jobs.json")], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"optimum could not export {what}: "
                           f"{(done.stderr or done.stdout)[-3000:]}")


def _export(todo: list[tuple[tuple[str, str], Path]]) -> None:
    root = todo[0][1].parent
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".optimum-") as tmp:
        jobs = [_job(write_checkpoint(n, Path(tmp) / f"ckpt{i}"), t, Path(tmp) / f"onnx{i}")
                for i, ((n, t), _) in enumerate(todo)]
        run_jobs("_optimum_job.py", jobs, Path(tmp), f"{[c for c, _ in todo]}")
        for (_, _, made, _, _), (_, out) in zip(jobs, todo):
            out.parent.mkdir(parents=True, exist_ok=True)
            if out.exists():
                shutil.rmtree(out)
            os.replace(made, out)


def cached(name: str, task: str = "text-generation-with-past") -> Path:
    """The cached Optimum export of family `name`, built on first use."""
    return export_all([(name, task)])[0]


def merge(decoder: Path, decoder_with_past: Path, out: Path) -> Path:
    """Optimum's own `merge_decoders` (run in its environment): the legacy merged decoder,
    `decoder` in the If's else_branch and `decoder_with_past` in its then_branch, picked by
    the input `use_cache_branch`. Written whole or not at all."""
    tmp = out.with_name(f".{out.name}.tmp")
    script = ("import sys; from optimum.onnx.graph_transformations import merge_decoders; "
              "merge_decoders(sys.argv[1], sys.argv[2], save_path=sys.argv[3])")
    done = subprocess.run([str(ensure_venv()), "-P", "-c", script, str(decoder),
                           str(decoder_with_past), str(tmp)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"optimum could not merge {decoder_with_past}: {done.stderr[-3000:]}")
    os.replace(tmp, out)
    return out


def merged(name: str) -> Path:
    """The legacy merged decoder of family `name` (`decoder_model_merged.onnx`), its
    with-past export in both branches: optimum-onnx 0.1 no longer exports the past-less
    decoder with present outputs that the legacy exporter merged in. Cached beside that
    export."""
    kv = cached(name)
    out = kv.with_name("decoder_model_merged.onnx")
    build_once(out, out.exists, lambda: merge(kv, kv, out))
    return out


def quantize(export: Path, out: Path, per_channel: bool) -> Path:
    """Optimum's own dynamic quantization (ORTQuantizer, `AutoQuantizationConfig.avx512_vnni`,
    what `optimum-cli onnxruntime quantize --avx512_vnni [--per_channel]` runs) of `export`,
    in its environment: MatMulInteger for every MatMul, attention's activation MatMuls too,
    and the embedding's Gather. Written whole or not at all."""
    script = ("import sys, pathlib, shutil; from optimum.onnxruntime import ORTQuantizer; "
              "from optimum.onnxruntime.configuration import AutoQuantizationConfig; "
              "src, tmp = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]); "
              "q = ORTQuantizer.from_pretrained(src.parent, file_name=src.name); "
              "q.quantize(save_dir=tmp, quantization_config=AutoQuantizationConfig.avx512_vnni("
              "is_static=False, per_channel=sys.argv[3] == '1'))")
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".quantize-") as tmp:
        done = subprocess.run([str(ensure_venv()), "-P", "-c", script, str(export), tmp,
                               "1" if per_channel else "0"], capture_output=True, text=True)
        made = Path(tmp) / "model_quantized.onnx"
        if done.returncode != 0 or not made.is_file():
            raise RuntimeError(f"optimum could not quantize {export}: {done.stderr[-3000:]}")
        os.replace(made, out)
    return out


def quantized(name: str, per_channel: bool = False) -> Path:
    """Family `name`'s with-past export quantized by Optimum (`quantize`), cached beside it."""
    kv = cached(name)
    out = kv.with_name(f"model_quantized{'_per_channel' if per_channel else ''}.onnx")
    build_once(out, out.exists, lambda: quantize(kv, out, per_channel))
    return out


def seq2seq_greedy(folders: list[Path], new_tokens: int = 12,
                   options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Each encoder-decoder export folder loaded by Optimum (ORTModelForSeq2SeqLM or
    ORTModelForSpeechSeq2Seq, in its environment) and run through its own `generate` on the
    same inputs (greedy, `new_tokens` exactly; `options`: more of generate's arguments, e.g.
    num_beams): per folder the tokens, every step's scores, the graphs it found and the
    inputs (`input_*`)."""
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="optimum-generate-") as tmp:
        _GENERATOR.run([new_tokens, tmp, options or {}, [str(f) for f in folders]])
        out = []
        for i in range(len(folders)):
            with np.load(Path(tmp) / f"{i}.npz", allow_pickle=False) as data:
                out.append({k: data[k] for k in data.files})
        return out


class _Generator:
    """One Optimum process (models/_optimum_generate.py --serve) kept by this process for
    every `seq2seq_greedy`: importing Optimum, transformers and torch is ~8 s of each call,
    and a test file calls it a dozen times. Started on first use, stopped at exit; one that
    died is started again by the next call."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._log: Any = None  # its stderr, a temporary file (a pipe nobody reads would fill)
        self._lock = threading.Lock()
        atexit.register(self.stop)

    def run(self, job: list) -> None:
        with self._lock:
            proc = self._started()
            try:
                proc.stdin.write(json.dumps(job) + "\n")
                proc.stdin.flush()
                answer = proc.stdout.readline()
            except BrokenPipeError:  # it died before reading the job
                answer = ""
            if answer.strip() == "ok":
                return
            if answer.startswith("error "):
                why = json.loads(answer[len("error "):])
            else:  # it died: what it printed says why
                self._log.seek(0)
                why = f"(exit {proc.wait()}) " + self._log.read().decode(errors="replace")
        raise RuntimeError(f"optimum could not generate from {job[3]}: {why[-3000:]}")

    def _started(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._log = tempfile.TemporaryFile()
            self._proc = subprocess.Popen(
                [str(ensure_venv()), "-P", str(Path(__file__).with_name("_optimum_generate.py")),
                 "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        return self._proc

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()  # its loop ends at end of input
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()


_GENERATOR = _Generator()


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m models.optimum", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", nargs="?", help=f"one of: {', '.join(FAMILIES)}")
    p.add_argument("--task", choices=ALL_TASKS, default=TASKS[0])
    p.add_argument("-o", "--output", type=Path, help="the folder to write (model.onnx inside)")
    p.add_argument("--list", action="store_true", help="list the families and exit")
    a = p.parse_args(argv)
    if a.list or not a.name:
        for n, fam in FAMILIES.items():
            print(f"{n:12s} {json.dumps(fam.expect)}")
        return 0
    if a.name not in FAMILIES:
        print(f"error: no family {a.name!r}; known: {', '.join(FAMILIES)}", file=sys.stderr)
        return 2
    path = export_all([(a.name, a.task)], [a.output] if a.output else None)[0]
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
