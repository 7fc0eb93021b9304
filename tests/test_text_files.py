"""What real exporters write beside a decoder, served: transformers' save_pretrained puts
the chat template in chat_template.jinja (not in tokenizer_config.json), Hugging Face's
generation_config.json and onnxruntime-genai's genai_config.json name end tokens that
config.json may not (Llama 3 Instruct's <|eot_id|>; the genai builder writes no
config.json). Each is copied by optimize and honoured by the server, checked against
greedy on ONNX Runtime's logits."""

from __future__ import annotations

import json
import shutil

import pytest
from llm_support import (CHAT, CHAT_TEMPLATE, EOS_PROMPT, NO_EOS,  # noqa: F401
                         decoder_artifact, greedy, llama, openai_client, rendered_ids, start,
                         tokenizer)


@pytest.fixture(scope="module")
def artifact(llama, tmp_path_factory):
    return decoder_artifact(tmp_path_factory.mktemp("text-files"), llama)


def test_a_chat_template_saved_by_transformers_in_its_own_file_is_used(artifact, llama,
                                                                        tmp_path) -> None:
    """transformers' save_pretrained writes the template to chat_template.jinja, not into
    tokenizer_config.json: the folder it saves, optimized, serves chat as the original."""
    from transformers import PreTrainedTokenizerFast

    from tuner.jobs.optimize import _copy_text_files

    saved, out = tmp_path / "saved", tmp_path / "artifact"
    tok = PreTrainedTokenizerFast(tokenizer_file=str(artifact / "tokenizer.json"),
                                  bos_token="<s>", eos_token="<|im_end|>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(saved)
    assert "chat_template" not in json.loads((saved / "tokenizer_config.json").read_text())
    (saved / "tokenizer.json").unlink()  # it adds <s> and <|im_end|>, unknown to this vocab
    shutil.copytree(artifact, out)
    (out / "tokenizer_config.json").unlink()
    _copy_text_files(saved, out)
    prompt = rendered_ids(CHAT)
    s = start(out)
    try:
        got = openai_client(s).chat.completions.create(model=s.slot.name, messages=CHAT,
                                                       max_tokens=6, temperature=0,
                                                       extra_body=NO_EOS)
        assert got.usage.prompt_tokens == len(prompt)
        assert got.choices[0].message.content == tokenizer().decode(greedy(llama, prompt, 6)[0])
    finally:
        s.stop(5)


@pytest.mark.parametrize("files", [
    # Hugging Face's generation config (Llama 3 Instruct's <|eot_id|> is named only there)
    {"generation_config.json": lambda eos: {"eos_token_id": [3, eos]}},
    # onnxruntime-genai's builder writes no config.json, its end tokens in genai_config.json
    {"genai_config.json": lambda eos: {"model": {"eos_token_id": [eos], "type": "llama"}}},
])
def test_end_tokens_named_by_a_generation_config_stop_the_stream(artifact, llama, tmp_path,
                                                                 files) -> None:
    config = json.loads((artifact / "config.json").read_text())
    eos = config["eos_token_id"]
    out = tmp_path / "artifact"
    shutil.copytree(artifact, out)
    (out / "config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                 if k != "eos_token_id"}))
    for name, content in files.items():
        (out / name).write_text(json.dumps(content(eos)))
    k = greedy(llama, tokenizer().encode(EOS_PROMPT).ids, 16)[0].index(eos)
    s = start(out)
    try:
        assert eos in s.slot.engine.text.eos_ids
        got = openai_client(s).completions.create(model=s.slot.name, prompt=EOS_PROMPT,
                                                  max_tokens=20, temperature=0)
        assert got.choices[0].finish_reason == "stop" and got.usage.completion_tokens == k
    finally:
        s.stop(5)
