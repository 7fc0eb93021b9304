"""Parameter counts against transformers models built from the same configs (meta device:
no weights are allocated, so even 2.7B-parameter configs build in about a second)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tuner.design.params import (FAMILIES, DesignShape, Family, count_params,  # noqa: E402
                                 embedding_params, layer_params)


def hf_count(config) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.num_parameters()


def gpt2(L, h, a, f, v, positions=1024):
    cfg = transformers.GPT2Config(n_layer=L, n_embd=h, n_head=a, n_inner=f, vocab_size=v,
                                  n_positions=positions)
    fam = Family("gpt2", False, True, "layernorm", True, positions)
    return cfg, DesignShape(L, h, a, a, h // a, f, v, fam)


def neox(L, h, a, f, v):
    cfg = transformers.GPTNeoXConfig(num_hidden_layers=L, hidden_size=h, num_attention_heads=a,
                                     intermediate_size=f, vocab_size=v)
    return cfg, DesignShape(L, h, a, a, h // a, f, v, FAMILIES["gpt_neox"])


def llama(L, h, a, kv, f, v, d=None):
    d = d or h // a
    cfg = transformers.LlamaConfig(num_hidden_layers=L, hidden_size=h, num_attention_heads=a,
                                   num_key_value_heads=kv, intermediate_size=f, vocab_size=v,
                                   head_dim=d)
    return cfg, DesignShape(L, h, a, kv, d, f, v, FAMILIES["llama"])


CASES = {
    "gpt2-small": gpt2(12, 768, 12, 3072, 50257),
    "gpt2-awkward": gpt2(3, 160, 2, 600, 1003, positions=256),
    "pythia-2.8b": neox(32, 2560, 32, 10240, 50304),
    "neox-awkward": neox(2, 160, 2, 600, 1003),
    "llama-gqa-swiglu-10922": llama(4, 4096, 32, 8, 10922, 32000),
    "llama-awkward-d80": llama(2, 160, 2, 1, 426, 1003, d=80),
    "llama-head-dim-not-h-over-a": llama(2, 256, 4, 2, 688, 1000, d=96),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_count_matches_transformers(name):
    cfg, shape = CASES[name]
    expected = hf_count(cfg)
    got = count_params(shape)
    assert abs(got - expected) <= 0.001 * expected, (name, got, expected)
    assert got == expected  # exact, in fact: every tensor is accounted for


def test_tied_head_counts_once_and_untied_twice():
    _, tied = CASES["gpt2-small"]
    untied = tied.with_(family=Family("x", False, True, "layernorm", False, 1024))
    assert count_params(untied) - count_params(tied) == tied.vocab_size * tied.hidden_size
    assert embedding_params(tied) == (50257 + 1024) * 768


def test_gated_ffn_has_one_more_matrix():
    _, s = CASES["llama-gqa-swiglu-10922"]
    plain = s.with_(family=Family("plain", False, False, "rmsnorm", False))
    assert layer_params(s) - layer_params(plain) == s.hidden_size * s.ffn_size


@pytest.mark.parametrize("field,value,message", [
    ("hidden_size", 0, "hidden_size must be a positive integer"),
    ("num_layers", 2.5, "num_layers must be a positive integer"),
    ("vocab_size", True, "vocab_size must be a positive integer"),
    ("num_kv_heads", 3, "num_heads (4) must be a multiple of num_kv_heads (3)"),
])
def test_shape_validation_messages(field, value, message):
    base = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=4, head_dim=16,
                ffn_size=256, vocab_size=100)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DesignShape(**{**base, field: value})


def test_family_validation():
    with pytest.raises(ValueError, match="norm must be layernorm or rmsnorm"):
        Family("x", False, True, "batchnorm", True)
