"""Models past 2 GB: external data found by what the graph names, ORT's fusion skipped (one
line, with the numbers) when it would not fit, the gate holding one session at a time, and
big-model session options. Small graphs stand in for big ones (the bench measures those)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tuner.gate.verify import Replay, Tolerance, record, record_then_release, verify
from tuner.graph.io import model_bytes, model_files
from tuner.runtime import ort as ort_runtime
from tuner.runtime import ort_fusion as fuse
from tuner.runtime.registry import get_backend


def _matmul_model(scale: float = 1.0, n: int = 64) -> onnx.ModelProto:
    """y = x @ W1 @ W2 with (n, n) weights: big enough to go to external data."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((n, n)) * scale).astype(np.float32)
    w2 = rng.standard_normal((n, n)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("MatMul", ["h", "w2"], ["y"])],
        "mm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", n])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def _save(model: onnx.ModelProto, path, location: str | None, one_file: bool = True):
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=one_file,
                    location=location, size_threshold=0)
    return path


@pytest.mark.parametrize("location, one_file", [
    ("model.onnx.data", True), ("model.onnx_data", True), ("weights.bin", True), (None, False)])
def test_external_data_is_found_whatever_its_name(tmp_path, location, one_file):
    path = _save(_matmul_model(), tmp_path / "m" / "model.onnx", location, one_file)
    (tmp_path / "m" / "other.data").write_bytes(b"\0" * 100_000)  # another model's: not ours
    files = model_files(path)[1:]
    assert len(files) == (1 if one_file else 2)
    data = sum(f.stat().st_size for f in files)
    assert data >= 2 * 64 * 64 * 4
    assert model_bytes(path) == path.stat().st_size + data


def test_fusion_is_skipped_with_the_numbers_when_it_would_not_fit(tmp_path):
    path = _save(_matmul_model(), tmp_path / "model.onnx", "model.onnx_data")
    size = model_bytes(path)
    need = int(size * fuse.MEMORY_FACTOR) + fuse.HEADROOM_BYTES
    assert fuse.check_fits(path, available=need) == size
    with pytest.raises(fuse.FuseSkipped) as e:
        fuse.check_fits(path, available=need - 1)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("ONNX Runtime's transformer optimizer skipped on "
                                              "model.onnx: it needs about")
    assert f"{fuse.MEMORY_FACTOR:g}x the model's" in msg and "GB is available" in msg
    assert isinstance(e.value, fuse.FuseFailed)  # optimize notes it and goes on


def test_fuse_file_stops_before_loading_anything(tmp_path, monkeypatch, reference_model):
    monkeypatch.setattr(fuse, "mem_available", lambda: 1)
    dst = tmp_path / "fused" / "model.onnx"
    with pytest.raises(fuse.FuseSkipped, match="1.0 GB|GB is available"):
        fuse.fuse_file(reference_model("gpt2", "awkward"), dst, 2, 160)
    assert not dst.parent.exists()


def test_mem_available_reads_proc_meminfo():
    """Linux (what the suite and the image run on) always has /proc/meminfo."""
    avail = fuse.mem_available()
    with open("/proc/meminfo", encoding="ascii") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert avail is not None and 0 < avail <= total


def _load(tmp_path, name: str, scale: float = 1.0, location: str = "model.onnx_data"):
    path = _save(_matmul_model(scale), tmp_path / name / "model.onnx", location)
    return get_backend("ort-cpu").load(path)


def _feeds():
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((b, 64)).astype(np.float32)} for b in (1, 3)]


def test_a_recorded_reference_gates_like_a_loaded_one(tmp_path):
    feeds = _feeds()
    ref, liar = _load(tmp_path, "ref"), _load(tmp_path, "liar", scale=1.01)
    replay = record(ref, feeds)
    assert verify(replay, _load(tmp_path, "same"), feeds, Tolerance())
    live, replayed = verify(ref, liar, feeds, Tolerance()), verify(replay, liar, feeds, Tolerance())
    assert not live and not replayed  # the liar fails either way
    assert live.outputs[0].max_abs == replayed.outputs[0].max_abs
    with pytest.raises(KeyError, match="not recorded"):
        replay.infer({"x": feeds[0]["x"].copy()})


def test_a_reference_that_fails_is_replayed_as_failing(tmp_path):
    feeds = [{"x": np.zeros((2, 5), np.float32)}]  # wrong width: ORT refuses
    replay = record(_load(tmp_path, "ref"), feeds)
    result = verify(replay, _load(tmp_path, "cand"), feeds, Tolerance())
    assert not result and "the reference failed to run" in result.errors[0]


def test_record_then_release_drops_the_session(tmp_path):
    refs = []

    def load():
        runner = _load(tmp_path, "ref")
        refs.append(weakref.ref(runner))
        return runner

    replay = record_then_release(load, _feeds())
    assert isinstance(replay, Replay) and refs[0]() is None


class _CountingBackend:
    """The CPU backend, noting how many earlier runners are still alive at each load."""

    def __init__(self) -> None:
        self.real, self.live, self.alive_at_load = get_backend("ort-cpu"), [], []

    def load(self, *args, **kw):
        gc.collect()
        self.alive_at_load.append(sum(r() is not None for r in self.live))
        runner = self.real.load(*args, **kw)
        self.live.append(weakref.ref(runner))
        return runner


@pytest.fixture
def counting(monkeypatch):
    import tuner.jobs.pad as pad
    import tuner.runtime.registry as registry

    backend = _CountingBackend()
    real = registry.get_backend
    # where the commands look their backend up: pad's module, and the registry itself, which
    # `tuner verify` imports from when it runs
    for module in (pad, registry):
        monkeypatch.setattr(module, "get_backend",
                            lambda name: backend if name == "ort-cpu" else real(name))
    return backend


def test_pad_and_verify_hold_one_session_at_a_time(tmp_path, counting, reference_model):
    from tuner.cli import main
    from tuner.jobs.pad import pad_file
    from tuner.rewrite.compose import PadRequest

    src = reference_model("gpt2", "awkward")
    res = pad_file(src, tmp_path / "padded.onnx", PadRequest(vocab_size=50304))
    assert res.accuracy and counting.alive_at_load == [0, 0]
    counting.alive_at_load.clear()
    assert main(["verify", str(src), str(tmp_path / "padded.onnx")]) == 0
    assert counting.alive_at_load == [0, 0]


def test_big_models_get_memory_friendly_session_options(tmp_path, monkeypatch):
    import onnxruntime as ort

    small = ort_runtime.big_model_options(ort.SessionOptions(), ort_runtime.BIG_MODEL_BYTES)
    assert small.enable_cpu_mem_arena and small.enable_mem_pattern  # ORT's defaults stay
    big = ort_runtime.big_model_options(ort.SessionOptions(), ort_runtime.BIG_MODEL_BYTES + 1)
    assert not big.enable_cpu_mem_arena and not big.enable_mem_pattern
    assert big.get_session_config_entry("session.use_env_allocators") == "1"
    # a "big" model (threshold lowered) still loads from external data and computes the same
    feeds = _feeds()
    before = record(_load(tmp_path, "a"), feeds)
    monkeypatch.setattr(ort_runtime, "BIG_MODEL_BYTES", 0)
    assert verify(before, _load(tmp_path, "b", location="w.bin"), feeds, Tolerance(0, 0))


def test_the_fused_candidate_is_gated_against_a_recorded_original(tmp_path, reference_model):
    """optimize records the original once for the fused candidate's gate, so the fusion's
    session is the only one loaded while it is checked."""
    from types import SimpleNamespace

    from tuner.gate.entry import prepare
    from tuner.gate.feeds import input_specs, make_feeds
    from tuner.graph.inspect import inspect_path
    from tuner.graph.load import load_model
    from tuner.jobs.variants import build_fused, copy_original
    from tuner.runtime.base import SessionSettings

    src = reference_model("gpt2", "awkward")
    feeds = make_feeds(input_specs(load_model(src)), 50257, [(1, 7), (2, 16)])
    cpu, settings = get_backend("ort-cpu"), SessionSettings(intra_op_threads=1)
    base = copy_original(src, tmp_path)
    gate = prepare(load_model(src), lambda: cpu.load(base.path, settings), feeds=feeds)
    assert isinstance(gate.reference, Replay)  # recorded, its session released
    built = build_fused(base, tmp_path, SimpleNamespace(name="fuse"), inspect_path(src),
                        gate, cpu, settings)
    assert built.accuracy.passed and built.note.startswith("fused: ")


class _FakeMemory:
    """A machine with `total` bytes where each load takes `per_byte` x the model's bytes,
    with a transient of `transient` x on top while it loads."""

    def __init__(self, total: int, per_byte: float, transient: float = 0.0) -> None:
        self.total, self.per_byte, self.transient = total, per_byte, transient
        self.rss = self.hwm = 100
        self.loads: list[str] = []

    def load(self, name, size):
        self.hwm = max(self.hwm, self.rss + int((self.per_byte + self.transient) * size))
        self.rss += int(self.per_byte * size)
        self.loads.append(name)
        return name

    def probes(self):
        from tuner.runtime.memory import Probes

        def reset():
            self.hwm = self.rss

        return Probes(rss=lambda: self.rss, peak=lambda: self.hwm, reset_peak=reset,
                      available=lambda: self.total - self.rss)


def test_sessions_are_loaded_while_they_fit_and_the_rest_noted():
    from tuner.runtime.memory import HEADROOM_BYTES, load_fitting

    gb = 10**9
    mem = _FakeMemory(total=16 * gb, per_byte=2.0, transient=0.5)  # fp16 cast to fp32, say
    sizes = {"original": 2 * gb, "vocab": 2 * gb, "head_dim": 2 * gb, "fuse": 2 * gb}
    items = [(n, None, s) for n, s in sizes.items()]
    loaded, notes = load_fitting(items, lambda n, _: mem.load(n, sizes[n]), mem.probes())
    # each load peaks at 2.5 x 2 GB (+ headroom) and stays at 4 GB: after three, 4 GB is left
    assert [n for n, _ in loaded] == ["original", "vocab", "head_dim"] == mem.loads
    assert len(notes) == 1 and notes[0].startswith("left fuse out of the timing: loading its "
                                                   "session would need about 6.1 GB (2.5x its 2.0 GB")
    assert mem.hwm <= mem.total and HEADROOM_BYTES < gb * 2


def test_small_models_all_load():
    from tuner.runtime.memory import load_fitting

    mem = _FakeMemory(total=10**10, per_byte=3.0)
    items = [(n, None, 10**6) for n in ("original", "a", "b", "c")]
    loaded, notes = load_fitting(items, lambda n, _: mem.load(n, 10**6), mem.probes())
    assert len(loaded) == 4 and notes == []


def test_the_real_probes_read_this_process():
    from tuner.runtime.memory import mem_available, peak_bytes, reset_peak, rss_bytes

    rss = rss_bytes()
    assert rss is not None and rss > 0  # Linux: /proc/self/status is there
    reset_peak()
    assert peak_bytes() >= rss * 0.5 and mem_available() > 0


def _die() -> None:
    """Stands in for an optimizer the kernel kills for memory (runs in the spawned child)."""
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def test_a_big_model_fuses_in_a_child_process(tmp_path, monkeypatch, reference_model):
    monkeypatch.setattr(fuse, "IN_PROCESS_BYTES", 0)
    dst = tmp_path / "fused" / "model.onnx"
    stats = fuse.fuse_file(reference_model("gpt2", "awkward"), dst, 2, 160)
    assert stats and dst.exists()


def test_a_fusion_child_that_dies_skips_only_the_candidate():
    with pytest.raises(fuse.FuseFailed, match="optimizer on m.onnx: its process died"):
        fuse.run_in_child(_die, what="optimizer on m.onnx")
