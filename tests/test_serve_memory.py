"""What a served decoder holds in memory: the gate before the server is ready holds one
session at a time (a cache model's rollouts recorded, its session let go before the variant
loads, as `pad` and `verify` do for plain models), and the shared cache buffers take memory
a page at a time as rows are written, not a 2 MiB huge page per row and tensor."""

from __future__ import annotations

import gc
import json
import re
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest

from serving_support import make_artifact, perturbed_copy
from tuner.gate.decode_step import lazy_zeros
from tuner.gate.entry import prepare
from tuner.gate.kv_gate import RecordedRollouts
from tuner.runtime.registry import get_backend


@pytest.fixture(scope="module")
def llama_kv(reference_model) -> Path:
    return reference_model("llama-kv", "awkward", "torchscript")


def test_a_cache_models_rollouts_are_recorded_and_its_session_let_go(llama_kv, tmp_path):
    """prepare() with a loader records the reference's rollouts and drops its session; the
    recorded gate passes the model itself, fails a perturbed copy, and reads as the live
    gate does (the same largest difference)."""
    cpu, sessions = get_backend("ort-cpu"), []

    def load():
        runner = cpu.load(llama_kv)
        sessions.append(weakref.ref(runner))
        return runner

    recorded = prepare(llama_kv, load)
    gc.collect()
    assert isinstance(recorded.reference, RecordedRollouts) and sessions[0]() is None
    assert recorded.reference.failure is None
    assert recorded.check(cpu.load(llama_kv))
    liar = cpu.load(perturbed_copy(llama_kv, tmp_path / "liar.onnx"))
    live = prepare(llama_kv, cpu.load(llama_kv)).check(liar)
    replayed = recorded.check(liar)
    assert not live and not replayed
    assert [o.max_abs for o in live.outputs] == [o.max_abs for o in replayed.outputs]


class _Counting:
    """The CPU backend, noting how many of its earlier sessions are open at each load."""

    def __init__(self) -> None:
        self.real, self.live, self.alive_at_load = get_backend("ort-cpu"), [], []
        self.name, self.precision = self.real.name, self.real.precision

    def load(self, *args, **kw):
        gc.collect()
        self.alive_at_load.append(sum(getattr(r(), "session", None) is not None
                                      for r in self.live))
        runner = self.real.load(*args, **kw)
        self.live.append(weakref.ref(runner))
        return runner


@pytest.mark.parametrize("shadow, alive", [(False, [0, 0]), (True, [0, 1])])
def test_the_servers_gate_holds_one_session_at_a_time(llama_kv, tmp_path, monkeypatch,
                                                      shadow, alive):
    """A served variant is gated with the original's rollouts recorded before it loads
    (without shadow checks, which keep the original's session running); a variant that
    fails is closed and the original loaded again to be served."""
    import serving.model as model

    counting = _Counting()
    monkeypatch.setattr(model, "get_backend", lambda name: counting)
    out = make_artifact(tmp_path / "art", llama_kv, variant=llama_kv, variant_name="same")
    loaded = model.load_artifact(out, shadow=shadow)
    assert loaded.served == "same" and counting.alive_at_load == alive
    assert (loaded.original is not None) == shadow
    counting.alive_at_load.clear()
    counting.live.clear()
    bad = make_artifact(tmp_path / "bad", llama_kv,
                        variant=perturbed_copy(llama_kv, tmp_path / "liar.onnx"))
    failed = model.load_artifact(bad, shadow=False)
    assert failed.served == "original" and not failed.gate
    # the original (recorded), the variant, the original again (the variant closed)
    assert counting.alive_at_load == [0, 0, 0]


_RSS = """
import json, re, sys
from pathlib import Path
import numpy as np
from tuner.gate.decode_step import lazy_zeros

def resident_mb(a):
    lo = a.__array_interface__["data"][0]
    hi, kb, inside = lo + a.nbytes, 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) < hi and int(m.group(2), 16) > lo
        elif inside and line.startswith("Rss:"):
            kb += int(line.split()[1])
    return kb / 1024

make = lazy_zeros if sys.argv[1] == "lazy" else np.zeros
buffers = [make((32, 4, 2048, 64), np.float32) for _ in range(4)]  # 4 x 64 MiB
for b in buffers:
    b[:, :, :16] = 1.0  # every row's first 16 entries, as 32 short streams write them
print(json.dumps(sum(resident_mb(b) for b in buffers)))
"""


def test_cache_buffers_take_memory_as_their_rows_are_written() -> None:
    """32 rows of 16 entries written into four (32, 4, 2048, 64) buffers (256 MiB): lazily
    mapped, 4 KiB pages, about the 2 MiB written; numpy's own zeros, where the system gives
    huge pages on request (transparent_hugepage "madvise" or "always"), hold whole rows."""
    def resident(kind: str) -> float:
        done = subprocess.run([sys.executable, "-c", _RSS, kind], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    lazy = resident("lazy")
    assert 1.5 <= lazy <= 16, lazy
    assert lazy_zeros((2, 3), np.float16).tolist() == np.zeros((2, 3), np.float16).tolist()
    assert lazy_zeros((0, 4), np.float32).shape == (0, 4)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    mode = re.search(r"\[(\w+)\]", thp.read_text()).group(1) if thp.exists() else "never"
    if mode != "never":  # what the buffers held before: a huge page per row and tensor
        assert resident("numpy") > 8 * lazy
