"""serving.batcher with a real ONNX Runtime session of an exported BERT: batched, padded
results equal each request's own unpadded run; limits, buckets, draining and failures."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from serving.batcher import Batcher, BatchPolicy, Layout
from serving.errors import InvalidArgument, Unavailable
from tuner.runtime.registry import get_backend

LAYOUT = Layout(("input_ids", "attention_mask"), "attention_mask", {"last_hidden_state": 1})


@pytest.fixture(scope="module")
def runner(reference_model):
    return get_backend("ort-cpu").load(reference_model("bert", "small", "torchscript"))


def _feeds(length: int, rows: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, 1000, (rows, length)).astype(np.int64),
            "attention_mask": np.ones((rows, length), np.int64)}


def _policy(max_batch=8, delay=0.2, buckets=(8, 16, 32)) -> BatchPolicy:
    return BatchPolicy(max_batch, delay, buckets)


def test_batched_padded_results_equal_unbatched_runs(runner) -> None:
    batcher = Batcher(runner.infer, LAYOUT, _policy())
    try:
        requests = [_feeds(n, rows, seed) for seed, (n, rows) in
                    enumerate([(3, 1), (7, 2), (5, 1), (8, 1), (1, 3)])]
        futures = [batcher.submit(f) for f in requests]
        results = [f.result(30) for f in futures]
    finally:
        batcher.close()
    assert max(r.batch_rows for r in results) > 1  # they did share a run
    assert {r.padded_to for r in results} == {8}
    for feeds, result in zip(requests, results):
        got = result.outputs["last_hidden_state"]
        want = runner.infer(feeds)["last_hidden_state"]
        assert got.shape == want.shape  # cut back to the request's own rows and length
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


def test_max_batch_is_respected_and_every_request_answered(runner) -> None:
    batcher = Batcher(runner.infer, LAYOUT, _policy(max_batch=4, delay=0.3))
    try:
        futures = [batcher.submit(_feeds(4, seed=i)) for i in range(10)]
        results = [f.result(30) for f in futures]
    finally:
        batcher.close()
    assert all(r.batch_rows <= 4 for r in results)
    assert max(r.batch_rows for r in results) == 4


def test_buckets_are_not_mixed(runner) -> None:
    batcher = Batcher(runner.infer, LAYOUT, _policy(delay=0.1))
    try:
        short, long = batcher.submit(_feeds(5)), batcher.submit(_feeds(20, seed=1))
        a, b = short.result(30), long.result(30)
    finally:
        batcher.close()
    assert (a.padded_to, b.padded_to) == (8, 32)
    assert a.batch_rows == b.batch_rows == 1
    assert a.outputs["last_hidden_state"].shape == (1, 5, 64)


def test_without_a_mask_only_equal_lengths_share_a_run(runner) -> None:
    layout = Layout(("input_ids", "attention_mask"), None, {"last_hidden_state": 1})
    batcher = Batcher(runner.infer, layout, _policy(delay=0.3))
    try:
        futures = [batcher.submit(_feeds(n, seed=i)) for i, n in enumerate([5, 6, 5])]
        results = [f.result(30) for f in futures]
    finally:
        batcher.close()
    assert [r.padded_to for r in results] == [5, 6, 5]
    assert [r.batch_rows for r in results] == [2, 1, 2]


def test_a_request_with_more_rows_than_a_run_joins_runs_alone(runner) -> None:
    batcher = Batcher(runner.infer, LAYOUT, _policy(max_batch=2, delay=0.1))
    try:
        big, small = batcher.submit(_feeds(4, rows=3)), batcher.submit(_feeds(4, seed=1))
        assert (big.result(30).batch_rows, small.result(30).batch_rows) == (3, 1)
        with pytest.raises(InvalidArgument, match="longer than the largest bucket 32"):
            batcher.submit(_feeds(33))
    finally:
        batcher.close()


def test_close_runs_everything_queued_then_refuses(runner) -> None:
    batcher = Batcher(runner.infer, LAYOUT, _policy(max_batch=64, delay=5.0))
    futures = [batcher.submit(_feeds(6, seed=i)) for i in range(6)]
    closer = threading.Thread(target=batcher.close)
    closer.start()  # closing must not wait out the 5 s delay, nor drop the queued requests
    closer.join(10)
    assert not closer.is_alive()
    assert all(f.done() and f.exception() is None for f in futures)
    with pytest.raises(Unavailable, match="shutting down"):
        batcher.submit(_feeds(6))


def test_a_failing_run_fails_its_requests_and_the_batcher_lives_on(runner) -> None:
    batcher = Batcher(runner.infer, LAYOUT, _policy(delay=0.1))
    try:
        bad = {k: v.astype(np.int32) for k, v in _feeds(4).items()}  # ORT refuses int32
        futures = [batcher.submit(bad), batcher.submit(bad)]
        for f in futures:
            with pytest.raises(Exception, match="(?i)type"):
                f.result(30)
        good = batcher.submit(_feeds(4)).result(30)
    finally:
        batcher.close()
    assert good.outputs["last_hidden_state"].shape == (1, 4, 64)


def test_policy_and_layout_validation_messages() -> None:
    with pytest.raises(ValueError, match="max batch must be >= 1"):
        BatchPolicy(0, 0.0, (8,))
    with pytest.raises(ValueError, match="sequence buckets must be increasing"):
        BatchPolicy(1, 0.0, (16, 8))
    with pytest.raises(ValueError, match=r"max queue delay must be in \[0, 10\]"):
        BatchPolicy(1, -1.0, (8,))
    with pytest.raises(ValueError, match="mask input 'm' must be one of the sequence inputs"):
        Layout(("ids",), "m", {})
    with pytest.raises(ValueError, match="axis 0 is the batch"):
        Layout(("ids",), None, {"out": 0})


def test_with_no_delay_an_idle_model_runs_the_request_at_once(runner) -> None:
    batcher = Batcher(runner.infer, LAYOUT, _policy(delay=0.0))
    try:
        future = batcher.submit(_feeds(5))
        assert future.done()  # ran in the caller's thread: no hand-off to the worker
        result = future.result()
    finally:
        batcher.close()
    assert (result.batch_rows, result.padded_to) == (1, 8)
    np.testing.assert_allclose(result.outputs["last_hidden_state"],
                               runner.infer(_feeds(5))["last_hidden_state"], atol=1e-5, rtol=1e-4)


def test_with_no_delay_requests_arriving_while_the_model_is_busy_share_a_run(runner) -> None:
    def busy(feeds):  # each run 0.2 s longer: the model is busy when the others arrive,
        time.sleep(0.2)  # however a loaded machine schedules the 48 clients' threads
        return runner.infer(feeds)

    batcher = Batcher(busy, LAYOUT, _policy(max_batch=16, delay=0.0))
    requests = [_feeds(32, seed=i) for i in range(48)]
    results = [None] * len(requests)
    start = threading.Barrier(len(requests))  # all arrive together, while the first runs

    def client(i):
        start.wait(30)
        results[i] = batcher.submit(requests[i]).result(30)

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        batcher.close()
    assert all(r is not None for r in results)
    assert max(r.batch_rows for r in results) > 1
    for feeds, r in zip(requests, results):
        np.testing.assert_allclose(r.outputs["last_hidden_state"],
                                   runner.infer(feeds)["last_hidden_state"], atol=1e-5, rtol=1e-4)


def test_padding_to_the_longest_request_only(runner) -> None:
    policy = BatchPolicy(8, 0.2, (8, 16, 32), pad_to_bucket=False)
    batcher = Batcher(runner.infer, LAYOUT, policy)
    try:
        requests = [_feeds(n, seed=n) for n in (9, 12, 11)]  # all in bucket 16
        results = [f.result(30) for f in [batcher.submit(r) for r in requests]]
        alone = batcher.submit(_feeds(20)).result(30)
    finally:
        batcher.close()
    assert {r.padded_to for r in results} == {12} and results[0].batch_rows == 3
    assert alone.padded_to == 20  # a request alone runs at its own length
    for feeds, r in zip(requests, results):
        np.testing.assert_allclose(r.outputs["last_hidden_state"],
                                   runner.infer(feeds)["last_hidden_state"], atol=1e-5, rtol=1e-4)


def _lat(ms: float):
    from tuner.artifact.records import Latency

    return Latency(ms, ms, ms, ms, ms, 5)


def test_default_batch_limit_follows_the_artifacts_timings() -> None:
    from serving.engine import batch_limit

    # A batch of 4 costs 60% of four single runs, a batch of 8 costs more than eight.
    latency = {"1x16": _lat(10), "1x64": _lat(40), "4x16": _lat(24), "4x64": _lat(96),
               "8x16": _lat(90), "8x64": _lat(330)}
    assert batch_limit(latency, (1, 4, 8))[0] == 4
    # Nowhere cheaper: one at a time, and the note says why.
    slow = {"1x16": _lat(10), "4x16": _lat(41), "8x16": _lat(85)}
    limit, note = batch_limit(slow, (1, 4, 8))
    assert limit == 1 and "does not pay" in note and "4: 1.02" in note
    # No batch timings at all: trust the buckets.
    assert batch_limit({"1x16": _lat(10)}, (1, 4, 8)) == (8, "no batch timings in the "
                                                              "artifact: batching up to 8")


def test_a_full_queue_refuses_new_requests(runner) -> None:
    batcher = Batcher(runner.infer, LAYOUT, BatchPolicy(64, 5.0, (8, 16, 32), max_queue=2))
    try:
        queued = [batcher.submit(_feeds(4, seed=i)) for i in range(2)]
        with pytest.raises(Unavailable, match=r"the queue is full \(2 requests waiting\)") as e:
            batcher.submit(_feeds(4))
        assert e.value.retry_after_s == 1  # HTTP says it in Retry-After: room opens soon
    finally:
        batcher.close()  # the two queued ones still run
    assert all(f.result(10).outputs["last_hidden_state"].shape == (1, 4, 64) for f in queued)
