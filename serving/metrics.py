"""Counters the server keeps, exposed two ways: Prometheus text on the metrics port (Triton's
metric names, so existing dashboards work) and the ModelStatistics RPC (perf_analyzer reads
it). One thread-safe `Stats` per model is the source for both. No grpc here."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import Metric
from prometheus_client.metrics import MetricWrapperBase

_UNTYPED = "unknown"  # written as "# TYPE name untyped"
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float, n: int = 1) -> None:
        self.count += n
        self.ns += int(seconds * 1e9) * n


@dataclass
class Stats:
    """Per-model totals (Triton's meaning: one request may hold several rows)."""

    success: Duration = field(default_factory=Duration)  # request duration, end to end
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    inference_count: int = 0  # rows answered
    execution_count: int = 0  # batches run
    last_inference_ms: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # reason -> count
    batches: dict[int, Duration] = field(default_factory=dict)  # rows -> compute time
    shadow: dict[str, int] = field(default_factory=lambda: {"agree": 0, "disagree": 0,
                                                            "skipped": 0})
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record_success(self, total_s: float, queue_s: float, compute_s: float, rows: int) -> None:
        with self.lock:
            self.success.add(total_s)
            self.queue.add(queue_s)
            self.compute_infer.add(compute_s)
            self.inference_count += rows
            self.last_inference_ms = int(time.time() * 1e3)

    def record_failure(self, reason: str, total_s: float) -> None:
        with self.lock:
            self.fail.add(total_s)
            self.failures[reason] = self.failures.get(reason, 0) + 1

    def record_batch(self, rows: int, compute_s: float) -> None:
        with self.lock:
            self.execution_count += 1
            self.batches.setdefault(rows, Duration()).add(compute_s)

    def record_shadow(self, result: str) -> None:
        with self.lock:
            self.shadow[result] = self.shadow.get(result, 0) + 1


class _TritonCollector:
    """Triton's counters, with Triton's exact names. They are exposed untyped: prometheus_client
    writes every counter's name with a `_total` suffix, which Triton's names do not have, and
    rate() works the same on untyped series."""

    def __init__(self, stats: Stats, model: str, version: str) -> None:
        self.stats, self.labels = stats, {"model": model, "version": version}

    def _counter(self, name: str, doc: str, value: float, extra: dict | None = None) -> Metric:
        m = Metric(name, doc, _UNTYPED)
        m.add_sample(name, {**self.labels, **(extra or {})}, value)
        return m

    def collect(self):
        s = self.stats
        with s.lock:
            yield self._counter("nv_inference_request_success",
                                "Number of successful inference requests, all batch sizes",
                                s.success.count)
            fail = Metric("nv_inference_request_failure",
                          "Number of failed inference requests, all batch sizes", _UNTYPED)
            for reason, n in sorted(s.failures.items()) or [("REJECTED", 0)]:
                fail.add_sample("nv_inference_request_failure", {**self.labels,
                                                                  "reason": reason}, n)
            yield fail
            yield self._counter("nv_inference_count",
                                "Number of inferences performed (rows, not requests)",
                                s.inference_count)
            yield self._counter("nv_inference_exec_count",
                                "Number of model executions performed (batches)",
                                s.execution_count)
            yield self._counter("nv_inference_request_duration_us",
                                "Cumulative inference request duration in microseconds",
                                s.success.ns / 1e3)
            yield self._counter("nv_inference_queue_duration_us",
                                "Cumulative inference queuing duration in microseconds",
                                s.queue.ns / 1e3)
            yield self._counter("nv_inference_compute_infer_duration_us",
                                "Cumulative compute inference duration in microseconds",
                                s.compute_infer.ns / 1e3)
            shadow = Metric("tuner_shadow_checks", "Sampled requests re-run on the original "
                            "model and compared: agree, disagree, skipped (shadow busy)",
                            _UNTYPED)
            for result, n in sorted(s.shadow.items()):
                shadow.add_sample("tuner_shadow_checks", {**self.labels, "result": result}, n)
            yield shadow


@dataclass
class Metrics:
    """A private registry (several servers may live in one process, e.g. in tests)."""

    registry: CollectorRegistry
    batch_size: Histogram
    padding: Counter

    def observe_batch(self, rows: int) -> None:
        self.batch_size.observe(rows)


def make_metrics(stats: Stats, model: str, version: str) -> Metrics:
    disable_created_metrics()  # the *_created series double the output and no one reads them
    registry = CollectorRegistry()
    registry.register(_TritonCollector(stats, model, version))
    batch = Histogram("tuner_batch_size", "Rows per model execution (dynamic batching)",
                      ["model", "version"], buckets=BATCH_BUCKETS, registry=registry)
    padding = Counter("tuner_padded_tokens", "Token positions added by padding to buckets",
                      ["model", "version"], registry=registry)
    return Metrics(registry, batch.labels(model, version), padding.labels(model, version))


# Seconds: a first token waits for a prefill (tens of ms to seconds); tokens follow every
# decode step (milliseconds to a few hundred).
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


END_REASONS = ("stop", "length", "cancelled", "shutdown", "error")  # how a stream ends


@dataclass(frozen=True)
class GenerationMetrics:
    """A decoder's series (serving.generation): tokens, first-token, inter-token and whole-
    stream latency, streams running, queued and finished (by reason), the cache's use, prompt
    tokens looked up in / served from the prefix cache (their ratio is the hit rate),
    preemptions, speculative runs with their draft and accepted tokens (their ratio is the
    acceptance rate); rows per step go to `tuner_batch_size`. Bound to one model."""

    tokens: Counter
    prompt_tokens: Counter
    first_token: Histogram
    inter_token: Histogram
    request_latency: Histogram
    active: Gauge
    queued: Gauge
    cache_usage: Gauge
    prefix_looked_up: Counter
    prefix_hit: Counter
    preempted: Counter
    drafts: Counter
    draft_tokens: Counter
    accepted_tokens: Counter
    finished: Callable[[str], Counter]  # reason -> its counter
    cache_config: Callable[[int, int], None]  # (prefix block, blocks in the budget)


def add_generation_metrics(metrics: Metrics, model: str, version: str) -> GenerationMetrics:
    r, labels = metrics.registry, ["model", "version"]
    families: dict[str, MetricWrapperBase] = {}

    def made(kind, name: str, doc: str, extra: Sequence[str] = (), **kw):
        families[name] = kind(name, doc, [*labels, *extra], registry=r, **kw)
        return families[name] if extra else families[name].labels(model, version)

    finished = made(Counter, "tuner_finished_streams", "Streams ended, by reason: stop, "
                    "length, cancelled, shutdown, error", ["reason"])
    for reason in END_REASONS:  # every series from the start: a rate needs its first 0
        finished.labels(model, version, reason)
    config = made(Gauge, "tuner_kv_cache_config", "The cache's prefix block (tokens) and how "
                  "many such blocks its byte budget holds (always 1)", ["block_size", "blocks"])
    r.register(_VllmView(families))
    return GenerationMetrics(
        tokens=made(Counter, "tuner_generated_tokens", "Tokens generated (all streams)"),
        prompt_tokens=made(Counter, "tuner_prompt_tokens", "Prompt tokens of the streams "
                           "that reached their first token (prefix cache hits included)"),
        first_token=made(Histogram, "tuner_time_to_first_token_seconds", "From a stream's "
                         "arrival to its first token (queue + prefill)",
                         buckets=LATENCY_BUCKETS),
        inter_token=made(Histogram, "tuner_inter_token_latency_seconds", "Between two tokens "
                         "of one stream", buckets=LATENCY_BUCKETS),
        request_latency=made(Histogram, "tuner_stream_duration_seconds", "From a stream's "
                             "arrival to its end", buckets=LATENCY_BUCKETS),
        active=made(Gauge, "tuner_active_streams", "Streams being decoded (in the batch)"),
        queued=made(Gauge, "tuner_queued_streams", "Streams waiting for a slot"),
        cache_usage=made(Gauge, "tuner_kv_cache_usage_ratio", "Share of the cache's byte "
                         "budget that running streams hold (0..1; the prefix cache's blocks, "
                         "evicted on demand, not counted)"),
        prefix_looked_up=made(Counter, "tuner_prefix_cache_lookup_tokens", "Prompt tokens "
                              "looked up in the prefix cache"),
        prefix_hit=made(Counter, "tuner_prefix_cache_hit_tokens", "Prompt tokens whose "
                        "keys/values came from the prefix cache"),
        preempted=made(Counter, "tuner_preempted_streams", "Streams preempted (cache budget) "
                       "and recomputed"),
        drafts=made(Counter, "tuner_spec_drafts", "Speculative runs (a stream's drafts "
                    "checked in one run)"),
        draft_tokens=made(Counter, "tuner_spec_draft_tokens", "Draft tokens proposed (prompt "
                          "lookup)"),
        accepted_tokens=made(Counter, "tuner_spec_accepted_tokens", "Draft tokens accepted "
                             "(each one a decode run saved)"),
        finished=lambda reason: finished.labels(model, version, reason),
        cache_config=lambda block, blocks: config.labels(model, version, str(block),
                                                         str(blocks)).set(1))


# The same series under vLLM's names, so that what reads a vLLM server's /metrics reads ours
# unchanged: an inference gateway's endpoint picker (queue, running, cache use, block size),
# autoscalers on the queue, vLLM's dashboards, AIPerf's server-side summary. One home for each
# fact: these are the tuner_* series above, renamed when scraped.
_VLLM_NAMES = {
    "tuner_active_streams": ("vllm:num_requests_running",),
    "tuner_queued_streams": ("vllm:num_requests_waiting",),
    "tuner_kv_cache_usage_ratio": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "tuner_kv_cache_config": ("vllm:cache_config_info",),
    "tuner_prompt_tokens": ("vllm:prompt_tokens",),
    "tuner_generated_tokens": ("vllm:generation_tokens",),
    "tuner_finished_streams": ("vllm:request_success",),
    "tuner_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "tuner_inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",),
    "tuner_stream_duration_seconds": ("vllm:e2e_request_latency_seconds",),
    "tuner_preempted_streams": ("vllm:num_preemptions",),
    "tuner_prefix_cache_lookup_tokens": ("vllm:prefix_cache_queries",),
    "tuner_prefix_cache_hit_tokens": ("vllm:prefix_cache_hits",),
    "tuner_spec_drafts": ("vllm:spec_decode_num_drafts",),
    "tuner_spec_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "tuner_spec_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
}
# vLLM's labels: the model as `model_name`, a stream's end as `finished_reason` (an end
# before the stream's own stop or length is an abort there)
_VLLM_LABELS = {"model": "model_name", "reason": "finished_reason",
                "blocks": "num_gpu_blocks"}
_VLLM_REASONS = {"cancelled": "abort", "shutdown": "abort"}


class _VllmView:
    """vLLM's names for a decoder's series (_VLLM_NAMES), read from them at each scrape."""

    def __init__(self, families: Mapping[str, MetricWrapperBase]) -> None:
        self.families = families

    def collect(self):
        for name, family in self.families.items():
            for metric in family.collect():
                for alias in _VLLM_NAMES[name]:
                    yield _renamed(metric, name, alias)


def _renamed(metric: Metric, name: str, alias: str) -> Metric:
    """`metric` as `alias`, its labels vLLM's; samples that become one (two reasons that are
    both an abort there) are summed."""
    values: dict[tuple, float] = {}
    for sample in metric.samples:
        labels = {_VLLM_LABELS.get(k, k): v for k, v in sample.labels.items() if k != "version"}
        if "finished_reason" in labels:
            labels["finished_reason"] = _VLLM_REASONS.get(labels["finished_reason"],
                                                          labels["finished_reason"])
        key = (alias + sample.name[len(name):], tuple(labels.items()))
        values[key] = values.get(key, 0.0) + sample.value
    out = Metric(alias, metric.documentation, metric.type)
    for (sample_name, labels), value in values.items():
        out.add_sample(sample_name, dict(labels), value)
    return out


def start_metrics_server(metrics: Metrics, host: str, port: int):
    """Serve /metrics over HTTP; returns (server, thread) for shutdown."""
    from prometheus_client import start_http_server

    return start_http_server(port, addr=host, registry=metrics.registry)


@dataclass
class EndpointMetrics:
    """Calls per protocol, endpoint and status, and their durations (for a stream: until
    its response starts)."""

    calls: Counter
    duration: Histogram
    registry: CollectorRegistry  # where they live, with every other metric of the server

    def observe(self, protocol: str, endpoint: str, status: str, seconds: float) -> None:
        self.calls.labels(protocol, endpoint, status).inc()
        self.duration.labels(protocol, endpoint).observe(seconds)


def add_endpoint_metrics(metrics: Metrics) -> EndpointMetrics:
    r = metrics.registry
    return EndpointMetrics(
        Counter("tuner_endpoint_requests", "Calls answered, per protocol, endpoint and status",
                ["protocol", "endpoint", "status"], registry=r),
        Histogram("tuner_endpoint_request_duration_seconds", "Time to answer a call (a "
                  "stream: to its first byte)", ["protocol", "endpoint"],
                  buckets=(0.0005, 0.001, 0.002, 0.005) + LATENCY_BUCKETS, registry=r), r)
