"""Code completion with a `suffix` (serving/fill_in_middle.py), as editor plugins ask for it:
OpenAI's completions API (`suffix`, what Continue's and Tabby's OpenAI-style providers send)
and Ollama's /api/generate (`suffix`, what Continue, Twinny and llama-coder send to Ollama),
through the real openai and ollama clients. The test decoder's tokenizer is given each code
model family's fill-in-the-middle tokens (as added tokens, on the ids of its last three
merges, which it then never makes from text); the answer is ONNX Runtime's greedy over the
prompt the model card writes; a model without such tokens is refused, as Ollama refuses
it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from llm_support import decoder_artifact, greedy, llama, start  # noqa: F401
from tokenizers import Tokenizer

from serving.fill_in_middle import FORMATS

BEFORE, AFTER = "def add(x, y):\n    ", "\n    return z\n"
NEW = 8
FAMILIES = {"starcoder": FORMATS[0], "qwen-coder": FORMATS[1], "deepseek-coder": FORMATS[2]}
EXACT = {"temperature": 0, "repeat_penalty": 1, "num_predict": NEW}  # Ollama's greedy


@pytest.fixture(scope="module")
def plain(llama, tmp_path_factory) -> Path:
    return decoder_artifact(tmp_path_factory.mktemp("fim"), llama)


def _with_tokens(artifact: Path, dst: Path, tokens: tuple[str, str, str]) -> Path:
    """A copy of `artifact` whose tokenizer has `tokens` as added special tokens, on the ids
    of its last three merges (left out, so that text never makes those ids)."""
    shutil.copytree(artifact, dst)
    config = json.loads((dst / "tokenizer.json").read_text())
    merges, vocab = config["model"]["merges"], config["model"]["vocab"]
    made = {"".join(m) if isinstance(m, list) else m.replace(" ", "") for m in merges[-3:]}
    ids = sorted(vocab[t] for t in made)
    for token, i in zip(tokens, ids):
        vocab = {k: v for k, v in vocab.items() if v != i} | {token: i}
    config["model"]["merges"], config["model"]["vocab"] = merges[:-3], vocab
    config["added_tokens"] = [{"id": i, "content": t, "single_word": False, "lstrip": False,
                               "rstrip": False, "normalized": False, "special": True}
                              for t, i in zip(tokens, ids)]
    (dst / "tokenizer.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("family", FAMILIES)
def test_a_suffix_is_filled_in_the_models_format(plain, llama, tmp_path, family) -> None:
    import ollama
    import openai

    fmt = FAMILIES[family]
    folder = _with_tokens(plain, tmp_path / family, (fmt.prefix, fmt.suffix, fmt.middle))
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    # the prompt as the model cards write it: the three tokens around the two texts
    ids = tokenizer.encode(f"{fmt.prefix}{BEFORE}{fmt.suffix}{AFTER}{fmt.middle}").ids
    assert len([i for i in ids if tokenizer.id_to_token(i) in fmt.__dict__.values()]) == 3
    tokens = greedy(llama, ids, NEW)[0]
    want = tokenizer.decode(tokens)
    end = json.loads((folder / "config.json").read_text())["eos_token_id"]
    until_end = tokenizer.decode(tokens[:tokens.index(end)] if end in tokens else tokens)
    s = start(folder, generate={"max_tokens": 64})
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{s.http_port}/v1", api_key="x",
                               max_retries=0)
        asked = dict(model=s.slot.name, prompt=BEFORE, suffix=AFTER, max_tokens=NEW,
                     temperature=0, extra_body={"ignore_eos": True})
        whole = client.completions.create(**asked)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            **asked, stream=True) if c.choices)
        local = ollama.Client(host=f"http://127.0.0.1:{s.http_port}", timeout=60)
        filled = local.generate(model=s.slot.name, prompt=BEFORE, suffix=AFTER,
                                options=EXACT)
    finally:
        s.stop(5)
    assert whole.choices[0].text == streamed == want
    assert whole.usage.prompt_tokens == len(ids)
    # (Ollama has no ignore_eos: its answer ends at the end token, wherever greedy makes it)
    assert filled.response == until_end and filled.prompt_eval_count == len(ids)


def test_a_model_without_the_tokens_does_not_support_insert(plain) -> None:
    import ollama

    s = start(plain)
    try:
        local = ollama.Client(host=f"http://127.0.0.1:{s.http_port}", timeout=60)
        with pytest.raises(ollama.ResponseError) as e:
            local.generate(model=s.slot.name, prompt=BEFORE, suffix=AFTER, options=EXACT)
    finally:
        s.stop(5)
    assert e.value.status_code == 400 and e.value.error == \
        f'"{s.slot.name}" does not support insert'
