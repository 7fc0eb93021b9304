"""Bucket choice from request distributions, and the three request file formats."""

from __future__ import annotations

import json

import pytest

from tuner.errors import BadInput
from tuner.measure.buckets import (Requests, batch_buckets, choose, default_seq_buckets,
                                   interpolate, load_requests, seq_grid, uniform_requests)


def linear_latency(b: int, s: int) -> float:
    """A cost model with a fixed overhead: padding wastes time, but so does nothing."""
    return 1.0 + 0.01 * b * s


def test_formats_agree(tmp_path):
    jl = tmp_path / "r.jsonl"
    jl.write_text('{"batch": 1, "seq": 10}\n{"seq": 10}\n\n{"batch": 2, "seq": 100}\n')
    cs = tmp_path / "r.csv"
    cs.write_text("batch,seq\n1,10\n1,10\n2,100\n")
    hist = tmp_path / "h.json"
    hist.write_text(json.dumps({"seq": {"10": 2, "100": 1}}))
    a, b, h = load_requests(jl), load_requests(cs), load_requests(hist)
    assert a.weights == b.weights == {(1, 10): 2.0, (2, 100): 1.0}
    assert a.count == 3 and a.max_batch == 2 and a.max_seq == 100
    assert h.weights == {(1, 10): 2.0, (1, 100): 1.0} and h.count == 3
    hb = tmp_path / "hb.json"
    hb.write_text(json.dumps({"seq": {"10": 3}, "batch": {"1": 1, "4": 1}}))
    assert load_requests(hb).weights == {(1, 10): 1.5, (4, 10): 1.5}


@pytest.mark.parametrize("name, text, msg", [
    ("a.jsonl", '{"batch": 1}\n', "expected an object like"),
    ("a.jsonl", '{"seq": -3}\n', "line 1: seq must be a positive integer"),
    ("a.jsonl", '{"seq": 4}\nnot json\n', "line 2: not JSON"),
    ("a.jsonl", '{"seq": true}\n', "seq must be a positive integer"),
    ("a.csv", "batch,length\n1,2\n", "needs a header with a 'seq' column"),
    ("a.csv", "seq\n12\nx\n", "line 3: seq must be a positive integer"),
    ("h.json", '{"seq": {"12": -1}}', "must be a number >= 0"),
    ("h.json", '{"seq": {"0": 3}}', "seq must be a positive integer"),
    ("h.json", '{"seq": {}}', "non-empty object"),
    ("e.csv", "seq\n", "no requests"),
])
def test_bad_request_files(tmp_path, name, text, msg):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(BadInput, match=msg):
        load_requests(p)


def test_missing_file(tmp_path):
    with pytest.raises(BadInput, match="no such requests file"):
        load_requests(tmp_path / "nope.jsonl")


def test_grids():
    assert batch_buckets(1) == (1,) and batch_buckets(5) == (1, 2, 4, 8)
    assert default_seq_buckets(256) == (64, 128, 192, 256)
    assert default_seq_buckets(200) == (64, 128, 192, 200)
    assert default_seq_buckets(32) == (8, 16, 32)
    req = Requests({(1, 20): 5, (1, 300): 1}, "t", 6)
    g = seq_grid(req, limit=1024)
    assert g[-1] == 304 and g == tuple(sorted(g)) and len(g) <= 8
    with pytest.raises(BadInput, match="longer than the model's maximum 256"):
        seq_grid(req, limit=256)


def test_choice_beats_padding_and_covers():
    # most requests short, a few long: two buckets beat padding everything to the top
    req = Requests({(1, 12): 90, (1, 200): 10}, "t", 100)
    grid = (16, 32, 64, 128, 256)
    c = choose(req, linear_latency, batch=(1,), grid=grid, max_buckets=3)
    assert c.seq[-1] >= 200 and 16 in c.seq
    assert c.expected_ms < c.pad_to_max_ms
    assert c.expected_ms == pytest.approx(0.9 * linear_latency(1, 16) + 0.1 * linear_latency(1, 256))
    assert sum(c.coverage.values()) == pytest.approx(1.0)
    # with one bucket allowed, it must be the top one
    one = choose(req, linear_latency, batch=(1,), grid=grid, max_buckets=1)
    assert one.seq == (256,) and one.expected_ms == pytest.approx(one.pad_to_max_ms)


def test_choice_prefers_fewer_buckets_within_tolerance():
    # latency flat below 128: more buckets buy nothing, one bucket is kept
    flat = {(1, s): 5.0 if s <= 128 else 9.0 for s in (32, 64, 128, 256)}
    req = Requests({(1, 20): 1, (1, 100): 1}, "t", 2)
    c = choose(req, flat, batch=(1,), grid=(32, 64, 128, 256))
    assert c.seq == (128,) and c.expected_ms == pytest.approx(5.0)
    assert c.pad_to_max_ms == pytest.approx(9.0)


def test_batch_buckets_and_no_bucket_interpolation():
    req = Requests({(3, 40): 1}, "t", 1)
    lat = {(b, s): linear_latency(b, s) for b in (1, 2, 4) for s in (32, 64)}
    c = choose(req, lat, batch=(1, 2, 4), grid=(32, 64))
    assert c.batch[-1] == 4 and c.seq == (64,)
    assert c.expected_ms == pytest.approx(linear_latency(4, 64))
    # at its own shape: interpolated in seq at batch 2 and 4, then in batch
    assert c.no_buckets_ms == pytest.approx(interpolate(lat, 3, 40))
    assert interpolate(lat, 2, 48) == pytest.approx(linear_latency(2, 48))


def test_uniform_default():
    req = uniform_requests(256)
    c = choose(req, linear_latency, batch=(1,), grid=default_seq_buckets(256), max_buckets=4)
    assert c.seq[-1] == 256 and c.expected_ms < c.pad_to_max_ms
