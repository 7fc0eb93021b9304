"""A prompt past the model's context, or one with max_tokens past it, as each API's own
server words it: clients tell a context overflow from any other bad request by those words
(LiteLLM raises ContextWindowExceededError, which its Router's context-window fallbacks
catch; LangChain reads OpenAI's `context_length_exceeded`). Driven by the real openai,
anthropic, huggingface_hub and litellm clients, on a decoder and on an encoder-decoder's source;
gRPC keeps the server's own message."""

from __future__ import annotations

import os

import pytest
from llm_support import POSITIONS, openai_client, start, tokenizer
from llm_support import decoder as server  # noqa: F401 - a fixture
from llm_support import llama  # noqa: F401 - a fixture

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import

LONG = "word " * 400  # past the 256 positions


def _near_the_end(tokens: int = 200) -> str:
    """A text of ~`tokens` tokens: in a chat (its template adds ~45) or alone at 220, with
    the server's 64 new tokens, past the 256 positions, but not alone."""
    words = ["word"]
    while len(tokenizer().encode(" ".join(words)).ids) < tokens:
        words.append("word")
    return " ".join(words)


def test_openai_context_length_exceeded(server) -> None:
    import openai

    client = openai_client(server)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.slot.name, prompt=LONG, max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    assert (f"This model's maximum context length is {POSITIONS} tokens. However, your "
            "prompt has 1201 tokens") in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.slot.name, max_tokens=64,
                                       messages=[{"role": "user", "content": _near_the_end()}])
    assert e.value.code == "context_length_exceeded"
    assert ", 64 in the completion)" in e.value.message


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_litellm_raises_context_window_exceeded(server, provider) -> None:
    import litellm

    base = f"http://127.0.0.1:{server.http_port}" + ("/v1" if provider == "openai" else "")
    for messages, max_tokens in (([{"role": "user", "content": LONG}], 4),
                                 ([{"role": "user", "content": _near_the_end()}], 64)):
        with pytest.raises(litellm.ContextWindowExceededError):
            litellm.completion(model=f"{provider}/{server.slot.name}", messages=messages,
                               max_tokens=max_tokens, api_base=base, api_key="x",
                               num_retries=0)


def test_anthropic_and_tgi_words(server, monkeypatch) -> None:
    import anthropic
    from huggingface_hub import InferenceClient, constants
    from huggingface_hub.errors import ValidationError

    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.http_port}",
                                 api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match=r"^.*prompt is too long: \d+ tokens"):
        client.messages.create(model=server.slot.name, max_tokens=4,
                               messages=[{"role": "user", "content": LONG}])
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the suite's offline mode
    tgi = InferenceClient(model=f"http://127.0.0.1:{server.http_port}", timeout=60)
    with pytest.raises(ValidationError, match=rf"`inputs` tokens \+ `max_new_tokens` must be "
                                              rf"<= {POSITIONS}\. Given: \d+ `inputs` tokens"):
        tgi.text_generation(_near_the_end(220), max_new_tokens=64)


def test_an_encoder_decoders_source_past_its_encoder() -> None:
    import openai

    from models import optimum

    [model] = optimum.export_all([("bart", optimum.FAMILIES["bart"].tasks[0])])
    s = start(model.parent, model_name="bart")
    try:
        too_long = s.slot.engine.generator.max_prompt + 1  # a word a token
        with pytest.raises(openai.BadRequestError, match="This model's maximum context") as e:
            openai_client(s).completions.create(model="bart", prompt="w5 " * too_long,
                                                max_tokens=2)
        assert e.value.code == "context_length_exceeded"
        import ollama  # Ollama's API cuts it instead, as Ollama: to the encoder's length

        cut = ollama.Client(host=f"http://127.0.0.1:{s.http_port}", timeout=60).generate(
            model="bart", prompt="w5 " * too_long, options={"num_predict": 2})
        assert cut.done and cut.prompt_eval_count == too_long - 1
    finally:
        s.stop(0)
