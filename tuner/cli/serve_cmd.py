"""`tuner serve OUT`: serve an artifact's selected variant over KServe v2 gRPC.

The server lives in serving/ (the only place that imports grpc). When one of its
dependencies cannot be imported (missing, or protobuf's runtime too old or too new for the
generated stubs, as `pip install tritonclient[grpc]` after shapetuner can leave it), the rest
of the CLI still works and `tuner serve` says in one line which package and how to fix it."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from tuner.cli.app import app, roles_option
from tuner.errors import BadInput

if TYPE_CHECKING:
    from tuner.runtime.base import SessionSettings

# import name -> (pip package, the bound pyproject.toml gives it)
_SERVING_PACKAGES = {
    "grpc": ("grpcio", ">=1.72.2"),
    "grpc_health": ("grpcio-health-checking", ">=1.72.2,<1.82"),
    "grpc_reflection": ("grpcio-reflection", ">=1.72.2,<1.82"),
    "google": ("protobuf", ">=6.30.0,<7"),
    "prometheus_client": ("prometheus-client", ">=0.20"),
    "starlette": ("starlette", ">=0.40"),
    "uvicorn": ("uvicorn", ">=0.30"),
}


def _culprit(e: BaseException) -> str | None:
    """The top-level module of the deepest frame outside this project and the standard
    library (found through sys.path), or the module an ImportError names."""
    import sys
    import sysconfig

    if isinstance(e, ImportError) and e.name:
        return e.name.split(".")[0]
    here = str(Path(__file__).resolve().parents[2])
    stdlib = sysconfig.get_paths()["stdlib"]
    roots = sorted((str(Path(p).resolve()) for p in sys.path if p), key=len, reverse=True)
    tb, found = e.__traceback__, None
    while tb is not None:
        f = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
        if f.startswith("<") or f.startswith(here) or (f.startswith(stdlib) and
                                                         "-packages" not in f):
            continue
        root = next((r for r in roots if f.startswith(r + "/") and r != here), None)
        if root is not None:
            found = f[len(root) + 1:].split("/", 1)[0].removesuffix(".py")
    if found is None and type(e).__module__.startswith("google.protobuf"):
        return "google"
    return found


def serving_import_error(e: BaseException) -> str | None:
    """One line naming the serving dependency that failed to import and the fix; None when
    the failure is not a dependency's (a bug of ours, which must stay visible)."""
    name = _culprit(e)
    if name not in _SERVING_PACKAGES:
        return None
    package, bound = _SERVING_PACKAGES[name]
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    pins = " ".join(f"'{p}{b}'" for p, b in _SERVING_PACKAGES.values()
                    if p not in ("prometheus-client", "starlette", "uvicorn"))
    return (f"tuner serve cannot start: the serving dependency {package} does not import "
            f"({type(e).__name__}: {first}); fix: pip install {pins}")


def _say(line: str) -> None:
    print(f"tuner serve: {line}", file=sys.stderr, flush=True)


def _settings(out: Path, threads: int | None, spin: bool | None) -> SessionSettings | None:
    """The runtime's settings: the artifact's (None) unless --threads / --spin change them."""
    from serving.overlap import fit_threads
    from tuner.artifact.store import read_manifest
    from tuner.graph.seq2seq_record import is_seq2seq_folder
    from tuner.runtime.base import SessionSettings

    if threads is None and spin is None:
        return None
    base = (SessionSettings() if is_seq2seq_folder(out)
            else read_manifest(out).session_settings(ignore_unknown=True))
    if threads is None:  # --spin alone: the threads as without it, capped to the usable cores
        base = fit_threads(base, _say)
    return dataclasses.replace(
        base, intra_op_threads=base.intra_op_threads if threads is None else threads,
        allow_spinning=base.allow_spinning if spin is None else spin)


@app.command()
def serve(
    out: Path = typer.Argument(..., help="artifact folder written by `tuner optimize` "
                                         "(holds manifest.json), or an encoder-decoder's "
                                         "export folder (Optimum's encoder_model.onnx, "
                                         "decoder_model.onnx, decoder_with_past_model.onnx, "
                                         "in it or in its onnx/; `tuner pad FOLDER` writes "
                                         "one) to generate from"),
    host: str = typer.Option("127.0.0.1", help="address to bind; 0.0.0.0 exposes the server "
                                               "to the network"),
    port: int = typer.Option(8001, help="gRPC port (0: any free port; -1: no gRPC)"),
    http_port: int = typer.Option(8000, help="HTTP port: KServe v2 REST, Triton's generate "
                                             "endpoints, the OpenAI-compatible API, "
                                             "Anthropic's Messages API, Text Generation "
                                             "Inference's generate API (a decoder), OpenAI's "
                                             "audio API (a Whisper folder), Text "
                                             "Embeddings Inference's API (an encoder), "
                                             "Ollama's API and /metrics (0: any free port; "
                                             "-1: no HTTP)"),
    metrics_port: int = typer.Option(8002, help="Prometheus /metrics port, as Triton's (-1: "
                                                 "none; the HTTP port serves them too)"),
    model_name: Optional[str] = typer.Option(None, help="name clients use (default: the "
                                                        "source model file's stem)"),
    backend: Optional[str] = typer.Option(None, help="runtime backend (default: the one the "
                                                     "artifact was measured on, e.g. ort-cpu)"),
    max_batch: Optional[int] = typer.Option(None, help="rows per request and per model run "
                                                       "(default: requests up to the largest "
                                                       "batch bucket, joined into runs as far "
                                                       "as the artifact's timings show "
                                                       "batching pays, and not at all where "
                                                       "requests overlap (--workers); 1: no "
                                                       "batching)"),
    max_queue_delay_ms: float = typer.Option(0.0, help="how long the oldest request may wait "
                                                       "for a fuller batch (0: batch what is "
                                                       "queued when the model is free)"),
    shadow_fraction: float = typer.Option(0.0, help="share of requests also run on the "
                                                    "original and compared (metrics)"),
    workers: Optional[int] = typer.Option(
        None, help="model runs at a time (default: on a CPU, for a model under 1 GiB that is "
                   "not a decoder, as many as the runtime's threads, a run that starts beside "
                   "another taking a one-thread session of its own (the model's weights a "
                   "second time) while a lone request still gets every thread; else 1)"),
    pad_to: str = typer.Option("auto", help="pad batches to their sequence 'bucket', or only "
                                            "to the 'longest' request in the batch; 'auto': "
                                            "longest on CPU backends, bucket elsewhere"),
    allow_batch_variance: bool = typer.Option(
        False, "--allow-batch-variance", help="batch requests and streams of a model whose outputs depend on what they "
                    "are batched with (ONNX Runtime's quantize_dynamic: one activation range "
                    "per run), for throughput; by default the server finds such a model by "
                    "running it and runs each request and stream alone, so that each is "
                    "what it is alone"),
    threads: Optional[int] = typer.Option(None, help="intra-op threads of the runtime "
                                                     "(default: as the artifact was timed, "
                                                     "at most the cores this process may "
                                                     "keep busy: its CPU affinity and its "
                                                     "container's CPU quota; 0: the "
                                                     "runtime's default)"),
    spin: Optional[bool] = typer.Option(None, "--spin/--no-spin",
                                        help="let the runtime's idle threads spin-wait for "
                                             "the next run: a little latency per run for "
                                             "CPU time that a busy machine's other work "
                                             "would have (default: as the artifact was "
                                             "timed, off)"),
    tls_cert: Optional[Path] = typer.Option(None, help="PEM certificate: serve TLS"),
    tls_key: Optional[Path] = typer.Option(None, help="PEM private key of --tls-cert"),
    token: Optional[str] = typer.Option(None, envvar="TUNER_SERVE_TOKEN",
                                        help="require 'authorization: Bearer TOKEN' on every "
                                             "call (or set TUNER_SERVE_TOKEN)"),
    max_message_mb: int = typer.Option(256, help="largest request or response, MiB"),
    drain_timeout_s: float = typer.Option(120.0, help="on SIGTERM, how long calls in flight "
                                                      "may take to finish"),
    max_streams: int = typer.Option(32, help="decoders: streams decoded together in one "
                                             "batch; more wait in the queue"),
    max_queued_streams: int = typer.Option(256, help="decoders: streams that may wait; beyond, "
                                                     "RESOURCE_EXHAUSTED"),
    max_tokens: int = typer.Option(1024, help="decoders: the most tokens a request may ask "
                                              "for"),
    max_cache_len: Optional[int] = typer.Option(None, help="decoders: longest cache (default: "
                                                           "the model's positions)"),
    roles: list[str] = roles_option(),
    kv_cache_bytes: Optional[int] = typer.Option(None, help="decoders: the KV cache's byte "
                                                            "budget; past it, the newest "
                                                            "stream is preempted and "
                                                            "recomputed later (default: 30% "
                                                            "of the memory available to this "
                                                            "process: its container's memory "
                                                            "limit where that leaves less than "
                                                            "the machine)"),
    prefill_tokens: int = typer.Option(256, help="decoders: tokens one step feeds (decode "
                                                 "rows and prompt chunks together); a longer "
                                                 "prompt is prefilled in chunks"),
    prefix_cache: bool = typer.Option(True, help="decoders: reuse the cached keys/values of a "
                                                 "prompt prefix that streams share"),
    max_stall: float = typer.Option(0.0, help="decoders: while streams decode, a step's "
                                               "prompt work costs at most this share of a "
                                               "decode step (measured), so new prompts delay "
                                               "the next token by at most that (even "
                                               "inter-token times, at a cost in throughput "
                                               "and first tokens); 0 (default): no bound "
                                               "but --prefill-tokens"),
    speculate: int = typer.Option(3, help="decoders: while one stream decodes alone, up to "
                                          "N draft tokens a step, guessed from its own "
                                          "earlier tokens (prompt lookup: a quoted passage, "
                                          "edited code, a repeated phrase) and checked in "
                                          "the same run: the same output, more tokens a run "
                                          "where the guesses hold; 0: off"),
    tool_call_parser: Optional[str] = typer.Option(
        None, help="decoders: how chat's tool_choice 'auto' reads the model's own tool calls "
                   "out of its text, as vLLM's parser of the name: 'hermes' "
                   "(<tool_call>{...}</tool_call>: Qwen 2.5 / 3, Hermes), 'mistral' "
                   "([TOOL_CALLS]...), 'llama3_json' (Llama 3.1 - 3.3: the output is the "
                   "call's JSON). Without it 'auto' is refused; 'required' and a named "
                   "function work with any model"),
    reasoning_parser: Optional[str] = typer.Option(
        None, help="decoders: chat replies' thinking (<think>...</think>) apart from the "
                   "answer, as the message's 'reasoning', as vLLM's parser of the name: "
                   "'deepseek_r1' (DeepSeek-R1 and distills, QwQ: the prompt opens the "
                   "block) or 'qwen3' (Qwen3's hybrid models: thinks only when the reply "
                   "opens the block)"),
    generation_config: str = typer.Option(
        "auto", help="decoders: 'auto': the OpenAI-compatible APIs (and Anthropic's) sample "
                     "with the model creator's settings in generation_config.json "
                     "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) "
                     "where a request names none, as vLLM does; 'none': with the APIs' own "
                     "defaults (temperature 1, no cut, no penalty)"),
) -> None:
    """Serve OUT's selected variant until SIGTERM: KServe v2 / Open Inference Protocol over
    gRPC (--port) and HTTP/REST (--http-port), KServe V1 (/v1/models/NAME:predict) on the
    HTTP port, and for a decoder Triton's generate endpoints, an OpenAI-compatible API (/v1,
    and /openai/v1 as KServe's Hugging Face runtime serves it), Anthropic's Messages API (/v1/messages), Text
    Generation Inference's (/generate, /generate_stream) and Ollama's (/api/generate,
    /api/chat) on the HTTP port; for an encoder, OpenAI's embeddings, Text Embeddings
    Inference's API, Ollama's /api/embed and the rerank APIs, and by its kind a classifier's
    (TEI's /predict, vLLM's /classify, Triton's classification extension), a token
    classifier's, a masked LM's and a SPLADE model's (TEI's /embed_sparse); with Amazon
    SageMaker's /ping and /invocations (routed to those APIs by the body's keys). The log
    line that says the model is ready names its kind and APIs.

    Before reporting ready it re-runs the accuracy gate against the original on this machine
    and serves the original if the variant fails. Requests longer than the largest sequence
    bucket are refused with INVALID_ARGUMENT. An encoder-decoder folder (T5, BART, Marian;
    Whisper through OpenAI's /v1/audio/transcriptions) is generated from as it is (the
    decoder's names and APIs, streams batched in cohorts), once its with-past decoder is
    checked against its first-step decoder here."""
    import logging

    from tuner.artifact.store import read_manifest
    from tuner.graph.role_overrides import overriding, parse_roles
    from tuner.graph.seq2seq_record import is_seq2seq_folder, merged_only

    # here, not at the top: the other commands neither need the server nor fail with it
    try:
        from serving.engine import EngineOptions
        from serving.generation import GenerateOptions
        from serving.server import ServerOptions
        from serving.server import serve as run
    except Exception as e:  # noqa: BLE001 - a dependency's failure is one line (docstring)
        line = serving_import_error(e)
        if line is None:
            raise
        raise BadInput(line) from None
    logging.basicConfig(level=logging.WARNING, format="tuner serve: %(levelname)s %(message)s")
    why = merged_only(out)
    if why is not None:
        raise BadInput(why)
    try:
        engine = EngineOptions(max_batch, max_queue_delay_ms, shadow_fraction, workers,
                               pad_to=pad_to, batch_variance=allow_batch_variance)
        settings = _settings(out, threads, spin)
        generate = GenerateOptions(max_streams=max_streams, max_queue=max_queued_streams,
                                   max_tokens=max_tokens, max_cache_len=max_cache_len,
                                   kv_cache_bytes=kv_cache_bytes, prefill_tokens=prefill_tokens,
                                   prefix_cache=prefix_cache,
                                   max_stall=None if max_stall == 0 else max_stall,
                                   batch_variance=allow_batch_variance, speculate=speculate)
    except ValueError as e:
        raise BadInput(str(e)) from None
    options = ServerOptions(
        host=host, port=None if port < 0 else port,
        http_port=None if http_port < 0 else http_port,
        metrics_port=None if metrics_port < 0 else metrics_port,
        model_name=model_name, backend=backend, engine=engine, generate=generate,
        settings=settings,
        tls_cert=tls_cert, tls_key=tls_key, token=token,
        max_message_bytes=max_message_mb * 1024 * 1024, drain_timeout_s=drain_timeout_s,
        tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
        generation_config=generation_config)
    _check_before_binding(out, backend)
    # the manifest's role overrides (those optimize ran with), then this command's own
    saved = {} if is_seq2seq_folder(out) else read_manifest(out).roles or {}
    with overriding({**saved, **parse_roles(roles)}):
        code = run(out, options, say=_say)
    if code:
        raise typer.Exit(code)


def _check_before_binding(out: Path, backend: str | None) -> None:
    """Refuse a bad artifact, or a backend that cannot run here, before any port opens: the
    server binds first (live, not ready) and loads after, so these would otherwise show up
    only after "listening"."""

    from tuner.artifact.store import read_manifest
    from tuner.graph.seq2seq_record import find_seq2seq_record, is_seq2seq_folder
    from tuner.runtime.ort import CPU_BACKEND
    from tuner.runtime.registry import get_backend

    if is_seq2seq_folder(out):
        find_seq2seq_record(out)  # one a generation loop cannot feed: refused here, exit 2
    name = backend or (CPU_BACKEND.name if is_seq2seq_folder(out)
                       else read_manifest(out).backend)
    ok, reason = get_backend(name).available()
    if not ok:
        raise BadInput(f"backend {name} cannot run here: {reason}")
