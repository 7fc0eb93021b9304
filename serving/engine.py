"""The engine behind the servicer: validate a request against the model, batch it, run it,
count it, and now and then shadow-check it on the original. No grpc here."""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from serving.batcher import Batcher, BatchPolicy, Result
from serving.datatypes import DATATYPES, datatype_of
from serving.errors import InvalidArgument, ServingError, Unavailable
from serving.kv import check_cache_feeds
from serving.metrics import Metrics, Stats
from serving.overlap import OverlapRunner
from serving.model import LoadedModel, TensorSpec
from tuner.artifact.records import Latency, parse_shape_key
from tuner.gate.float_reference import ORIGINAL, SERVED
from tuner.gate.verify import Tolerance, kept_positions
from tuner.graph.roles import ATTENTION_MASK, mask_in, with_role

log = logging.getLogger("serving")

VERSION = "1"
_SHADOW_BACKLOG = 4  # shadow runs waiting at most; beyond, a sample is skipped, not queued


@dataclass(frozen=True)
class EngineOptions:
    # rows per request and per run; None: requests up to the largest batch bucket, joined
    # into runs as far as the artifact's timings show it pays (batch_limit)
    max_batch: int | None = None
    max_queue_delay_ms: float = 0.0  # 0: batch whatever is queued when the model is free
    shadow_fraction: float = 0.0  # share of requests re-run on the original and compared
    # model runs at a time; None: as many as the model's runner takes (an OverlapRunner: the
    # runtime's threads, each run beside another on one thread), else 1
    workers: int | None = None
    max_queue: int = 4096
    # "bucket": pad batches to their sequence bucket; "longest": only to the longest request
    # in the batch (a lone request runs unpadded); "auto": longest on CPU backends, where
    # any shape runs and every padded token costs time, bucket elsewhere.
    pad_to: str = "auto"
    # True: pad and join the requests of a model whose outputs depend on their neighbours
    # (quantize_dynamic) all the same; False (default): such requests run alone, unpadded
    batch_variance: bool = False

    def __post_init__(self) -> None:
        if self.max_batch is not None and not 1 <= self.max_batch <= 4096:
            raise ValueError(f"max batch must be in [1, 4096], not {self.max_batch}")
        if not 0 <= self.max_queue_delay_ms <= 10_000:
            raise ValueError(f"max queue delay must be in [0, 10000] ms, not "
                             f"{self.max_queue_delay_ms}")
        if not 0 <= self.shadow_fraction <= 1:
            raise ValueError(f"shadow fraction must be in [0, 1], not {self.shadow_fraction}")
        if self.pad_to not in ("auto", "bucket", "longest"):
            raise ValueError(f"pad_to must be auto, bucket or longest, not {self.pad_to!r}")
        if self.workers is not None and not 1 <= self.workers <= 64:
            raise ValueError(f"workers must be in [1, 64], not {self.workers}")


def batch_limit(latency: Mapping[str, Latency], batch_buckets: Sequence[int],
                margin: float = 0.05) -> tuple[int, str]:
    """The default max batch, from the artifact's own timings: the largest batch bucket b at
    which a batch costs less per request than b single runs (median over the sequence
    lengths timed at both batch 1 and b, by at least `margin`). Batching is not free on
    every machine: on a small CPU a batch of 8 can cost more than 8 single runs."""
    top = max(batch_buckets)
    timed = {parse_shape_key(k): v.median_ms for k, v in latency.items()}
    single = {s: t for (b, s), t in timed.items() if b == 1 and t > 0}
    best, seen, ratios = 1, False, []
    for b in sorted(x for x in batch_buckets if x > 1):
        pairs = [timed[(b, s)] / b / single[s] for s in single if (b, s) in timed]
        if not pairs:
            continue
        seen = True
        ratio = float(np.median(pairs))
        ratios.append(f"{b}: {ratio:.2f}")
        if ratio <= 1 - margin:
            best = b
    if not seen:
        return top, f"no batch timings in the artifact: batching up to {top}"
    verdict = (f"batching up to {best} pays" if best > 1
               else "batching does not pay here: requests run one at a time")
    return best, (f"{verdict} (time per request in a batch / alone, by batch size: "
                  f"{', '.join(ratios)}; a batch size pays at <= {1 - margin:.2f})")


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(int(d)) for d in shape) + "]"


def shadow_tolerance(model: LoadedModel, base: Tolerance) -> Tolerance:
    """What a shadow check allows between a served result and the original's: the gate's
    tolerances at the model's precision; and for a variant the gate held to a half-precision
    original's float model (tuner.gate.float_reference), each output within twice the
    distance the gate measured between the two through it (the variant's from the float
    model plus the original's): they round differently, by design."""
    tol = base.at_precision(model.signature.precision)
    rows = {o.name: o for o in (model.gate.outputs if model.gate is not None else ())}
    wider = []
    for name, row in rows.items():
        output = name[len(SERVED):]
        if name.startswith(SERVED) and ORIGINAL + output in rows:
            wider.append((output, 2 * (row.max_abs + rows[ORIGINAL + output].max_abs), tol.rtol))
    return dataclasses.replace(tol, per_output=(*wider, *tol.per_output)) if wider else tol


class Engine:
    def __init__(self, model: LoadedModel, options: EngineOptions, stats: Stats,
                 metrics: Metrics | None = None, tolerance: Tolerance = Tolerance()) -> None:
        self.model, self.options, self.stats, self.metrics = model, options, stats, metrics
        # runs the model's runner lets overlap, each on one thread (serving.overlap); None: one
        overlapping = model.runner.workers if isinstance(model.runner, OverlapRunner) else None
        self.name, self.version = model.name, VERSION
        # Two limits: rows one request may carry (the artifact's largest batch bucket, or
        # --max-batch), and rows the batcher may join from several requests (what the
        # artifact's timings show pays, or --max-batch).
        if options.max_batch is not None:
            self.max_batch = self.join_rows = options.max_batch
            self.batch_note = "set by the user"
        else:
            self.max_batch = max(model.buckets.batch)
            self.join_rows, self.batch_note = batch_limit(model.latency, model.buckets.batch)
        if model.cache is not None:  # each request brings its own past: never joined
            self.join_rows, self.batch_note = 1, "a KV-cache model: each request runs alone"
        elif options.max_batch is None and overlapping:
            # The timings compare a batch with single runs on every thread, at equal
            # lengths; here requests that meet overlap on one-thread sessions instead, and a
            # batch would pad its rows to the longest. MiniLM on 2 cores, lengths 8-128, 32
            # clients: 112 req/s overlapping, 83 with batches of up to 16 that its timings
            # said pay (bench/serve_throughput.py).
            self.join_rows, self.batch_note = 1, ("requests that meet run side by side "
                                                  "instead; --max-batch N batches them")
        apart = model.layout.rows_apart or options.batch_variance
        if not apart:  # exactness before batching: each request alone
            self.join_rows, self.batch_note = 1, (
                "a request's outputs change when it is padded and joined with others (its "
                "activations quantized with one range per run): requests are never joined; "
                "--allow-batch-variance joins them")
        fixed = model.signature.fixed_batch
        if fixed is not None and (self.max_batch != fixed or self.join_rows != 1):
            # a graph that takes one batch size only: requests of that many rows, never joined
            self.max_batch, self.join_rows = fixed, 1
            self.batch_note = f"the model takes batch {fixed} only: requests are never joined"
        self.tolerance = shadow_tolerance(model, tolerance)
        self._inputs = {s.name: s for s in model.signature.inputs}
        self._outputs = [s.name for s in model.signature.outputs]
        pad_to = options.pad_to
        if pad_to == "auto":
            pad_to = "longest" if model.backend.endswith("cpu") else "bucket"
        self.pad_to = pad_to if apart else "longest"
        policy = BatchPolicy(self.join_rows, options.max_queue_delay_ms / 1e3,
                             tuple(model.buckets.seq), options.max_queue,
                             pad_to_bucket=pad_to == "bucket")
        self.workers = options.workers or overlapping or 1
        self.batcher = Batcher(model.runner.infer, model.layout, policy,
                               on_batch=self._on_batch, workers=self.workers)
        self._shadow = (ThreadPoolExecutor(1, thread_name_prefix="shadow")
                        if options.shadow_fraction > 0 else None)
        self._shadow_backlog = 0
        self._lock = threading.Lock()
        self._random = random.Random(0)

    # --------------------------------------------------------------------------- validation

    def _check_names(self, feeds: Mapping[str, np.ndarray]) -> None:
        for name in feeds:
            if name not in self._inputs:
                raise InvalidArgument(f"unexpected inference input '{name}' for model "
                                      f"'{self.name}'")
        missing = [n for n in self._inputs if n not in feeds]
        if missing:
            raise InvalidArgument(
                f"expected {len(self._inputs)} inputs but got {len(feeds)} inputs for model "
                f"'{self.name}'; missing required input(s) {missing}")

    def _check_tensor(self, spec: TensorSpec, array: np.ndarray) -> None:
        if array.dtype != DATATYPES[spec.datatype]:
            raise InvalidArgument(f"inference input '{spec.name}' data-type is "
                                  f"'{datatype_of(array.dtype)}', but model '{self.name}' "
                                  f"expects '{spec.datatype}'")
        bad = array.ndim != len(spec.shape) or any(
            d != -1 and d != got for d, got in zip(spec.shape, array.shape)) or (
            array.size == 0 and not self._may_be_empty(spec.name))
        if bad:
            raise InvalidArgument(f"unexpected shape for input '{spec.name}' for model "
                                  f"'{self.name}'. Expected {_shape_text(spec.shape)}, got "
                                  f"{_shape_text(array.shape)}")

    def _may_be_empty(self, name: str) -> bool:
        """A cache model's past is empty on the first step (past length 0)."""
        return self.model.cache is not None and name in self.model.cache.past

    def _check_batch_and_length(self, feeds: Mapping[str, np.ndarray]) -> None:
        rows = {int(a.shape[0]) for a in feeds.values() if a.ndim}
        if len(rows) > 1:
            raise InvalidArgument(f"inputs of model '{self.name}' disagree on the batch size: "
                                  + ", ".join(f"'{n}' {_shape_text(a.shape)}"
                                              for n, a in feeds.items()))
        if rows and max(rows) > self.max_batch:
            raise InvalidArgument(f"inference request batch-size must be <= {self.max_batch} "
                                  f"for '{self.name}'")
        seq = self.model.layout.seq_inputs
        lengths = {int(feeds[n].shape[1]) for n in seq}
        if len(lengths) > 1:
            raise InvalidArgument(f"inputs of model '{self.name}' disagree on the sequence "
                                  "length: " + ", ".join(f"'{n}' {_shape_text(feeds[n].shape)}"
                                                         for n in seq))
        top = self.model.buckets.seq[-1]
        if lengths and max(lengths) > top:
            raise InvalidArgument(
                f"sequence length {max(lengths)} is longer than the largest bucket {top} "
                f"model '{self.name}' is served with (longer requests are refused, not run "
                "unpadded: the artifact was checked and timed only up to its buckets)")

    def _check_tokens(self, feeds: Mapping[str, np.ndarray]) -> None:
        """Every input that indexes a table (token ids, whatever the input is called;
        positions; token types) must stay inside it: ONNX's Gather wraps a negative index
        silently and fails on one past the end."""
        sig = self.model.signature
        limits = dict(sig.index_limits)
        if sig.token_input is not None and sig.vocab_size is not None:
            limits[sig.token_input] = sig.vocab_size
        for name, rows in limits.items():
            ids = feeds.get(name)
            if ids is None or ids.size == 0 or ids.dtype.kind not in "iu":
                continue
            # One unsigned comparison finds both kinds of bad id (negatives wrap to huge
            # values); where the first one is, is worked out only for the error message.
            unsigned = ids.view(f"u{ids.dtype.itemsize}") if ids.dtype.kind == "i" else ids
            if unsigned.max() >= rows:
                where = tuple(int(i) for i in np.argwhere((ids < 0) | (ids >= rows))[0])
                what = ("token id" if name == sig.token_input else "index")
                table = ("the vocabulary" if name == sig.token_input else "the table")
                raise InvalidArgument(f"input '{name}' holds {what} {int(ids[where])} at "
                                      f"{list(where)}, outside {table} [0, {rows}) of model "
                                      f"'{self.name}'")

    def _check_right_padding(self, feeds: Mapping[str, np.ndarray]) -> None:
        """A graph whose fused Attention reads the mask as each row's length (Optimum's
        O1-O4 copies) would answer a left-padded or holed row wrongly, without a word."""
        sig = self.model.signature
        spec = with_role(sig.specs, ATTENTION_MASK) if sig.lengths_mask else None
        mask = feeds.get(spec.name) if spec is not None else None
        if mask is None or mask.ndim != 2:
            return
        rows = np.flatnonzero((np.diff((mask != 0).astype(np.int8), axis=1) > 0).any(axis=1))
        if rows.size:
            raise InvalidArgument(
                f"row {int(rows[0])} of input '{spec.name}' is padded on the left or has "
                f"holes: model '{self.name}' reads the mask as each row's count of ones (its "
                f"fused {sig.lengths_mask}), so only padding on the right gives its answer")

    def validate(self, feeds: Mapping[str, np.ndarray], outputs: Sequence[str]) -> None:
        """InvalidArgument, with a Triton-style message, for anything this model cannot run."""
        self._check_names(feeds)
        for name, array in feeds.items():
            self._check_tensor(self._inputs[name], array)
        self._check_batch_and_length(feeds)
        if self.model.cache is not None:
            check_cache_feeds(self.model.cache, feeds, self.name)
        self._check_tokens(feeds)
        self._check_right_padding(feeds)
        for name in outputs:
            if name not in self._outputs:
                raise InvalidArgument(f"unexpected inference output '{name}' for model "
                                      f"'{self.name}'")

    # ------------------------------------------------------------------------------ running

    def infer(self, feeds: Mapping[str, np.ndarray], outputs: Sequence[str] = ()
              ) -> tuple[dict[str, np.ndarray], Result]:
        """Validate, batch, run; the outputs asked for (all when none), in the asked order."""
        start = time.perf_counter()
        try:
            self.validate(feeds, outputs)
            result = self.batcher.run(feeds)
        except ServingError as e:
            reason = "REJECTED" if isinstance(e, Unavailable) else "OTHER"
            self.stats.record_failure(reason, time.perf_counter() - start)
            raise
        except Exception:
            self.stats.record_failure("BACKEND", time.perf_counter() - start)
            raise
        rows = int(next(iter(feeds.values())).shape[0])
        self.stats.record_success(time.perf_counter() - start, result.queue_s,
                                  result.compute_s, rows)
        if self.metrics is not None and result.padded_to:
            seq = self.model.layout.seq_inputs
            length = int(feeds[seq[0]].shape[1]) if seq else result.padded_to
            self.metrics.padding.inc(rows * (result.padded_to - length))
        self._maybe_shadow(feeds, result.outputs)
        names = list(outputs) or self._outputs
        return {n: result.outputs[n] for n in names}, result

    def _on_batch(self, rows: int, requests: int, compute_s: float) -> None:
        self.stats.record_batch(rows, compute_s)
        if self.metrics is not None:
            self.metrics.observe_batch(rows)

    # ------------------------------------------------------------------------------- shadow

    def _maybe_shadow(self, feeds: Mapping[str, np.ndarray], served: dict[str, np.ndarray]
                      ) -> None:
        if self._shadow is None or self._random.random() >= self.options.shadow_fraction:
            return
        with self._lock:
            if self._shadow_backlog >= _SHADOW_BACKLOG:
                self.stats.record_shadow("skipped")
                return
            self._shadow_backlog += 1
        self._shadow.submit(self._shadow_check, dict(feeds), served)

    def _shadow_check(self, feeds: dict[str, np.ndarray], served: dict[str, np.ndarray]) -> None:
        """Run the request alone, unpadded, on the original: it must agree with what the
        client got from the served variant through batching and padding."""
        try:
            reference = self.model.original.infer(feeds)
            mask = mask_in(feeds, self.model.signature.specs)
            agree = all(self._agrees(n, reference[n], served[n], mask) for n in served)
            self.stats.record_shadow("agree" if agree else "disagree")
            if not agree:
                log.warning("shadow check: the served result differs from the original's")
        except Exception:  # noqa: BLE001 - a shadow failure must never touch serving
            log.exception("shadow check failed to run")
            self.stats.record_shadow("disagree")
        finally:
            with self._lock:
                self._shadow_backlog -= 1

    def _agrees(self, name: str, ref: np.ndarray, got: np.ndarray, mask) -> bool:
        if ref.shape != got.shape:
            return False
        # positions the client masked out are not compared
        return self.tolerance(name, kept_positions(ref, mask), kept_positions(got, mask))

    def note(self) -> str:
        """One line for the log: how requests are taken and batched."""
        return (f"requests up to {self.max_batch} rows, {self.workers} at a time, dynamic "
                f"batching up to {self.join_rows} rows ({self.batch_note}), sequence buckets "
                f"{list(self.model.buckets.seq)}, padding to the {self.pad_to}")

    def close(self) -> None:
        """Run everything queued, then stop."""
        self.batcher.close()
        if self._shadow is not None:
            self._shadow.shutdown(wait=True)
