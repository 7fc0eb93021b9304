"""Request files as users write them: the error names the format the file claims to be (an
empty .jsonl is not "a CSV without a header"), and a JSON array is refused with the two
shapes the file may take."""

from __future__ import annotations

import pytest

from tuner.errors import BadInput
from tuner.measure.buckets import load_requests


@pytest.mark.parametrize("name, text, message", [
    ("empty.jsonl", "", "no requests in the file (it is empty)"),
    ("blank.jsonl", "\n  \n", "no requests in the file (it is empty)"),
    ("empty.csv", "", "no requests in the file (it is empty)"),
    ("arr.json", "[1, 2, 3]", "not a JSON list"),
    ("bad.jsonl", "seq,batch\n5,1\n", "line 1: not JSON"),
])
def test_bad_request_files_name_their_format(tmp_path, name, text, message):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(BadInput, match=None) as e:
        load_requests(p)
    assert message in str(e.value) and "CSV" not in str(e.value)


@pytest.mark.parametrize("name, text, count, max_batch, max_seq", [
    ("one.json", '{"seq": 5}', 1, 1, 5),
    ("lines.json", '{"seq": 5}\n{"seq": 9, "batch": 2}\n', 2, 2, 9),
    ("hist.json", '{"seq": {"8": 3, "20": 1}, "batch": {"1": 1, "4": 1}}', 4, 4, 20),
    ("t.jsonl", '{"seq": 7}\n\n{"batch": 3, "seq": 2}\n', 2, 3, 7),
    ("t.csv", "batch,seq\n1,4\n2,40\n", 2, 2, 40),
    ("noext", '{"seq": 5}\n{"seq": 6}\n', 2, 1, 6),
])
def test_documented_formats_load(tmp_path, name, text, count, max_batch, max_seq):
    p = tmp_path / name
    p.write_text(text)
    r = load_requests(p)
    assert (r.count, r.max_batch, r.max_seq) == (count, max_batch, max_seq)
