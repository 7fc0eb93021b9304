"""vLLM's chat options on /v1/chat/completions and /tokenize: `chat_template_kwargs` (the
variables templates read, as Qwen 3's `enable_thinking`), `documents` (retrieval
templates), `continue_final_message` (the model goes on writing the last assistant
message: prefill a reply). Each prompt equals what transformers' `apply_chat_template`
renders with the same arguments; the served prompt is that prompt's tokens."""

from __future__ import annotations

import json

import pytest
from llm_support import (decoder_artifact, llama, openai_client, rendered,  # noqa: F401
                         start, tokenizer)

# a template with the features real ones use: a thinking switch (Qwen 3 writes an empty
# think block when thinking is off), documents, and the generation prompt
TEMPLATE = (
    "{% if documents %}<|im_start|>system\nDocs:{% for d in documents %} [{{ d.title }}] "
    "{{ d.text }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}")
MESSAGES = [{"role": "user", "content": "Name a fox."}]
REPLY = MESSAGES + [{"role": "assistant", "content": "The fox is "}]
DOCS = [{"title": "Foxes", "text": "Red foxes are common."}]


CASES = [
    ({}, {"add_generation_prompt": True}),
    ({"chat_template_kwargs": {"enable_thinking": False}},
     {"add_generation_prompt": True, "enable_thinking": False}),
    ({"documents": DOCS}, {"add_generation_prompt": True, "documents": DOCS}),
    ({"messages": REPLY, "add_generation_prompt": False, "continue_final_message": True},
     {"continue_final_message": True, "add_generation_prompt": False}),
]


@pytest.mark.parametrize("body, kwargs", CASES)
def test_the_prompt_is_what_transformers_renders(body, kwargs) -> None:
    from serving.http.chat import chat_prompt
    from serving.text_config import TextConfig

    text = TextConfig(chat_template=TEMPLATE, bos_token="<s>", eos_token="<|im_end|>")
    messages = body.get("messages", MESSAGES)
    assert chat_prompt(text, {"messages": MESSAGES, **body}) == rendered(messages, TEMPLATE, **kwargs)


@pytest.fixture(scope="module")
def server(llama, tmp_path_factory):
    out = decoder_artifact(tmp_path_factory.mktemp("chat-options"), llama)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    s = start(out)
    yield s
    s.stop(5)


@pytest.mark.parametrize("body, kwargs", CASES[1:])
def test_the_served_prompt_is_those_tokens(server, body, kwargs) -> None:
    import requests

    want = tokenizer().encode(rendered(body.get("messages", MESSAGES), TEMPLATE, **kwargs),
                              add_special_tokens=False).ids
    got = openai_client(server).chat.completions.create(
        model=server.slot.name, messages=body.get("messages", MESSAGES), max_tokens=1,
        extra_body={k: v for k, v in body.items() if k != "messages"})
    assert got.usage.prompt_tokens == len(want)
    tokens = requests.post(f"http://127.0.0.1:{server.http_port}/tokenize",
                           json={"messages": MESSAGES, **body}, timeout=30).json()["tokens"]
    assert tokens == want


@pytest.mark.parametrize("body, says", [
    ({"continue_final_message": True}, "send 'add_generation_prompt': false"),
    ({"continue_final_message": True, "add_generation_prompt": False},
     "needs an assistant message last"),
    ({"chat_template_kwargs": {"messages": []}}, "keys are none of"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "must be an object"),
    ({"documents": "Foxes"}, "'documents' must be a list of objects"),
])
def test_what_cannot_be_rendered_is_400(server, body, says) -> None:
    import openai

    with pytest.raises(openai.BadRequestError, match=says):
        openai_client(server).chat.completions.create(model=server.slot.name,
                                                      messages=MESSAGES, max_tokens=1,
                                                      extra_body=body)
