"""The LLM benchmarking tools people point at a server, unmodified, run as their CLIs run
against `tuner serve`: NVIDIA's AIPerf (genai-perf's successor) on the chat and Text
Generation Inference endpoints and on reranking in Text Embeddings Inference's shape, and
vLLM's GuideLLM on completions and the Responses API (each tool drives the other endpoints
too, the Messages API included: one run each is enough here, as every run costs ~10 s of
the tool's own start-up). They live
in an environment of their own (models/venvs.py: their pins clash with ours), built beside
the first tests (conftest). Every run must finish each request without an error, and count
the tokens the server generated; asked for greedy output (temperature 0, the end token
ignored), each request must receive the text of a plain ONNX Runtime greedy loop over the
prompt it sent."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest
from llm_support import (decoder_artifact, greedy, hf_tokenizer_folder, llama,  # noqa: F401
                         rendered_ids, start, tokenizer)

from models.venvs import TORCH, ensure_venv

VENV = ("llm-bench", ("aiperf==0.13.0", "guidellm==0.8.1", TORCH))  # GuideLLM needs torch
NEW = 12  # tokens each request asks for
REQUESTS = 6
GREEDY = {"temperature": 0, "ignore_eos": True}

pytestmark = pytest.mark.venv(*VENV)  # built beside the first tests (conftest)


@pytest.fixture(scope="module")
def tools() -> Path:
    return ensure_venv(*VENV)


@pytest.fixture(scope="module")
def served(llama, tmp_path_factory):
    artifact = decoder_artifact(tmp_path_factory.mktemp("bench-clients"), llama)
    server = start(artifact, generate={"max_streams": 4, "max_tokens": 64})
    yield server, hf_tokenizer_folder(artifact, tmp_path_factory.mktemp("tokenizer"))
    server.stop(5)


def _run(python: Path, args: list[str], tmp: Path) -> None:
    """One run of a tool's CLI. Its temporary files go to a short folder of their own
    (AIPerf leaves its dataset there and names ZeroMQ sockets after it: a socket path over
    107 bytes fails), its Hugging Face cache to `tmp`. Not in offline mode: AIPerf 0.13
    cannot load a local tokenizer folder in it (and there is nothing to download: the
    tokenizer is a local folder)."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE")}
    with tempfile.TemporaryDirectory(prefix="bench-") as short:
        r = subprocess.run([str(python), "-P", "-m", *args], capture_output=True, text=True,
                           timeout=300, cwd=tmp,
                           env={**env, "TMPDIR": short, "HF_HOME": str(tmp / "hf-home")})
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]


def _text(content) -> str:
    """A message's content as the chat template reads it (a string, or text parts)."""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)


def _prompt_ids(body: dict) -> list[int]:
    """The token ids the server runs for a request body, by the reference tokenizer and
    transformers' rendering of the chat template."""
    if "prompt" in body or "inputs" in body:  # completions, TGI
        return tokenizer().encode(body.get("prompt") or body["inputs"]).ids
    turns = body.get("messages") or body["input"]
    return rendered_ids([{"role": t["role"], "content": _text(t["content"])} for t in turns])


def _greedy_text(llama, body: dict) -> str:
    return tokenizer().decode(greedy(llama, _prompt_ids(body), NEW)[0])


# --- AIPerf --------------------------------------------------------------------------------


def _aiperf(tools, server, tokenizer_folder, tmp, endpoint: str, *extra: str,
            prompt_tokens: int = 24, server_metrics: bool = False):
    """AIPerf's summary and its raw records (each request's body and what came back).
    `server_metrics`: let it scrape the server's /metrics while it runs (as it does unless
    told not to; it then waits 2 s at the end for a last scrape)."""
    out = tmp / "aiperf"
    tmp.mkdir(exist_ok=True)
    _run(tools, ["aiperf", "profile", "-m", server.slot.name, "--endpoint-type", endpoint,
                 "--url", f"127.0.0.1:{server.http_port}", "--tokenizer", str(tokenizer_folder),
                 "--synthetic-input-tokens-mean", str(prompt_tokens),
                 "--synthetic-input-tokens-stddev", "0", "--request-count", str(REQUESTS), "--concurrency", "3", "--random-seed", "1",
                 "--ui-type", "none", "--export-level", "raw", "--artifact-dir", str(out),
                 *([] if server_metrics else ["--no-server-metrics"]), *extra], tmp)
    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    records = [json.loads(line)
               for line in (out / "profile_export_raw.jsonl").read_text().splitlines()]
    assert summary["error_summary"] == [] and summary["request_count"]["avg"] == REQUESTS
    assert len(records) == REQUESTS and all(r["status"] == 200 for r in records)
    return summary, records


def _streamed(record: dict) -> str:
    """The text of one streamed answer, from AIPerf's raw server-sent events (chat and
    completions chunks, the Messages API's text deltas, the Responses API's, and TGI's last
    event, which carries the whole text)."""
    pieces = []
    for response in record["responses"]:
        for packet in response["packets"]:
            if packet["name"] != "data" or packet["value"] == "[DONE]":
                continue
            event = json.loads(packet["value"])
            if event.get("generated_text") is not None:
                return event["generated_text"]
            if event.get("choices"):
                choice = event["choices"][0]
                pieces.append((choice.get("delta") or {}).get("content") or choice.get("text")
                              or "")
            elif event.get("type") == "content_block_delta":
                pieces.append(event["delta"].get("text", ""))
            elif event.get("type") == "response.output_text.delta":
                pieces.append(event["delta"])
    return "".join(pieces)


@pytest.mark.parametrize("endpoint", ["chat", "huggingface_generate"])
def test_aiperf_streams_the_models_own_tokens(tools, served, llama, tmp_path,
                                              endpoint) -> None:
    server, folder = served
    # TGI's API is greedy unless asked to sample, and refuses a temperature of 0
    greedy_asks = {"ignore_eos": True} if endpoint == "huggingface_generate" else GREEDY
    extra = [a for k, v in greedy_asks.items()
             for a in ("--extra-inputs", f"{k}:{str(v).lower()}")]
    summary, records = _aiperf(tools, server, folder, tmp_path, endpoint, "--streaming",
                               "--output-tokens-mean", str(NEW), "--output-tokens-stddev",
                               "0", *extra, server_metrics=endpoint == "chat")
    for record in records:
        assert _streamed(record) == _greedy_text(llama, record["payload"])
    if endpoint == "chat":  # it found the server's metrics beside the API, and read them
        scraped = json.loads((tmp_path / "aiperf" / "server_metrics_export.json").read_text())
        assert scraped["summary"]["endpoints_successful"] == [
            f"http://127.0.0.1:{server.http_port}/metrics"]
        # each counter's rise over the run, under our name and vLLM's (AIPerf's server-side
        # summary reads vLLM's)
        for name in ("tuner_generated_tokens", "vllm:generation_tokens"):
            (series,) = scraped["metrics"][name]["series"]
            assert series["stats"]["total"] == REQUESTS * NEW
        (series,) = scraped["metrics"]["vllm:prompt_tokens"]["series"]
        assert series["stats"]["total"] == sum(len(_prompt_ids(r["payload"])) for r in records)
        ended = {s["labels"]["finished_reason"]: s["stats"]["total"]
                 for s in scraped["metrics"]["vllm:request_success"]["series"]}
        assert ended == {"length": REQUESTS, "stop": 0, "abort": 0, "error": 0}
        for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
            (series,) = scraped["metrics"][name]["series"]
            assert series["stats"]["count"] == REQUESTS
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                     "vllm:kv_cache_usage_perc"):  # (seen moving in test_serving_generate)
            assert scraped["metrics"][name]["type"] == "gauge"
    assert summary["time_to_first_token"]["avg"] > 0
    assert summary["inter_token_latency"]["avg"] > 0
    if endpoint != "huggingface_generate":  # (TGI's API reports no usage)
        assert summary["usage_completion_tokens"]["min"] == NEW  # the server's own count
        assert summary["usage_completion_tokens"]["max"] == NEW


def test_aiperf_reranks_in_text_embeddings_inferences_shape(tools, cross_encoder_artifact,
                                                           tmp_path) -> None:
    from models.cross_encoder import cached

    server = start(cross_encoder_artifact)
    try:
        # passages shorter than this artifact's 128 tokens (AIPerf's are 550 tokens unless
        # told, which TEI, and this server, would cut to the model's length)
        _, records = _aiperf(tools, server, cached(), tmp_path / "run", "hf_tei_rankings",
                             "--rankings-passages-mean", "4", "--rankings-passages-stddev",
                             "0", "--rankings-passages-prompt-token-mean", "40",
                             "--rankings-passages-prompt-token-stddev", "0",
                             prompt_tokens=16)
    finally:
        server.stop(5)
    for record in records:
        ranked = json.loads(record["responses"][-1]["text"])
        assert sorted(x["index"] for x in ranked) == list(range(len(record["payload"]["texts"])))
        assert [x["score"] for x in ranked] == sorted((x["score"] for x in ranked), reverse=True)


# --- GuideLLM ------------------------------------------------------------------------------


def _guidellm(tools, server, tokenizer_folder, tmp, route: str) -> list[dict]:
    """GuideLLM's successful requests (each with its body and the text it received), from
    a scenario file as its users write them."""
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": f"http://127.0.0.1:{server.http_port}",
                    "model": server.slot.name, "request_format": route,
                    "extras": {"body": {"temperature": 0}}},
        "profile": {"kind": "concurrent", "streams": [3]},
        "data": [{"kind": "synthetic_text", "prompt_tokens": 24, "output_tokens": NEW}],
        "constraints": [{"kind": "max_requests", "count": REQUESTS}],
        "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer_folder)},
        "outputs": [{"kind": "json", "path": str(tmp / "guidellm.json")}]}}
    (tmp / "scenario.json").write_text(json.dumps(scenario))
    _run(tools, ["guidellm", "run", "--scenario", str(tmp / "scenario.json"),
                 "--disable-progress"], tmp)
    requests = json.loads((tmp / "guidellm.json").read_text())["benchmarks"][0]["requests"]
    assert requests["errored"] == [] and requests["incomplete"] == []
    assert len(requests["successful"]) == REQUESTS
    return requests["successful"]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/responses"])
def test_guidellm_streams_the_models_own_tokens(tools, served, llama, tmp_path,
                                                route) -> None:
    server, folder = served
    for request in _guidellm(tools, server, folder, tmp_path, route):
        body = json.loads(request["request_args"])["body"]
        assert body["ignore_eos"] is True  # GuideLLM asks every request for its whole length
        assert request["output"] == _greedy_text(llama, body)
        assert request["output_tokens"] == NEW and request["prompt_tokens"] == len(
            _prompt_ids(body))
        assert request["time_to_first_token_ms"] > 0
