"""Shared fixtures: reference models are exported once and cached (models/build.py); the
tool environments the selected tests name (`@pytest.mark.venv(name, requirements)`) are
built in one background process while the other tests run (those tests run last).

The suite runs in two worker processes (README: `pytest -n 2 --dist loadfile`, each test
file whole on one worker), which share the cache: models/once.py makes the second to ask for
a model wait for the first's build of it."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The suite starts hundreds of Python processes (servers, the CLI, benchmarks): where
# PYTHONDONTWRITEBYTECODE is set (this machine's environment sets it) each would compile our
# modules again, ~1.4 s a process. Their bytecode goes to the checkout's __pycache__ folders.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

_BUILDER = pytest.StashKey[subprocess.Popen]()


def pytest_configure(config: pytest.Config) -> None:
    """xdist hands the files out in the order pytest_collection_modifyitems leaves them in
    (by default it reorders them by their number of tests, which would put a file that
    waits for a tool environment among the first)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files that need a tool environment run last: the environments' install then
    overlaps every other test instead of holding up the first one that needs it. In each
    half the files with more tests go first (xdist's own order), so that the run does not
    end on one worker alone with a long file."""
    needs_venv: dict[str, bool] = {}
    count: dict[str, int] = {}
    for item in items:
        file = _file(item)
        needs_venv[file] = needs_venv.get(file, False) or bool(item.get_closest_marker("venv"))
        count[file] = count.get(file, 0) + 1
    items.sort(key=lambda item: (needs_venv[_file(item)], -count[_file(item)], _file(item)))


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Each tool environment takes a minute or more of pip on a fresh checkout: start them
    all now, in the order the tests need them, beside the first tests. A test's own
    ensure_venv then waits for the one it needs (models/venvs.py's lock) instead of
    building it while nothing else runs."""
    from models.venvs import build_in_background

    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":  # one builder for all workers
        return
    wanted: dict[str, tuple[str, ...]] = {}
    for item in session.items:
        for mark in item.iter_markers("venv"):
            wanted.setdefault(mark.args[0], tuple(mark.args[1]))
    builder = build_in_background(list(wanted.items()))
    if builder is not None:
        session.config.stash[_BUILDER] = builder


_FROZEN_FOR = pytest.StashKey[str]()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """At each test file's first test: collect, then move every object still alive out of
    the cycle collector's reach (gc.freeze, as `tuner serve` does with its start-up heap).
    A worker imports torch, transformers and every family's model code, ~600k objects that
    each full collection walks again: ~0.3 s a collection, and the code under test collects
    where a dropped model's memory matters (the gate, pad, optimize's loads). Only what is
    alive between files is frozen: the modules, the session's fixtures and caches; what a
    file leaves behind is collected first."""
    file = _file(item)
    if item.config.stash.get(_FROZEN_FOR, None) != file:
        item.config.stash[_FROZEN_FOR] = file
        gc.collect()
        gc.freeze()


def pytest_sessionfinish(session: pytest.Session) -> None:
    builder = session.config.stash.get(_BUILDER, None)
    if builder is not None and builder.poll() is None:  # the run stopped early
        builder.terminate()
        builder.wait(60)


FAMILIES = ("gpt2", "bert", "llama")
EXPORTERS = ("torchscript", "dynamo")


@pytest.fixture(scope="session")
def reference_model():
    """reference_model(name, shape="small", exporter="torchscript") -> Path of the cached export."""
    from models.build import cached

    def get(name: str, shape: str = "small", exporter: str = "torchscript") -> Path:
        return cached(name, shape, exporter)

    return get


@pytest.fixture(scope="session")
def cross_encoder_artifact(tmp_path_factory) -> Path:
    """`tuner optimize` of models/cross_encoder.py's reranker (a BERT classifier with one
    label and its tokenizer), for the rerank tests and the benchmarking tools' one."""
    from llm_support import optimized_encoder

    from models.cross_encoder import cached

    return optimized_encoder(cached() / "model.onnx", tmp_path_factory.mktemp("rerank") / "out")


@pytest.fixture(scope="session")
def llama_opset23():
    """Llama exported by dynamo at opset 23: torch writes ONNX's own Attention and
    RotaryEmbedding ops (cached beside the reference models, built once, ~10 s)."""
    from models.build import DYNAMO_23, cached

    return cached("llama", "small", DYNAMO_23)


@pytest.fixture(scope="session")
def llama_kv_opset23():
    """llama-kv through dynamo at opset 23: the Concats feed ONNX's own Attention op, and its
    rotary caches are computed from the position_ids input (one row per row of the batch)."""
    from models.build import DYNAMO_23, cached

    return cached("llama-kv", "awkward", DYNAMO_23)
