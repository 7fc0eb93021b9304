"""lm-evaluation-harness, unmodified, scoring the served decoder through the OpenAI completions
API (its `local-completions` model, as `lm_eval --model local-completions` drives it), with a
Hugging Face tokenizer folder or with the server's own tokenizer (its `remote` backend:
vLLM's /tokenize, /detokenize and /tokenizer_info): the log-likelihood of each continuation
(prompts echoed with their log-probs, two prompts a request) equal to ONNX Runtime's own, with
its greedy flag, and greedy generation until a stop string equal to ONNX Runtime's greedy
text."""

from __future__ import annotations

import numpy as np
import pytest
import requests
from llm_support import (CHAT_TEMPLATE, PROMPT, decoder_artifact, greedy,  # noqa: F401
                         hf_tokenizer_folder, llama, log_softmax, logits_of, start,
                         tokenizer)

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
    hf = hf_tokenizer_folder(artifact, tmp_path_factory.mktemp("tokenizer"))
    yield server, hf
    server.stop(5)


def _lm(server, hf, backend: str = "huggingface") -> LocalCompletionsAPI:
    return LocalCompletionsAPI(model=server.slot.name,
                               tokenizer=str(hf) if backend == "huggingface" else None,
                               base_url=f"http://127.0.0.1:{server.http_port}/v1/completions",
                               tokenizer_backend=backend, batch_size=2, max_length=256,
                               max_retries=1)


@pytest.mark.parametrize("backend", ["huggingface", "remote"])
def test_loglikelihoods_are_the_models_own(served, llama, backend) -> None:
    server, hf = served
    lm = _lm(server, hf, backend)
    assert lm.tok_encode(PROMPT) == tokenizer().encode(PROMPT, add_special_tokens=False).ids
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


@pytest.mark.parametrize("backend", ["huggingface", "remote"])
def test_generate_until_is_the_greedy_text(served, llama, backend) -> None:
    server, hf = served
    lm = _lm(server, hf, backend)
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


def test_the_tokenizer_endpoints_answer_as_vllms(served) -> None:
    """What other clients of vLLM's tokenizer endpoints send: a prompt with and without the
    special tokens and its token strings, chat messages through the template, ids back to
    text, and errors as OpenAI error objects."""
    server, _ = served
    url, name = f"http://127.0.0.1:{server.http_port}", server.slot.name
    got = requests.post(f"{url}/tokenize", json={"model": name, "prompt": PROMPT,
                                                 "return_token_strs": True}, timeout=30).json()
    ids = tokenizer().encode(PROMPT).ids
    assert got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] == 256
    assert got["token_strs"] == [tokenizer().decode([t]) for t in ids]
    chat = requests.post(f"{url}/tokenize", json={"messages": [
        {"role": "user", "content": "Hi"}]}, timeout=30).json()
    assert chat["tokens"] == tokenizer().encode(
        "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False).ids
    back = requests.post(f"{url}/detokenize", json={"tokens": ids}, timeout=30).json()
    assert back == {"prompt": tokenizer().decode(ids)}
    info = requests.get(f"{url}/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == "<|im_end|>" and info["chat_template"] == CHAT_TEMPLATE
    bad = requests.post(f"{url}/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert bad.status_code == 400 and "'tokens' must be a list" in bad.json()["error"]["message"]
    other = requests.post(f"{url}/tokenize", json={"model": "gpt-4", "prompt": "x"}, timeout=30)
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
