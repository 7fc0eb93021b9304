"""OpenAI's choices beyond `n` samples, driven by the real `openai` client against a decoder
artifact: vLLM's `use_beam_search` (one search's n best sequences, equal to transformers'
num_return_sequences on the torch model the export came from) and `best_of` (the n of
best_of candidates with the highest log-probability per token)."""

from __future__ import annotations

import openai
import pytest
from llm_support import decoder as server  # noqa: F401 - a fixture
from llm_support import CHAT, NO_EOS, PROMPT, llama, openai_client, tokenizer  # noqa: F401


def test_vllms_beam_search_answers_its_n_best_as_the_choices(server) -> None:
    """vLLM's use_beam_search with n 3: the choices are transformers' search's 3 best
    sequences (num_return_sequences 3), best first, whole and streamed (chat's too); n above
    16 beams and what a search cannot give (log-probs) are refused."""
    from test_decoder_beams import transformers_returns

    prompt = tokenizer().encode(PROMPT).ids
    want = [tokenizer().decode(ids) for ids in transformers_returns(prompt, 3, 6, returns=3)]
    assert len(set(want)) == 3
    c, name, extra = openai_client(server), server.slot.name, {"use_beam_search": True, **NO_EOS}
    got = c.completions.create(model=name, prompt=PROMPT, max_tokens=6, n=3, extra_body=extra)
    assert [(x.index, x.text, x.finish_reason) for x in got.choices] == [
        (i, text, "length") for i, text in enumerate(want)]
    assert got.usage.completion_tokens == 3 * 6
    streamed = ["", "", ""]
    for chunk in c.completions.create(model=name, prompt=PROMPT, max_tokens=6, n=3,
                                      stream=True, extra_body=extra):
        for x in chunk.choices:
            streamed[x.index] += x.text
    assert streamed == want
    chat = c.chat.completions.create(model=name, messages=CHAT, max_tokens=4, n=2,
                                     extra_body=extra)
    assert [x.index for x in chat.choices] == [0, 1]
    assert chat.choices[0].message.content != chat.choices[1].message.content
    with pytest.raises(openai.BadRequestError, match="beam search \\(3 beams\\) is greedy"):
        c.completions.create(model=name, prompt=PROMPT, max_tokens=6, n=3, logprobs=1,
                             extra_body=extra)
    with pytest.raises(openai.BadRequestError, match="beam width .* 1 to 16, not 17"):
        c.completions.create(model=name, prompt=PROMPT, n=17, extra_body=extra)


def test_best_of_returns_the_candidates_most_likely_per_token(server) -> None:
    """best_of 4, n 2: of the 4 candidates (sampled as n 4 samples them: seed, seed + 1, ...)
    the 2 with the highest log-probability per token, best first, without log-probs unless
    asked; below n, streamed, or beside a beam search it is refused."""
    c, name = openai_client(server), server.slot.name
    asked = dict(model=name, prompt=PROMPT, max_tokens=6, seed=7, temperature=1.5,
                 extra_body=NO_EOS)
    every = c.completions.create(n=4, logprobs=0, **asked).choices
    assert len({x.text for x in every}) == 4
    mean = [sum(x.logprobs.token_logprobs) / len(x.logprobs.token_logprobs) for x in every]
    best = sorted(range(4), key=lambda i: -mean[i])[:2]
    got = c.completions.create(n=2, best_of=4, **asked).choices
    assert [(x.index, x.text) for x in got] == [(0, every[best[0]].text), (1, every[best[1]].text)]
    assert got[0].logprobs is None
    for extra, message in (({"n": 2, "best_of": 1}, "at least 'n' \\(2\\), not 1"),
                           ({"best_of": 3, "stream": True}, "cannot be streamed"),
                           ({"best_of": 5}, "at most 4")):
        with pytest.raises(openai.BadRequestError, match=message):
            c.completions.create(**{**asked, **extra})
