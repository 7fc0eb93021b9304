"""LiteLLM's Triton provider (`model="triton/..."`, what LiteLLM's proxy and the apps built
on `litellm.completion` use to reach a Triton server) against a decoder artifact, unchanged:
its `/generate` route (`text_input` with `parameters` and `stream`; `_stream` for SSE) and
its `/infer` route (KServe v2 JSON, the text read from the FIRST output, as Triton's LLM
backends put `text_output` first), each against ONNX Runtime's greedy loop."""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import

import litellm  # noqa: E402
from litellm.litellm_core_utils.prompt_templates.factory import prompt_factory  # noqa: E402
from llm_support import decoder as server  # noqa: E402,F401 - a fixture
from llm_support import PROMPT, greedy, llama, tokenizer  # noqa: E402,F401

MESSAGES = [{"role": "user", "content": PROMPT}]


def _base(server, route: str) -> str:
    return f"http://127.0.0.1:{server.http_port}/v2/models/{server.slot.name}/{route}"


def _greedy_text(llama, prompt: str, n: int) -> str:
    ids, _ = greedy(llama, tokenizer().encode(prompt).ids, n)
    return tokenizer().decode(ids)


def test_generate_route_whole_and_streamed(server, llama) -> None:
    prompt = prompt_factory(model=server.slot.name, messages=MESSAGES)  # LiteLLM's own text
    want = _greedy_text(llama, prompt, 8)
    whole = litellm.completion(model=f"triton/{server.slot.name}", messages=MESSAGES,
                               max_tokens=8, api_base=_base(server, "generate"))
    # not streamed, a text prompt: the prompt first, as TensorRT-LLM's ensemble answers
    assert whole.choices[0].message.content == prompt + want
    chunks = litellm.completion(model=f"triton/{server.slot.name}", messages=MESSAGES,
                                max_tokens=8, api_base=_base(server, "generate"), stream=True)
    texts = [c.choices[0].delta.content or "" for c in chunks]
    assert "".join(texts) == want and len([t for t in texts if t]) > 1


def test_infer_route_reads_the_text_as_the_first_output(server, llama) -> None:
    want = _greedy_text(llama, PROMPT, 6)
    answer = litellm.completion(model=f"triton/{server.slot.name}", messages=MESSAGES,
                                max_tokens=6, api_base=_base(server, "infer"))
    assert answer.choices[0].message.content == want
