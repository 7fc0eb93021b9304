"""Generation from a KV-cache decoder artifact over real gRPC on loopback, driven by the real
tritonclient streaming client: greedy output token-identical to transformers' generate for
GPT-2, Llama (GQA) and GPT-NeoX; a padded variant token-identical to the original; 16
concurrent streams each identical to itself alone; cancelling; limits and their status
codes; seeded sampling; text in and out; shutdown with streams in flight.

Over 400 lines on purpose: one file per part under test, each test with the model it needs."""

from __future__ import annotations

import json
import queue
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tg
from serving_support import make_artifact, scraped_metrics, slowed
from tritonclient.utils import InferenceServerException

from serving.generation import GenerateOptions
from serving.server import Server, ServerOptions
from serving.tokenizer import IncrementalDecoder
from tuner.artifact.records import Buckets
from tuner.jobs.pad import pad_file
from tuner.rewrite.compose import PadRequest

BUCKETS = Buckets(batch=(1, 2, 4, 8, 16), seq=(16, 32, 64))
POSITIONS = 256  # max_position_embeddings of the reference specs
TEXT = ("The quick brown fox jumps over the lazy dog. Café, naïve, façade; 日本語のテキスト, "
        "emoji 🎉🚀 and Ελληνικά too. ") * 20


def _kv_model(reference_model, family: str) -> Path:
    return reference_model(f"{family}-kv", "awkward", "torchscript")


def _tokenizer(vocab: int):
    """A byte-level BPE made with the `tokenizers` library, ids inside the model's vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok


def _start(out: Path, **generate) -> Server:
    server = Server(out, ServerOptions(port=0, metrics_port=0,
                                       generate=GenerateOptions(**generate)),
                    say=lambda line: None)
    server.start()
    assert server.wait_ready(120), server.slot.status
    return server


def _artifact(tmp: Path, model: Path, tokenizer_vocab: int | None = None,
              variant: Path | None = None) -> Path:
    out = make_artifact(tmp, model, BUCKETS, variant=variant)
    (out / "config.json").write_text(json.dumps({"max_position_embeddings": POSITIONS}))
    if tokenizer_vocab:
        _tokenizer(tokenizer_vocab).save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="module")
def servers(reference_model, tmp_path_factory):
    """One server per family, each admitting 8 streams at a time (more wait in the queue).
    Llama's carries a tokenizer and pads every step to the buckets (what a GPU backend
    does); the others feed each step's present back as it is (what CPU backends do)."""
    made = {}
    for family in ("gpt2", "llama", "gpt_neox"):
        out = _artifact(tmp_path_factory.mktemp(family), _kv_model(reference_model, family),
                        tokenizer_vocab=1003 if family == "llama" else None)
        made[family] = _start(out, max_streams=8, max_queue=24, max_tokens=200,
                              pad_to="bucket" if family == "llama" else "auto")
    yield made
    for server in made.values():
        server.stop(5)


# ------------------------------------------------------------------------------ clients


class _Stream:
    """One tritonclient streaming client: `run` sends one request and collects every
    response until the one flagged triton_final_response."""

    def __init__(self, server: Server | None = None, port: int = 0, name: str = "") -> None:
        self.port = server.port if server is not None else port
        self.name = server.slot.name if server is not None else name
        self.client = tg.InferenceServerClient(f"127.0.0.1:{self.port}")
        self.responses: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put(
            (result, error)))

    def send(self, inputs: list, request_id: str = "r", **parameters) -> None:
        self.client.async_stream_infer(self.name, inputs, request_id=request_id,
                                       parameters=parameters or None)

    def collect(self, timeout: float = 60, on_token=None) -> tuple[list[int], list, dict]:
        ids, results = [], []
        while True:
            result, error = self.responses.get(timeout=timeout)
            if error is not None:
                raise error
            results.append(result)
            ids += result.as_numpy("output_ids").reshape(-1).tolist()
            params = result.get_response().parameters
            if on_token is not None:
                on_token(len(ids))
            if params["triton_final_response"].bool_param:
                return ids, results, {k: v for k, v in params.items()}

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def _inputs(prompt, max_tokens: int | None = None, **scalars) -> list:
    ids = np.array([prompt], np.int64)
    made = [tg.InferInput("input_ids", list(ids.shape), "INT64")]
    made[0].set_data_from_numpy(ids)
    kinds = {"max_tokens": ("INT32", np.int32), "temperature": ("FP32", np.float32),
             "top_k": ("INT32", np.int32), "top_p": ("FP32", np.float32),
             "seed": ("UINT64", np.uint64), "end_id": ("INT64", np.int64)}
    if max_tokens is not None:
        scalars["max_tokens"] = max_tokens
    for name, value in scalars.items():
        datatype, dtype = kinds[name]
        made.append(tg.InferInput(name, [1], datatype))
        made[-1].set_data_from_numpy(np.array([value], dtype))
    return made


def _generate(server: Server, prompt, max_tokens: int, **scalars) -> list[int]:
    stream = _Stream(server)
    try:
        stream.send(_inputs(prompt, max_tokens, **scalars))
        return stream.collect()[0]
    finally:
        stream.close()


def _prompt(length: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, length).tolist()


def _transformers_greedy(family: str, prompt: list[int], max_tokens: int) -> list[int]:
    import torch

    from models.build import build_torch_model, spec

    model = build_torch_model(spec(f"{family}-kv", "awkward"))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


# ---------------------------------------------------------------------------- exactness


VOCAB = {"gpt2": 50257, "llama": 1003, "gpt_neox": 1003}


@pytest.mark.parametrize("family", ["gpt2", "llama", "gpt_neox"])
def test_greedy_is_token_identical_to_transformers_generate(servers, family) -> None:
    for length, max_tokens in ((1, 12), (9, 16), (40, 10)):
        prompt = _prompt(length, VOCAB[family], seed=length)
        want = _transformers_greedy(family, prompt, max_tokens)
        assert _generate(servers[family], prompt, max_tokens) == want, (family, length)


def test_unary_infer_returns_the_whole_sequence(servers) -> None:
    server = servers["llama"]
    prompt = _prompt(6, 1003, seed=3)
    result = tg.InferenceServerClient(f"127.0.0.1:{server.port}").infer(
        server.slot.name, _inputs(prompt, 9))
    assert result.as_numpy("output_ids").tolist() == [_generate(server, prompt, 9)]
    params = result.get_response().parameters
    assert params["triton_final_response"].bool_param
    assert params["finish_reason"].string_param == "length"


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])  # bucket and longest padding
def test_sixteen_concurrent_streams_each_equal_to_itself_alone(servers, family) -> None:
    server = servers[family]
    vocab = VOCAB[family]
    rng = np.random.default_rng(16)
    jobs = [(_prompt(int(rng.integers(1, 48)), vocab, seed=100 + i), int(rng.integers(1, 40)))
            for i in range(16)]
    alone = [_generate(server, p, k) for p, k in jobs]
    together: dict[int, list[int]] = {}
    streams = [_Stream(server) for _ in jobs]

    def run(i: int) -> None:
        time.sleep(0.003 * (i % 5))  # arrivals spread over a few decode steps
        streams[i].send(_inputs(*jobs[i]), request_id=str(i))
        together[i] = streams[i].collect()[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for s in streams:
        s.close()
    assert [together.get(i) for i in range(16)] == alone
    assert [len(a) for a in alone] == [k for _, k in jobs]
    steps = _metric(server, 'tuner_batch_size_bucket{le="8.0"')  # some steps ran 8 rows
    assert steps > _metric(server, 'tuner_batch_size_bucket{le="1.0"')


@pytest.mark.parametrize("req, transforms", [
    (PadRequest(vocab_size=1024, ffn_size=448), {"vocab 1003->1024", "ffn 426->448"}),
    (PadRequest(head_dim=128), {"head_dim 80->128"}),  # the cache kept: pad inside, slice back
    (PadRequest(head_dim=128, cache_policy="widen"), {"head_dim 80->128"}),  # a wider cache
], ids=["vocab+ffn", "head_dim-keep", "head_dim-widen"])
def test_padded_variant_is_token_identical_to_the_original(reference_model, tmp_path, req,
                                                           transforms) -> None:
    src = _kv_model(reference_model, "llama")
    padded = pad_file(src, tmp_path / "padded.onnx", req)  # gated by greedy rollouts
    assert set(padded.transforms) == transforms
    server = _start(_artifact(tmp_path / "out", src, variant=Path(padded.dst)))
    try:
        assert server.slot.engine.model.served == "padded"  # its gate passed here
        for length in (2, 21):
            prompt = _prompt(length, 1003, seed=length)
            assert _generate(server, prompt, 14) == _transformers_greedy("llama", prompt, 14)
    finally:
        server.stop(5)


# ---------------------------------------------------------------------------- cancelling


def test_a_cancelled_stream_does_not_disturb_the_others(servers) -> None:
    server = servers["llama"]
    jobs = [(_prompt(5 + 3 * i, 1003, seed=200 + i), 30) for i in range(4)]
    alone = [_generate(server, p, k) for p, k in jobs]
    generator, fast = slowed(server, 0.005)
    try:
        victim = _Stream(server)
        victim.send(_inputs(_prompt(4, 1003, seed=9), 190))
        others = [_Stream(server) for _ in jobs]
        for s, job in zip(others, jobs):
            s.send(_inputs(*job))
        for _ in range(3):  # a few tokens, then the client goes away
            victim.responses.get(timeout=30)
        victim.close(cancel=True)
        got = [s.collect()[0] for s in others]
        for s in others:
            s.close()
        deadline = time.time() + 10
        while generator.active and time.time() < deadline:
            time.sleep(0.01)
        assert generator.active == 0  # the cancelled stream's slot was freed
    finally:
        generator.runner = fast
    assert got == alone
    assert _metric(server, "nv_inference_request_failure{" , 'reason="CANCELED"') >= 1
    assert scraped_metrics(server)[("vllm:request_success_total",
                             (("finished_reason", "abort"),))] >= 1


# ------------------------------------------------------------------------------- limits


def _code(server: Server, inputs: list, **parameters) -> str:
    client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    with pytest.raises(InferenceServerException) as info:
        client.infer(server.slot.name, inputs, parameters=parameters or None)
    return f"{info.value.status()}: {info.value.message()}"


def test_limits_are_invalid_argument_with_the_reason(servers) -> None:
    gpt2, llama = servers["gpt2"], servers["llama"]
    cases = [
        (gpt2, _inputs([1] * 256, 1), "at most 255 are accepted"),  # gpt2: 256 positions
        (gpt2, _inputs([1] * 200, 60), "exceed the maximum cache length 256"),
        (llama, _inputs([1, 2], 201), "max_tokens 201 is over the limit 200"),
        (llama, _inputs([1, 2], 0), "max_tokens must be >= 1"),
        (llama, _inputs([1, 1003], 2), "token id 1003 is outside the vocabulary [0, 1003)"),
        (llama, _inputs([1, 2], 2, temperature=-1.0), "temperature must be"),
        (llama, _inputs([1, 2], 2, top_p=1.5), "top_p must be in (0, 1]"),
        (gpt2, _text_input("hello"), "no tokenizer"),
    ]
    for server, inputs, reason in cases:
        got = _code(server, inputs)
        assert got.startswith("StatusCode.INVALID_ARGUMENT") and reason in got, got


def test_a_full_server_answers_resource_exhausted_and_shows_its_queue(reference_model,
                                                                       tmp_path) -> None:
    server = _start(_artifact(tmp_path, _kv_model(reference_model, "llama")),
                    max_streams=1, max_queue=1)
    slowed(server, 0.03)  # each stream runs ~3 s: long enough to look at the queue
    streams = [_Stream(server) for _ in range(2)]
    try:
        for s in streams:  # one running, one queued
            s.send(_inputs([1, 2, 3], 100))
        seen, deadline = None, time.time() + 10
        while not (seen and seen[:2] == (1, 1) and seen[2] > 0) and time.time() < deadline:
            scraped = scraped_metrics(server)
            seen = tuple(scraped[(name, ())] for name in (
                "vllm:num_requests_waiting", "vllm:num_requests_running",
                "vllm:kv_cache_usage_perc"))
            time.sleep(0.01)
        # queued, running, and the running stream's entries: a share of the cache's budget
        assert seen[:2] == (1, 1) and 0 < seen[2] < 1, seen
        got = _code(server, _inputs([1, 2, 3], 4))
        assert got.startswith("StatusCode.RESOURCE_EXHAUSTED") and "queue" in got, got
        assert all(len(s.collect()[0]) == 100 for s in streams)  # both still finish
    finally:
        for s in streams:
            s.close()
        server.stop(5)


# ----------------------------------------------------------------------- sampling, text


def test_seeded_sampling_is_reproducible(servers) -> None:
    server = servers["llama"]
    prompt = _prompt(7, 1003, seed=1)
    knobs = dict(temperature=0.9, top_k=50, top_p=0.95)
    first = _generate(server, prompt, 24, seed=7, **knobs)
    assert _generate(server, prompt, 24, seed=7, **knobs) == first
    assert _generate(server, prompt, 24, seed=8, **knobs) != first
    assert first != _generate(server, prompt, 24)  # not greedy
    # the same as request parameters instead of tensors
    stream = _Stream(server)
    stream.send(_inputs(prompt), max_tokens=24, seed=7, **knobs)
    assert stream.collect()[0] == first
    stream.close()


def _text_input(text: str) -> list:
    t = tg.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(np.array([text.encode()], dtype=object))
    m = tg.InferInput("max_tokens", [1], "INT32")
    m.set_data_from_numpy(np.array([40], np.int32))
    return [t, m]


def test_text_in_text_out_never_splits_a_character(servers) -> None:
    server = servers["llama"]
    tokenizer = server.slot.engine.tokenizer
    stream = _Stream(server)
    stream.send(_text_input("Café 日本語 🎉"))
    ids, results, params = stream.collect()
    stream.close()
    pieces = [r.as_numpy("text_output")[0].decode("utf-8") for r in results]
    assert "".join(pieces) == tokenizer.decode(ids) and len(ids) == 40
    assert params["finish_reason"].string_param == "length"


def test_incremental_decoder_holds_back_partial_characters(servers) -> None:
    tokenizer = servers["llama"].slot.engine.tokenizer
    text = "naïve 日本語 🎉🚀 Ελληνικά"
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.add(t) for t in ids] + [decoder.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert any(p == "" for p in pieces)  # some byte tokens completed no character alone


def test_stop_id_ends_the_stream(servers) -> None:
    server = servers["llama"]
    prompt = _prompt(5, 1003, seed=11)
    full = _generate(server, prompt, 20)
    stop = full[6]
    stream = _Stream(server)
    stream.send(_inputs(prompt, 20, end_id=stop))
    ids, _, params = stream.collect()
    stream.close()
    assert ids == full[:full.index(stop)] and params["finish_reason"].string_param == "stop"


# ------------------------------------------------------------------- config and metrics


def test_config_declares_a_decoupled_model(servers) -> None:
    server = servers["llama"]
    client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    config = client.get_model_config(server.slot.name).config
    assert config.model_transaction_policy.decoupled
    assert config.parameters["max_cache_len"].string_value == str(POSITIONS)
    meta = client.get_model_metadata(server.slot.name)
    assert [t.name for t in meta.inputs][:2] == ["input_ids", "text_input"]
    assert [t.name for t in meta.outputs][:2] == ["text_output", "output_ids"]


def _metric(server: Server, prefix: str, contains: str = "") -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                  timeout=10).read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(prefix) and contains in line]
    return sum(values)


# a decoder's series and vLLM's name for each (what an inference gateway, an autoscaler or
# AIPerf reads from a vLLM server)
_TWINS = {"tuner_generated_tokens_total": "vllm:generation_tokens_total",
          "tuner_prompt_tokens_total": "vllm:prompt_tokens_total",
          "tuner_time_to_first_token_seconds_count": "vllm:time_to_first_token_seconds_count",
          "tuner_inter_token_latency_seconds_count": "vllm:inter_token_latency_seconds_count",
          "tuner_stream_duration_seconds_count": "vllm:e2e_request_latency_seconds_count",
          "tuner_stream_duration_seconds_sum": "vllm:e2e_request_latency_seconds_sum",
          "tuner_active_streams": "vllm:num_requests_running",
          "tuner_queued_streams": "vllm:num_requests_waiting",
          "tuner_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc"}


def test_metrics_count_tokens_and_latencies_under_our_names_and_vllms(servers) -> None:
    server = servers["gpt_neox"]
    before = scraped_metrics(server)
    _generate(server, [1, 2, 3], 5)
    deadline = time.time() + 10  # (the gauges are set after the step that ended the stream)
    while (after := scraped_metrics(server))[("tuner_active_streams", ())] and time.time() < deadline:
        time.sleep(0.01)
    rose = {name: after[(name, ())] - before.get((name, ()), 0) for name in _TWINS}
    assert rose["tuner_generated_tokens_total"] == 5
    assert rose["tuner_prompt_tokens_total"] == 3
    assert rose["tuner_time_to_first_token_seconds_count"] == 1
    assert rose["tuner_inter_token_latency_seconds_count"] == 4
    assert rose["tuner_stream_duration_seconds_count"] == 1
    assert after[("tuner_active_streams", ())] == 0 == after[("tuner_kv_cache_usage_ratio", ())]
    for ours, vllms in _TWINS.items():
        assert after[(vllms, ())] == after[(ours, ())], vllms
    ended = ("tuner_finished_streams_total", (("reason", "length"),))
    assert after[ended] - before.get(ended, 0) == 1
    assert after[("vllm:request_success_total", (("finished_reason", "length"),))] == \
        after[ended]
    # the prefix cache's block and how many of them the cache's budget holds
    ((_, labels),) = [k for k in after if k[0] == "vllm:cache_config_info"]
    config = dict(labels)
    assert config["block_size"] == "16" and int(config["num_gpu_blocks"]) > 0


# ------------------------------------------------------------------------------ shutdown


def test_stop_ends_running_streams_with_a_reason_within_the_grace(reference_model,
                                                                   tmp_path) -> None:
    server = _start(_artifact(tmp_path, _kv_model(reference_model, "llama")))
    slowed(server, 0.02)
    stream = _Stream(server)
    stream.send(_inputs([1, 2, 3], 190))  # ~4 s of decoding: longer than the grace
    stream.responses.get(timeout=30)  # it is running
    began = time.time()
    stopper = threading.Thread(target=server.stop, args=(1.5,))
    stopper.start()
    ids, _, params = stream.collect()
    stopper.join(10)
    assert not stopper.is_alive() and time.time() - began < 5
    assert params["finish_reason"].string_param == "shutdown" and 0 < len(ids) < 190
    stream.close()


def test_optimize_copies_the_tokenizer_and_config_into_the_artifact(tmp_path) -> None:
    from tuner.jobs.optimize import _copy_text_files

    model_dir, out = tmp_path / "hf", tmp_path / "out"
    model_dir.mkdir()
    out.mkdir()
    (model_dir / "tokenizer.json").write_text("{}")
    (model_dir / "config.json").write_text('{"max_position_embeddings": 64}')
    (model_dir / "generation_config.json").write_text('{"eos_token_id": [2, 7]}')
    (model_dir / "genai_config.json").write_text('{"model": {"eos_token_id": 2}}')
    (model_dir / "chat_template.jinja").write_text("{{ messages }}")
    (model_dir / "notes.txt").write_text("not copied")
    (model_dir / "1_Pooling").mkdir()
    (model_dir / "1_Pooling" / "config.json").write_text('{"pooling_mode_cls_token": true}')
    _copy_text_files(model_dir, out)
    assert (out / "chat_template.jinja").read_text() == "{{ messages }}"
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.json")) == [
        "1_Pooling/config.json", "config.json", "genai_config.json", "generation_config.json",
        "tokenizer.json"]


def test_a_bad_request_on_a_stream_answers_an_error_and_the_stream_goes_on(servers) -> None:
    server = servers["llama"]
    stream = _Stream(server)
    try:
        stream.send(_inputs([1, 2], 500))
        with pytest.raises(InferenceServerException, match="over the limit 200"):
            stream.collect()
        stream.send(_inputs([1, 2], 3))
        assert len(stream.collect()[0]) == 3
    finally:
        stream.close()


def test_empty_final_response_when_the_client_asks_for_it(servers) -> None:
    server = servers["gpt_neox"]
    stream = _Stream(server)
    try:
        stream.client.async_stream_infer(server.slot.name, _inputs([5, 6, 7], 4),
                                         enable_empty_final_response=True)
        ids, results, params = stream.collect()
    finally:
        stream.close()
    assert len(ids) == 4 and len(results) == 5  # four tokens, then the flag alone
    assert results[-1].as_numpy("output_ids").size == 0
    assert params["finish_reason"].string_param == "length"


def test_sampling_cuts() -> None:
    from serving.sampling import Sampling, sample

    logits = np.array([0.0, 3.0, 2.9, -1.0, 2.8], np.float32)
    rng = np.random.default_rng(0)
    assert sample(logits, Sampling(), rng) == 1  # greedy by default
    assert sample(logits, Sampling(temperature=2.0, top_k=1), rng) == 1
    top2 = {sample(logits, Sampling(temperature=5.0, top_k=2), rng) for _ in range(200)}
    assert top2 == {1, 2}
    nucleus = {sample(logits, Sampling(temperature=1.0, top_p=0.3), rng) for _ in range(200)}
    assert nucleus <= {1, 2} and 1 in nucleus
    with pytest.raises(Exception, match="top_p must be in"):
        Sampling(top_p=1.5)


def test_the_serving_process_holds_its_startup_heap_out_of_the_collector(reference_model,
                                                                          tmp_path) -> None:
    """`serve` (the process `tuner serve` runs) freezes what its start-up made once the model
    is ready, so a full collection never walks it mid-generation (serving.server)."""
    import subprocess
    import sys

    out = _artifact(tmp_path, _kv_model(reference_model, "gpt2"))
    code = f"""
import gc, os, signal, threading, time
from serving.server import ServerOptions, serve
def stop_when_frozen():
    deadline = time.monotonic() + 60
    while gc.get_freeze_count() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=stop_when_frozen, daemon=True).start()
rc = serve({str(out)!r}, ServerOptions(port=0, http_port=None, metrics_port=None),
           say=lambda line: None)
print(rc, gc.get_freeze_count())
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=180)
    rc, frozen = map(int, run.stdout.split())
    assert rc == 0 and frozen > 10_000, run.stdout + run.stderr


def test_sigterm_lets_running_streams_finish_and_exits_0(reference_model, tmp_path) -> None:
    """`tuner serve` as a real process: SIGTERM while 6 streams decode; each still gets all
    of its tokens and a final response, and the process exits 0."""
    import signal

    from serving_support import free_port, serve_process

    out = _artifact(tmp_path, _kv_model(reference_model, "gpt2"))  # 256 positions
    port = free_port()
    proc = serve_process(out, port, "gpt2", "--drain-timeout-s", "30")
    try:
        streams = [_Stream(port=port, name="gpt2") for _ in range(6)]
        for i, s in enumerate(streams):
            s.send(_inputs(_prompt(3 + i, 50257, seed=i), 240))
        for s in streams:
            s.responses.get(timeout=30)  # every stream is decoding
        proc.send_signal(signal.SIGTERM)
        finals = [s.collect(timeout=60) for s in streams]
        for s in streams:
            s.close()
        assert [len(ids) + 1 for ids, _, _ in finals] == [240] * 6  # the first was taken above
        assert all(p["finish_reason"].string_param == "length" for _, _, p in finals)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
