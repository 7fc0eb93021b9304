"""Timing statistics, interleaving, selection and the results cache (on real ORT sessions)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tuner.measure.bench import Target, measure
from tuner.measure.cache import ResultsCache, entry_key
from tuner.measure.select import select
from tuner.measure.stats import RatioCI, paired_ratio_ci, summarize, weighted_totals
from tuner.measure.timing import interleave
from tuner.runtime.registry import get_backend
from tuner.util.files import sha256_files
from tuner.util.progress import Progress


def test_summarize_percentiles():
    s = summarize(np.arange(1, 101, dtype=float))
    assert s.median == pytest.approx(50.5) and s.n == 100
    assert s.p10 < s.q1 < s.median < s.q3 < s.p90
    assert s.iqr == pytest.approx(49.5)
    with pytest.raises(ValueError, match="non-empty"):
        summarize([])
    with pytest.raises(ValueError, match="finite"):
        summarize([1.0, float("nan")])


def test_paired_ratio_ci_sees_a_real_speedup_through_drift():
    rng = np.random.default_rng(1)
    drift = np.linspace(10, 30, 40)  # the machine slows down 3x over the run
    base = drift * (1 + 0.02 * rng.standard_normal(40))
    fast = drift / 1.2 * (1 + 0.02 * rng.standard_normal(40))
    ci = paired_ratio_ci(base, fast)
    assert 1.15 < ci.low <= ci.ratio <= ci.high < 1.25
    # unpaired medians would be swamped by the drift: the spread of each alone is ~50%
    assert summarize(base).rel_spread > 0.4


def test_paired_ratio_ci_of_noise_contains_one():
    rng = np.random.default_rng(2)
    a = 10 * (1 + 0.05 * rng.standard_normal(30))
    b = 10 * (1 + 0.05 * rng.standard_normal(30))
    ci = paired_ratio_ci(a, b)
    assert ci.low < 1 < ci.high
    assert paired_ratio_ci(a, b) == ci  # seeded: reproducible


def test_paired_ratio_ci_rejects_bad_input():
    with pytest.raises(ValueError, match="one length"):
        paired_ratio_ci([1, 2], [1])
    with pytest.raises(ValueError, match="positive"):
        paired_ratio_ci([1, 0], [1, 1])


def test_weighted_totals():
    t = weighted_totals({(1, 8): np.array([1.0, 2.0]), (1, 16): np.array([3.0, 4.0])},
                        {(1, 8): 3, (1, 16): 1})
    assert t.tolist() == [1.5, 2.5]
    with pytest.raises(ValueError, match="positive weight"):
        weighted_totals({(1, 8): np.array([1.0])}, {(1, 8): 0})


def test_select_keeps_original_inside_the_margin():
    near = RatioCI(1.05, 1.02, 1.08, 0.95, 20)
    far = RatioCI(1.30, 1.20, 1.40, 0.95, 20)
    sel = select({"original": RatioCI(1, 1, 1, 0.95, 20), "a": near})
    assert sel.name == "original" and "nothing was faster beyond noise" in sel.reason
    assert select({"a": near, "b": far}).name == "b"
    assert select({"a": near, "b": far}, eligible=lambda n: n != "b").name == "original"
    assert select({"a": near}, margin=0.01).name == "a"
    assert select({}).name == "original"
    few = select({"b": RatioCI(1.30, 1.20, 1.40, 0.95, 3)})
    assert few.name == "original" and "too few paired rounds" in few.reason


def test_interleave_shuffles_each_round_and_times():
    order = []
    calls = [lambda k=k: order.append(k) for k in "ABC"]
    out = interleave(calls, rounds=40, warmup=1)
    assert out.shape == (3, 40) and np.all(out >= 0)
    assert "".join(order[:3]) == "ABC"  # warm-up in order
    rounds = ["".join(order[3 + 3 * r: 6 + 3 * r]) for r in range(40)]
    assert all(sorted(r) == list("ABC") for r in rounds)  # each callable once per round
    firsts = {r[0] for r in rounds}
    assert firsts == set("ABC")  # nobody always runs first
    assert {r[r.index("A") + 1] for r in rounds if r.index("A") < 2} == set("BC")  # nor follows A
    first_run = list(order)
    assert interleave(calls, rounds=5, seed=3).shape == (3, 5)
    again = []
    calls2 = [lambda k=k: again.append(k) for k in "ABC"]
    interleave(calls2, rounds=40, warmup=1)
    assert again == first_run  # seeded: the same order on a rerun


def _runner(path):
    return get_backend("ort-cpu").load(path)


def _feeds(shape, vocab=1000):
    b, s = shape
    rng = np.random.default_rng(0)
    return {"input_ids": rng.integers(0, vocab, (b, s), dtype=np.int64),
            "attention_mask": np.ones((b, s), dtype=np.int64)}


class Counting(Progress):
    def __init__(self):
        self.total, self.steps = None, []

    def start(self, total):
        self.total = total

    def advance(self, what):
        self.steps.append(what)


def test_measure_uses_cache_only_for_whole_groups(reference_model, tmp_path):
    gpt2, llama = reference_model("gpt2"), reference_model("llama")
    targets = [Target("original", _runner(gpt2), sha256_files([gpt2])),
               Target("other", _runner(llama), sha256_files([llama]))]
    shapes = [(1, 8), (2, 16)]
    args = dict(rounds=3, warmup=1, backend="ort-cpu", device="test", settings={"t": 1})
    cache = ResultsCache.in_dir(tmp_path)
    p = Counting()
    m = measure(targets, shapes, _feeds, cache=cache, progress=p, **args)
    assert p.total == len(p.steps) == 2 * 2 * (3 + 1)
    assert m.cached_shapes == () and m.samples[("other", (2, 16))].shape == (3,)
    assert m.speedup_at("other", (1, 8)).n == 3
    # tiny models are repeated within a sample, and times are reported per call
    assert 0 < m.stats("original", (1, 8)).median < 20
    assert m.speedup("other", {(1, 8): 1, (2, 16): 1}).n == 3

    # a fresh process would read the file: same samples, nothing re-measured
    again = ResultsCache.in_dir(tmp_path)
    p2 = Counting()
    m2 = measure(targets, shapes, _feeds, cache=again, progress=p2, **args)
    assert p2.total == 0 and m2.cached_shapes == tuple(shapes)
    assert np.array_equal(m2.samples[("other", (2, 16))], m.samples[("other", (2, 16))])

    # one entry missing: that shape is measured again for every target (pairs stay paired)
    key = entry_key(targets[1].graph_sha, "ort-cpu", "test", (2, 16),
                    {"t": 1, "min_sample_ms": 20.0}, 3, 1)
    del again.entries[key]
    p3 = Counting()
    m3 = measure(targets, shapes, _feeds, cache=again, progress=p3, **args)
    assert m3.cached_shapes == ((1, 8),) and p3.total == 2 * (3 + 1)
    assert not np.array_equal(m3.samples[("original", (2, 16))], m.samples[("original", (2, 16))])


def test_corrupt_cache_is_set_aside(tmp_path):
    (tmp_path / "bench-cache.json").write_text(json.dumps({"format": 1, "entries": {"k": {
        "samples_ms": [-1], "group": "g"}}}))
    c = ResultsCache.in_dir(tmp_path)
    assert c.entries == {} and (tmp_path / "bench-cache.corrupt").exists()
