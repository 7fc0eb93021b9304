"""A served model under a random mix of real clients, all at once, for a while, each client
kind at least once. For a decoder (or an encoder-decoder folder): streams that the client
drops or cancels midway, bad requests, searches, and greedy requests whose text must equal
what the same request got from the idle server before; afterwards no stream may be left
running or queued. For an embedding model, a reranker, a classifier, a SPLADE model, a token
classifier or a masked LM (bench/soak_encoders.py, soak_scores.py, soak_tokens.py): every API's
vectors, scores, entities and fills checked against the idle server's, cancelled and dropped
requests, malformed ones. For Whisper (bench/soak_audio.py): OpenAI's
audio API and Triton's Whisper names, greedy transcriptions checked likewise. Either way the
server must answer as before at the end; its resident memory is sampled throughout.

    .venv/bin/python bench/soak.py [--seconds 120] [--clients 6] [--artifact OUT]
        [--model decoder|embedding|reranker|classifier|whisper|sparse|tagger|masked-lm]
        [--kv-cache-bytes 400000]
        [--max-streams 6] [--serve-args "..."]

A decoder's clients: the `openai` client (chat streamed, dropped after a few chunks half the
time; completions with n, logprobs, stop strings, vLLM's beam search), tritonclient.grpc on
TensorRT-LLM's tensor names (cancelled after a few responses), raw HTTP streams of Triton's
generate_stream, TGI's generate_stream, Anthropic's Messages API and Ollama's generate,
closed after a few lines, and malformed bodies that must be answered 4xx. By default the KV
cache's byte budget is small, so streams are preempted and recomputed all the time, the
prefix cache evicts, and prompt lookup drafts where a stream runs alone. Exit 1 on any
client error, any answer unlike the idle server's, a stream left over, an error in the
server's log, or a server that died.
"""

from __future__ import annotations

import argparse
import http.client
import json
import queue
import random
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or with -m
from serve_common import (MODEL_NAME, ROOT, classifier_artifact, decoder_artifact,
                          embedding_artifact, free_port, load_note, masked_lm_artifact,
                          reranker_artifact, sparse_artifact, tagger_artifact, wait_ready,
                          whisper_folder)
from soak_audio import AudioClients
from soak_encoders import EmbeddingClients
from soak_scores import ClassifierClients, RerankClients, info
from soak_tokens import FillMaskClients, SparseClients, TaggerClients

WORDS = "the quick brown fox jumps over a lazy dog and then runs far away into woods".split()
# greedy requests checked against the idle server's answers (prompts of 5 to 38 words)
FIXED = [" ".join(random.Random(k).choice(WORDS) for _ in range(5 + 3 * k)) for k in range(12)]
GAUGES = ("tuner_active_streams", "tuner_queued_streams")
BUILT_IN = {"decoder": decoder_artifact, "embedding": embedding_artifact,
            "reranker": reranker_artifact, "classifier": classifier_artifact,
            "whisper": whisper_folder, "sparse": sparse_artifact, "tagger": tagger_artifact,
            "masked-lm": masked_lm_artifact}
# the encoder kind TEI's /info names (its model_type's key; the pooling for an embedding
# model, where SPLADE's is "splade") -> its clients
ENCODER_CLIENTS = {"embedding": EmbeddingClients, "splade": SparseClients,
                   "reranker": RerankClients, "classifier": ClassifierClients,
                   "token_classifier": TaggerClients, "masked_lm": FillMaskClients}
COUNTERS = ("tuner_preempted_streams_total", "tuner_prefix_cache_hit_tokens_total",
            "tuner_spec_drafts_total")


class GenerationClients:
    """One action per client kind; each takes a seeded Random and returns the row it counts
    under (raising on anything a correct server would not do)."""

    checked_what = "greedy requests"

    def __init__(self, grpc_port: int, http_port: int, chat: bool) -> None:
        import openai

        self.grpc_port, self.http_port, self.has_chat = grpc_port, http_port, chat
        self.openai = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1",
                                    api_key="unused", max_retries=0, timeout=120)
        self.refs: dict[int, str] = {}
        self.checked = 0
        self.mismatches: list[str] = []  # each one line: what differed

    def greedy(self, k: int) -> str:
        return self.openai.completions.create(
            model=MODEL_NAME, prompt=FIXED[k], max_tokens=40, temperature=0,
            extra_body={"ignore_eos": True}).choices[0].text

    def record_references(self) -> None:
        self.refs = {k: self.greedy(k) for k in range(len(FIXED))}

    def unchanged(self) -> bool:
        return all(self.greedy(k) == self.refs[k] for k in range(3))

    def greedy_check(self, r: random.Random) -> str:
        k = r.randrange(len(FIXED))
        got = self.greedy(k)
        self.checked += 1
        if got != self.refs[k]:
            self.mismatches.append(f"prompt {k}: {got!r} against {self.refs[k]!r}")
        return "greedy, checked (openai)"

    def chat(self, r: random.Random) -> str:
        stream = self.openai.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": _prompt(r)}],
            max_tokens=r.randint(1, 48), stream=True, temperature=r.choice([0, 0.8]),
            seed=r.randint(0, 99))
        drop = r.randint(0, 10) if r.random() < 0.5 else None
        for k, _ in enumerate(stream):
            if k == drop:
                stream.close()
                return "chat streamed, dropped (openai)"
        return "chat streamed (openai)"

    def completions(self, r: random.Random) -> str:
        body = dict(model=MODEL_NAME, prompt=_prompt(r), max_tokens=r.randint(1, 32),
                    n=r.choice([1, 2, 3]), logprobs=r.choice([None, 2]),
                    stop=r.choice([None, [" the"], ["fox", "dog"]]),
                    temperature=r.choice([0, 1.0]))
        if r.random() < 0.15:
            self.openai.completions.create(**{**body, "n": 2, "temperature": 0,
                                              "logprobs": None},
                                           extra_body={"use_beam_search": True})
            return "beam search (openai)"
        self.openai.completions.create(**body)
        return "completions (openai)"

    def triton(self, r: random.Random) -> str:
        import tritonclient.grpc as tg

        client = tg.InferenceServerClient(f"127.0.0.1:{self.grpc_port}")
        got: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        tensors = []
        for name, datatype, value in (
                ("text_input", "BYTES", np.array([_prompt(r).encode()], object)),
                ("max_tokens", "INT32", np.array([r.randint(1, 40)], np.int32)),
                ("stream", "BOOL", np.array([True]))):
            tensors.append(tg.InferInput(name, [1], datatype))
            tensors[-1].set_data_from_numpy(value)
        client.async_stream_infer(MODEL_NAME, tensors, request_id=str(r.random()),
                                  enable_empty_final_response=True)
        try:
            for _ in range(r.randint(0, 12)):
                result, error = got.get(timeout=120)
                if error is not None:
                    raise error
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
        finally:
            client.stop_stream(cancel_requests=True)
            client.close()
        return "stream cancelled or read (tritonclient.grpc)"

    def _sse(self, r: random.Random, path: str, body: dict) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=120)
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        answer = conn.getresponse()
        if answer.status != 200:
            raise RuntimeError(f"{path}: HTTP {answer.status}: {answer.read()[:200]!r}")
        for _ in range(r.randint(0, 20)):
            if not answer.readline():
                break
        conn.close()
        return f"{path} streamed, closed after 0-20 lines (http)"

    def triton_generate(self, r: random.Random) -> str:
        return self._sse(r, f"/v2/models/{MODEL_NAME}/generate_stream",
                         {"text_input": _prompt(r),
                          "parameters": {"max_tokens": r.randint(1, 40)}})

    def tgi(self, r: random.Random) -> str:
        return self._sse(r, "/generate_stream", {
            "inputs": _prompt(r), "parameters": {"max_new_tokens": r.randint(1, 40)}})

    def anthropic(self, r: random.Random) -> str:
        return self._sse(r, "/v1/messages", {
            "model": MODEL_NAME, "max_tokens": r.randint(1, 40), "stream": True,
            "messages": [{"role": "user", "content": _prompt(r)}]})

    def ollama(self, r: random.Random) -> str:
        return self._sse(r, "/api/generate", {"model": MODEL_NAME, "prompt": _prompt(r),
                                              "options": {"num_predict": r.randint(1, 40)}})

    def malformed(self, r: random.Random) -> str:
        bodies = (b"{not json",
                  {"model": MODEL_NAME, "prompt": "a", "max_tokens": -3},
                  {"model": MODEL_NAME, "prompt": "a", "max_tokens": 10 ** 9},
                  {"model": MODEL_NAME, "prompt": "a", "temperature": "hot"},
                  {"model": MODEL_NAME, "prompt": [[1, 2, 10 ** 9]], "max_tokens": 2})
        body = r.choice(bodies)
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=60)
        conn.request("POST", "/v1/completions",
                     body if isinstance(body, bytes) else json.dumps(body).encode(),
                     {"Content-Type": "application/json"})
        status = conn.getresponse().status
        conn.close()
        if not 400 <= status < 500:
            raise RuntimeError(f"a malformed body answered HTTP {status}")
        return "malformed, answered 4xx (http)"

    def actions(self):
        chats = (self.chat, self.anthropic) if self.has_chat else ()
        return (self.greedy_check, self.greedy_check, *chats, self.completions, self.triton,
                self.triton_generate, self.tgi, self.ollama, self.malformed)


def _has_chat_template(artifact: Path) -> bool:
    """Whether the chat APIs can answer (else they are left out: a model without a chat
    template answers them 400, which is right)."""
    from serving.text_config import load_text_config

    return load_text_config(artifact).chat_template is not None


def _clients(grpc_port: int, http_port: int, artifact: Path):
    """The clients for what the server says it serves, as its clients read it: Whisper
    (Triton's Whisper tensor names in its config), a generator (decoupled), else the encoder
    kind TEI's /info names (ENCODER_CLIENTS)."""
    import tritonclient.grpc as tg

    client = tg.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        config = client.get_model_config(MODEL_NAME).config
    finally:
        client.close()
    if "WAV" in {t.name for t in config.input}:
        return AudioClients(grpc_port, http_port)
    if config.model_transaction_policy.decoupled:
        return GenerationClients(grpc_port, http_port, _has_chat_template(artifact))
    kind = info(http_port)["model_type"]  # TEI's: {"embedding": {"pooling": ...}} and so on
    [name] = kind
    if kind.get("embedding", {}).get("pooling") == "splade":
        name = "splade"
    if name not in ENCODER_CLIENTS:
        raise SystemExit(f"no soak clients for this model (TEI's /info: {kind}): the soak "
                         "drives decoders, encoder-decoders, Whisper and these encoders: "
                         f"{', '.join(ENCODER_CLIENTS)}")
    return ENCODER_CLIENTS[name](grpc_port, http_port)


def _prompt(r: random.Random) -> str:
    return " ".join(r.choice(WORDS) for _ in range(r.randint(1, 40)))


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    found: dict[str, float] = {}
    for name, value in re.findall(r"^(tuner_\w+)\{[^}]*\} (\S+)$", text, re.M):
        if name in GAUGES + COUNTERS:
            found[name] = found.get(name, 0.0) + float(value)
    return found


def _settled(port: int, wait: float = 5.0) -> dict[str, float]:
    """The metrics once no stream is left running or queued, or after `wait` seconds
    (cancels and drops take effect at the engine's next step)."""
    deadline = time.monotonic() + wait
    while True:
        metrics = _scrape(port)
        left = metrics.get("tuner_active_streams", 0) + metrics.get("tuner_queued_streams", 0)
        if not left or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def _rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) // 1024


def soak(artifact: Path, seconds: float, clients: int, server_args: list[str]) -> int:
    grpc_port, http_port = free_port(), free_port()
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "tuner", "serve", str(artifact), "--port", str(grpc_port),
             "--http-port", str(http_port), "--metrics-port", "-1", "--model-name",
             MODEL_NAME, *server_args], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            wait_ready(grpc_port, server)
            kinds = _clients(grpc_port, http_port, artifact)
            return _drive(server, kinds, seconds, clients, log)
        finally:
            server.terminate()
            server.wait(60)


def _drive(server: subprocess.Popen, c, seconds: float, n_clients: int, log) -> int:
    """`c`'s clients (any kind's: GenerationClients, EncoderClients' kinds, AudioClients) at
    once until `seconds` pass; 0 if nothing a correct server would not do was seen."""
    c.record_references()
    counts: dict[str, int] = {}
    errors: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def client(seed: int) -> None:
        r = random.Random(seed)
        first = list(c.actions()[seed::n_clients])  # every kind at least once, however short
        while (first or time.monotonic() < deadline) and server.poll() is None:
            action = first.pop(0) if first else r.choice(c.actions())
            try:
                row = action(r)
            except Exception as e:  # every failure is a finding: counted and shown
                row = None
                with lock:
                    errors.append(f"{action.__name__}: {type(e).__name__}: {str(e)[:160]}")
            with lock:
                counts[row or f"{action.__name__} failed"] = \
                    counts.get(row or f"{action.__name__} failed", 0) + 1

    rss = [_rss_mb(server.pid)]
    threads = [threading.Thread(target=client, args=(k,)) for k in range(n_clients)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        time.sleep(1)
        if server.poll() is None:
            rss.append(_rss_mb(server.pid))
    if server.poll() is not None:
        print(f"the server died (exit {server.returncode})")
        return 1
    metrics = _settled(c.http_port)
    same = c.unchanged()
    log.seek(0)
    faults = [line.rstrip() for line in log if "Traceback" in line or "Error" in line]
    _report(counts, errors, c, metrics, rss, same, faults, seconds, n_clients)
    left = metrics.get("tuner_active_streams", 0) + metrics.get("tuner_queued_streams", 0)
    return 0 if not (errors or c.mismatches or left or faults) and same else 1


def _report(counts, errors, c, metrics, rss, same, faults, seconds, clients) -> None:
    print(f"{seconds:.0f} s, {clients} clients at once; {load_note()}\n")
    print("| client | requests |\n|---|---|")
    for row, n in sorted(counts.items()):
        print(f"| {row} | {n} |")
    print(f"\n{c.checked_what} equal to the idle server's answer: "
          f"{c.checked - len(c.mismatches)} of {c.checked}")
    for line in c.mismatches[:3]:
        print(f"  {line}")
    print(f"client errors: {len(errors)}")
    for line in sorted(set(errors))[:20]:
        print(f"  {line}")
    print(f"afterwards: {metrics.get('tuner_active_streams', 0):.0f} streams running, "
          f"{metrics.get('tuner_queued_streams', 0):.0f} queued; answers as before: "
          f"{'yes' if same else 'NO'}")
    print(f"preempted streams {metrics.get('tuner_preempted_streams_total', 0):.0f}, prefix "
          f"cache hit tokens {metrics.get('tuner_prefix_cache_hit_tokens_total', 0):.0f}, "
          f"speculative runs {metrics.get('tuner_spec_drafts_total', 0):.0f}")
    quarters = ", ".join(str(rss[round(q * (len(rss) - 1) / 4)]) for q in range(5))
    print(f"server resident MB: {rss[0]} at the start, {max(rss)} at the peak, {rss[-1]} at "
          f"the end (each quarter of the run: {quarters})")
    print(f"server log lines with an error: {len(faults)}")
    for line in faults[:10]:
        print(f"  {line[:200]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=120, help="how long the clients run")
    ap.add_argument("--clients", type=int, default=6, help="clients at once")
    ap.add_argument("--artifact", type=Path, default=None,
                    help="the artifact (or encoder-decoder folder) to serve, with its "
                         "tokenizer (default: the --model built in)")
    ap.add_argument("--model", choices=sorted(BUILT_IN), default="decoder",
                    help="without --artifact: decoder, the llama-kv reference export with a "
                         "byte-level BPE and a chat template; embedding, all-MiniLM-L6-v2 "
                         "(real weights); reranker and classifier, the tests' cross-encoder "
                         "and NLI classifier; whisper, the tests' Whisper export made to hear "
                         "its audio (random weights but MiniLM's); sparse, tagger and "
                         "masked-lm, the tests' SPLADE model, BERT tagger and BERT masked LM")
    ap.add_argument("--kv-cache-bytes", type=int, default=400_000,
                    help="the server's KV cache budget, small so that streams are preempted "
                         "(0: the server's default)")
    ap.add_argument("--max-streams", type=int, default=6, help="the server's --max-streams")
    ap.add_argument("--serve-args", default="",
                    help="more `tuner serve` options, as one string (e.g. '--no-prefix-cache')")
    args = ap.parse_args(argv)
    server_args = ["--max-streams", str(args.max_streams), *shlex.split(args.serve_args)]
    if args.kv_cache_bytes:
        server_args += ["--kv-cache-bytes", str(args.kv_cache_bytes)]
    with tempfile.TemporaryDirectory() as tmp:
        artifact = args.artifact or BUILT_IN[args.model](Path(tmp))
        return soak(artifact, args.seconds, args.clients, server_args)


if __name__ == "__main__":
    sys.exit(main())
