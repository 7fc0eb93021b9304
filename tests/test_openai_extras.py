"""What vLLM's clients send beyond OpenAI's own parameters, and what its usage adds, on the
OpenAI-compatible API with the real `openai` client: `stop_token_ids`, `bad_words` and
`min_p` honoured (against ONNX Runtime's logits of the same prompt; `min_p` also in the vLLM
backend's `sampling_parameters`), `allowed_token_ids` and `include_stop_str_in_output`
(both also in `sampling_parameters`), and the prompt tokens read from the prefix cache in every
API's usage."""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest
from llm_support import (NO_EOS, PROMPT, decoder, greedy, llama,  # noqa: F401
                         logits_of, openai_client, rendered, tokenizer)


def _want(llama, prompt: str, n: int) -> tuple[list[int], str]:
    ids, _ = greedy(llama, tokenizer().encode(prompt).ids, n)
    return ids, tokenizer().decode(ids)


def test_vllms_stop_token_ids_bad_words_and_min_p_are_honoured(decoder, llama) -> None:
    """vLLM's sampling extras: `stop_token_ids` end the choice before that token (also with
    ignore_eos), a `bad_words` word is never written (ONNX Runtime's logits without its
    token are the reference), and `min_p` 1 at temperature 1 leaves only the likeliest
    token: greedy's text (temperature 1 alone samples another)."""
    c, name = openai_client(decoder), decoder.slot.name
    ids, text = _want(llama, PROMPT, 8)
    k = next(i for i in range(2, 8) if ids[i] not in ids[:i])
    got = c.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0,
                               extra_body={"stop_token_ids": [ids[k]], **NO_EOS})
    assert (got.choices[0].finish_reason, got.usage.completion_tokens) == ("stop", k)
    assert got.choices[0].text == tokenizer().decode(ids[:k])
    # a word greedy writes at step i that is one token both alone and after a space: both
    # are banned at every step (vLLM's rule), so greedy changes first at step i
    encode = lambda text: tokenizer().encode(text).ids  # noqa: E731
    i, word = next((i, w) for i, w in ((i, tokenizer().decode([ids[i]]).strip())
                                       for i in range(8))
                   if len(encode(w)) == len(encode(" " + w)) == 1
                   and ids[i] in encode(w) + encode(" " + w)
                   and not set(ids[:i]) & set(encode(w) + encode(" " + w)))
    row = logits_of(llama, tokenizer().encode(PROMPT).ids + ids[:i])[-1].copy()
    row[encode(word) + encode(" " + word)] = -np.inf
    got = c.completions.create(model=name, prompt=PROMPT, max_tokens=i + 1, temperature=0,
                               extra_body={"bad_words": [word], **NO_EOS})
    assert got.choices[0].text == tokenizer().decode(ids[:i] + [int(np.argmax(row))])
    sampled = dict(model=name, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5,
                   extra_body=NO_EOS)
    assert c.completions.create(**sampled).choices[0].text != text
    assert c.completions.create(**sampled | {"extra_body": {"min_p": 1.0, **NO_EOS}}
                                ).choices[0].text == text


def test_vllms_allowed_token_ids_and_include_stop_str_in_output(decoder, llama) -> None:
    """`allowed_token_ids` leaves greedy only those ids: at each step the likeliest of them
    under ONNX Runtime's logits (the first step's likeliest left out, so the answer differs
    from plain greedy); `include_stop_str_in_output` keeps the matched stop string at the
    end of the text, whole and streamed (without it the text ends before it)."""
    c, name = openai_client(decoder), decoder.slot.name
    ids, text = _want(llama, PROMPT, 8)
    prompt = tokenizer().encode(PROMPT).ids
    row = logits_of(llama, prompt)[-1]
    allowed = [int(t) for t in np.argsort(-row)[1:6]]  # the 2nd..6th likeliest first tokens
    want = []
    for _ in range(4):
        step = logits_of(llama, prompt + want)[-1]
        want.append(max(allowed, key=lambda t: step[t]))
    got = c.completions.create(model=name, prompt=PROMPT, max_tokens=4, temperature=0,
                               extra_body={"allowed_token_ids": allowed, **NO_EOS})
    assert got.choices[0].text == tokenizer().decode(want) != tokenizer().decode(ids[:4])
    with pytest.raises(openai.BadRequestError, match="'allowed_token_ids' must not be empty"):
        c.completions.create(model=name, prompt=PROMPT, extra_body={"allowed_token_ids": []})
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids' must be a list of "
                                                     "token ids"):
        c.completions.create(model=name, prompt=PROMPT,
                             extra_body={"allowed_token_ids": [10**9]})
    stop = text[len(tokenizer().decode(ids[:3])):][:3]  # text that starts after token 3
    assert stop.strip() and text.find(stop) > 0
    cut = text[:text.find(stop)]
    ask = dict(model=name, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop])
    assert c.completions.create(**ask, extra_body=NO_EOS).choices[0].text == cut
    kept = {"include_stop_str_in_output": True, **NO_EOS}
    whole = c.completions.create(**ask, extra_body=kept).choices[0]
    assert (whole.text, whole.finish_reason) == (cut + stop, "stop")
    streamed = c.completions.create(**ask, extra_body=kept, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == cut + stop


def test_usage_counts_the_prompt_tokens_read_from_the_prefix_cache(decoder) -> None:
    """A prompt sent again finds its whole 16-token blocks (all but the last token's) in the
    prefix cache: prompt_tokens_details.cached_tokens, whole and streamed, on chat and
    completions (each prompt counted once, whatever `n`), and on the Responses API."""
    c, name = openai_client(decoder), decoder.slot.name
    chat = [{"role": "user", "content": "Count the foxes in the usage, please."}]
    total = len(tokenizer().encode(rendered(chat), add_special_tokens=False).ids)
    ask = dict(model=name, messages=chat, max_tokens=2, temperature=0)
    first = c.chat.completions.create(**ask).usage.prompt_tokens_details.cached_tokens
    hit = (total - 1) // 16 * 16  # (the first's first block may be an earlier prompt's)
    assert first < hit
    assert c.chat.completions.create(**ask, n=2).usage.prompt_tokens_details.cached_tokens == hit
    streamed = list(c.chat.completions.create(**ask, stream=True,
                                              stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == hit
    prompt = "Foxes are counted in the usage of completions, twice over."
    long = len(tokenizer().encode(prompt).ids)
    assert long > 16
    cached = [c.completions.create(model=name, prompt=prompt, max_tokens=2, temperature=0
                                   ).usage.prompt_tokens_details.cached_tokens for _ in "ab"]
    assert cached[0] < cached[1] == (long - 1) // 16 * 16
    response = c.responses.create(model=name, input=chat, max_output_tokens=2, temperature=0)
    assert response.usage.input_tokens_details.cached_tokens == hit


def test_the_vllm_backends_sampling_parameters_take_min_p() -> None:
    """Triton's vLLM-backend convention reads min_p as the OpenAI API does (the engine's
    honouring of it is the test above)."""
    from serving.conventions import parse_request

    tensors = {"input_ids": np.array([[1, 2, 3]], np.int64), "sampling_parameters": np.array(
        [json.dumps({"temperature": "1.0", "min_p": "0.5"}).encode()], object)}
    assert parse_request(tensors, {}).generation.sampling.min_p == 0.5


def test_the_vllm_backends_sampling_parameters_take_allowed_ids_and_include_stop() -> None:
    from serving.conventions import parse_request
    from serving.errors import InvalidArgument

    def parsed(params: dict):
        tensors = {"input_ids": np.array([[1, 2, 3]], np.int64), "sampling_parameters":
                   np.array([json.dumps(params).encode()], object)}
        return parse_request(tensors, {}).generation

    got = parsed({"allowed_token_ids": [7, 3, 7], "include_stop_str_in_output": "true"})
    assert (got.sampling.allowed_ids, got.include_stop) == ((3, 7), True)
    assert (parsed({}).sampling.allowed_ids, parsed({}).include_stop) == ((), False)
    with pytest.raises(InvalidArgument, match="'allowed_token_ids' must not be empty"):
        parsed({"allowed_token_ids": []})
    with pytest.raises(InvalidArgument, match="'allowed_token_ids' must be a list"):
        parsed({"allowed_token_ids": 3})
