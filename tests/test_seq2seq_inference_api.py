"""huggingface_hub's InferenceClient.summarization and .translation on an encoder-decoder
(Optimum's Marian and BART folders): they send the same `POST /` body as .text_generation
and read the keys of transformers' pipelines (Hugging Face's Inference API), which the answer
carries beside TGI's `generated_text` (they read None before); their parameters
(generate_parameters, truncation) act as the pipelines' do, and src_lang / tgt_lang are
refused."""

from __future__ import annotations

import pytest
import requests
from llm_support import start

from models import optimum

SOURCE = "w5 w6 w7 w8 w9 hello there"


@pytest.fixture(scope="module")
def servers():
    """A server for Marian (whose random weights answer with tokens) and one for BART."""
    made = {}
    try:
        for family in ("marian", "bart"):
            [model] = optimum.export_all([(family, optimum.FAMILIES[family].tasks[0])])
            made[family] = start(model.parent, model_name=family)
        yield made
    finally:
        for s in made.values():
            s.stop(0)


def _client(server, monkeypatch):
    from huggingface_hub import InferenceClient, constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the suite's offline mode
    return InferenceClient(model=f"http://127.0.0.1:{server.http_port}", timeout=60)


def _generated(server, text: str, **parameters) -> str:
    r = requests.post(f"http://127.0.0.1:{server.http_port}/generate", timeout=60,
                      json={"inputs": text, "parameters": parameters})
    assert r.status_code == 200, r.text
    return r.json()["generated_text"]


def test_summary_and_translation_are_the_generated_text(servers, monkeypatch) -> None:
    marian = servers["marian"]
    client = _client(marian, monkeypatch)
    want = _generated(marian, SOURCE)
    assert want  # (not an empty answer: the comparison compares something)
    assert client.summarization(SOURCE).summary_text == want
    assert client.translation(SOURCE).translation_text == want
    assert client.text_generation(SOURCE, max_new_tokens=100) == want
    short = client.summarization(SOURCE, generate_parameters={"max_new_tokens": 3})
    assert short.summary_text == _generated(marian, SOURCE, max_new_tokens=3) != want


def test_truncation_cuts_the_source_as_transformers_does(servers, monkeypatch) -> None:
    from huggingface_hub.errors import HfHubHTTPError

    bart = servers["bart"]
    client = _client(bart, monkeypatch)
    limit = bart.slot.engine.generator.max_prompt
    long = "w5 " * (limit + 20)
    with pytest.raises(HfHubHTTPError, match="422"):
        client.summarization(long)  # longer than the encoder reads, and not cut
    ids = bart.slot.engine.tokenizer.encode(long).ids
    kept = bart.slot.engine.tokenizer.decode(ids[:limit - 1] + ids[-1:])  # the end token kept
    asked = {"max_new_tokens": 4, "ignore_eos": True}
    got = client.summarization(long, truncation="longest_first", generate_parameters=asked)
    assert got.summary_text == _generated(bart, kept, **asked)
    assert len(bart.slot.engine.tokenizer.encode(kept).ids) == limit


@pytest.mark.parametrize("call, kwargs, says", [
    ("translation", {"src_lang": "en", "tgt_lang": "fr"}, "'src_lang' is not supported"),
    ("summarization", {"generate_parameters": {"num_beams": 4}}, "['num_beams'] are not"),
    ("summarization", {"truncation": "sideways"}, "'truncation' must be one of"),
])
def test_what_is_not_served_is_refused(servers, monkeypatch, call, kwargs, says) -> None:
    from huggingface_hub.errors import HfHubHTTPError

    with pytest.raises(HfHubHTTPError) as e:
        getattr(_client(servers["marian"], monkeypatch), call)(SOURCE, **kwargs)
    assert e.value.response.status_code == 422 and says in e.value.response.json()["error"]
