"""The model creator's sampling defaults: generation_config.json's temperature, top_p, top_k,
min_p, repetition_penalty and max_new_tokens apply where an OpenAI-compatible request names
none, as vLLM's OpenAI server applies them (`tuner serve --generation-config auto`, the
default), and not with `--generation-config none`. Driven by the real `openai` client."""

from __future__ import annotations

import json

import pytest
from llm_support import CHAT, NO_EOS, PROMPT, decoder_artifact, llama, openai_client  # noqa: F401

from serving.server import Server, ServerOptions
from serving.text_config import load_text_config, sampling_defaults
from tuner.errors import BadInput

# Qwen2.5-7B-Instruct's generation_config.json (its end ids left out: not in this vocabulary)
QWEN = {"bos_token_id": 1, "do_sample": True, "repetition_penalty": 1.05, "temperature": 0.7,
        "top_p": 0.8, "top_k": 20, "transformers_version": "4.37.0"}
# Llama-3.1-8B-Instruct's, its end ids left out
LLAMA = {"bos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.9,
         "transformers_version": "4.42.3"}
EXPLICIT = dict(temperature=0.7, top_p=0.8, extra_body={"top_k": 20, "repetition_penalty": 1.05,
                                                        **NO_EOS})
# the APIs' own defaults, named (vLLM's top_k -1: no cut)
NEUTRAL = dict(temperature=1.0, top_p=1.0, extra_body={"top_k": -1, "repetition_penalty": 1.0,
                                                       **NO_EOS})


def test_the_settings_read_are_those_that_differ_from_transformers_defaults(tmp_path) -> None:
    """As vLLM reads the file (its difference from transformers' GenerationConfig): a value
    equal to transformers' default (top_k 50, temperature 1) is no setting, max_new_tokens is
    the default length, and a value of the wrong type or out of range is skipped."""
    assert sampling_defaults(QWEN) == (("temperature", 0.7), ("top_p", 0.8), ("top_k", 20),
                                       ("repetition_penalty", 1.05))
    assert sampling_defaults(LLAMA) == (("temperature", 0.6), ("top_p", 0.9))
    assert sampling_defaults({"temperature": 1.0, "top_k": 50, "top_p": 1, "min_p": 0.05,
                              "max_new_tokens": 300}) == (("min_p", 0.05),
                                                          ("max_new_tokens", 300))
    assert sampling_defaults({"temperature": True, "top_p": 0, "top_k": 2.5, "min_p": 1.5,
                              "repetition_penalty": "1.1", "max_new_tokens": 0,
                              "do_sample": True}) == ()
    assert sampling_defaults({"temperature": float("nan"), "top_k": float("inf")}) == ()
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN))
    assert load_text_config(tmp_path).sampling == sampling_defaults(QWEN)
    (tmp_path / "generation_config.json").write_text("{not json")
    assert load_text_config(tmp_path).sampling == ()
    with pytest.raises(BadInput, match="'auto' or 'none', not 'vllm'"):
        ServerOptions(generation_config="vllm")


@pytest.fixture(scope="module")
def artifact(llama, tmp_path_factory):
    out = decoder_artifact(tmp_path_factory.mktemp("generation-config"), llama)
    (out / "generation_config.json").write_text(json.dumps({**QWEN, "max_new_tokens": 12}))
    return out


def _start(out, generation_config: str) -> tuple[Server, list[str]]:
    said: list[str] = []
    server = Server(out, ServerOptions(port=None, http_port=0, metrics_port=None,
                                       generation_config=generation_config), say=said.append)
    server.start()
    assert server.wait_ready(120), server.slot.status
    return server, said


@pytest.fixture(scope="module")
def served(artifact):
    server, said = _start(artifact, "auto")
    yield server, said
    server.stop(5)


def test_a_request_that_names_no_setting_samples_with_the_models(served) -> None:
    """Chat without temperature, top_p, top_k, repetition_penalty or max_tokens samples as
    a request naming generation_config.json's values does (the same seed, the same tokens),
    and as many tokens as its max_new_tokens; naming the APIs' own defaults instead samples
    otherwise. A request's own values win, max_tokens included (above max_new_tokens)."""
    server, said = served
    c, name = openai_client(server), server.slot.name
    plain = c.chat.completions.create(model=name, messages=CHAT, seed=5, extra_body=NO_EOS)
    named = c.chat.completions.create(model=name, messages=CHAT, seed=5, max_tokens=12,
                                      **EXPLICIT)
    assert plain.choices[0].message.content == named.choices[0].message.content
    assert plain.usage.completion_tokens == 12
    neutral = c.chat.completions.create(model=name, messages=CHAT, seed=5, max_tokens=12,
                                        **NEUTRAL)
    assert neutral.choices[0].message.content != plain.choices[0].message.content
    longer = c.chat.completions.create(model=name, messages=CHAT, seed=5, max_tokens=20,
                                       extra_body=NO_EOS)
    assert longer.usage.completion_tokens == 20
    # completions keep OpenAI's 16 by default, within max_new_tokens 12
    text = c.completions.create(model=name, prompt=PROMPT, seed=5, extra_body=NO_EOS)
    assert text.usage.completion_tokens == 12
    assert text.choices[0].text == c.completions.create(
        model=name, prompt=PROMPT, seed=5, max_tokens=12, **EXPLICIT).choices[0].text
    # the Responses API reports what it samples with; a beam search reads none of them
    response = c.responses.create(model=name, input="Name a fox.", max_output_tokens=4)
    assert (response.temperature, response.top_p) == (0.7, 0.8)
    beams = c.completions.create(model=name, prompt=PROMPT, max_tokens=4, n=2,
                                 extra_body={"use_beam_search": True})
    assert len(beams.choices) == 2
    assert any("generation_config.json's temperature 0.7, top_p 0.8, top_k 20, "
               "repetition_penalty 1.05, max_new_tokens 12" in line for line in said), said


def test_generation_config_none_keeps_the_apis_own_defaults(artifact) -> None:
    """`--generation-config none`: the same request samples as one naming temperature 1,
    no cut and no penalty, and runs as long as the cache allows (not max_new_tokens)."""
    server, said = _start(artifact, "none")
    try:
        c, name = openai_client(server), server.slot.name
        plain = c.chat.completions.create(model=name, messages=CHAT, seed=5, max_tokens=12,
                                          extra_body=NO_EOS)
        neutral = c.chat.completions.create(model=name, messages=CHAT, seed=5, max_tokens=12,
                                            **NEUTRAL)
        assert plain.choices[0].message.content == neutral.choices[0].message.content
        assert c.completions.create(model=name, prompt=PROMPT, extra_body=NO_EOS
                                    ).usage.completion_tokens == 16
        assert any("not applied (--generation-config none)" in line for line in said), said
    finally:
        server.stop(5)
