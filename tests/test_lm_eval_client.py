"""lm-evaluation-harness, unmodified, scoring the served decoder through the OpenAI completions
API (its `local-completions` model, as `lm_eval --model local-completions` drives it): the
log-likelihood of each continuation (prompts echoed with their log-probs, two prompts a
request) equal to ONNX Runtime's own, with its greedy flag, and greedy generation until a
stop string equal to ONNX Runtime's greedy text."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from llm_support import (PROMPT, decoder_artifact, greedy, llama, log_softmax,  # noqa: F401
                         logits_of, start)

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is a test dependency "
                              "(pip install -e '.[test]')")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: E402

PAIRS = [("The quick brown fox", " jumps over the lazy dog"), ("Café, naïve", " and so on"),
         (PROMPT, " the")]


@pytest.fixture(scope="module")
def served(llama, tmp_path_factory):
    artifact = decoder_artifact(tmp_path_factory.mktemp("lm-eval"), llama)
    server = start(artifact, generate={"max_streams": 4, "max_tokens": 64})
    # the tokenizer folder a Hugging Face model comes with (lm-eval loads it with
    # transformers' AutoTokenizer to count the context's tokens)
    hf = tmp_path_factory.mktemp("tokenizer")
    shutil.copy(artifact / "tokenizer.json", hf / "tokenizer.json")
    (hf / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}))
    yield server, hf
    server.stop(5)


def _lm(server, hf) -> LocalCompletionsAPI:
    return LocalCompletionsAPI(model=server.slot.name, tokenizer=str(hf),
                               base_url=f"http://127.0.0.1:{server.http_port}/v1/completions",
                               tokenizer_backend="huggingface", batch_size=2, max_length=256,
                               max_retries=1)


def test_loglikelihoods_are_the_models_own(served, llama) -> None:
    server, hf = served
    lm = _lm(server, hf)
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)]
    got = lm.loglikelihood(requests)
    assert len(got) == len(PAIRS)
    greedy_seen = set()
    for (context, continuation), (logprob, is_greedy) in zip(PAIRS, got):
        ctx = lm.tok_encode(context)
        whole = lm.tok_encode(context + continuation)
        lp = log_softmax(logits_of(llama, whole))  # (S, V)
        cont = range(len(ctx), len(whole))
        assert logprob == pytest.approx(sum(lp[j - 1, whole[j]] for j in cont), abs=1e-3)
        assert is_greedy == all(int(np.argmax(lp[j - 1])) == whole[j] for j in cont)
        greedy_seen.add(is_greedy)
    # a continuation made of the model's own greedy tokens is greedy
    ids = lm.tok_encode(PROMPT)
    new, _ = greedy(llama, ids, 4)
    [(_, own)] = lm._loglikelihood_tokens([((PROMPT, "?"), ids, new)])
    assert own is True and False in greedy_seen


def test_generate_until_is_the_greedy_text(served, llama) -> None:
    server, hf = served
    lm = _lm(server, hf)
    ids = lm.tok_encode(PROMPT)
    new, _ = greedy(llama, ids, 8)
    text = lm.tokenizer.decode(new)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    requests = [Instance("generate_until", {}, (PROMPT, {"until": ["\n\n\n"], "max_gen_toks": 8,
                                                         "do_sample": False}), 0),
                Instance("generate_until", {}, (PROMPT, {"until": [stop], "max_gen_toks": 8,
                                                         "do_sample": False}), 1)]
    whole, cut = lm.generate_until(requests)
    assert whole == text and cut == text[:text.index(stop)]
