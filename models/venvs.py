"""Virtual environments for tools whose dependencies clash with ours, made on first use and
cached under $SHAPETUNER_CACHE/venvs/:

  - Optimum (optimum-onnx) pins an older transformers than the one we build models with;
  - onnxruntime-genai needs the `onnxruntime` CPU wheel, which writes the same `onnxruntime`
    module as the one wheel our own environment holds (README: "One onnxruntime").

Each environment is keyed by its requirements and built in a temporary folder that is
renamed into place once pip succeeds, so an interrupted build is never mistaken for a
finished one; a lock file beside it makes a second process wait for a build under way
instead of making its own copy (the test suite starts every environment its tests need in
the background, `build_in_background`, and each test's own call waits for it). Run its
tools as `python -P -m ...` or `python -P script`: pip writes script shebangs for the
temporary folder, and -P keeps the script's own folder off sys.path.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path
from typing import Sequence

from models.build import _cache_dir
from models.once import build_once

TORCH = "torch==2.13.0"  # the CPU wheel (a plain `torch` downloads GBs of CUDA)
_MARK = ".complete"
# Built with --no-compile, an environment's modules compile when first imported; with
# PYTHONDONTWRITEBYTECODE set (CI machines and this one set it) they would compile again in
# every process, ~10 s of torch and transformers per tool run. This .pth line (site runs it
# at start-up) lets each of these cache environments keep its own bytecode.
_BYTECODE = ("_shapetuner_bytecode.pth", "import sys; sys.dont_write_bytecode = False\n")


def venv_dir(name: str, requirements: Sequence[str]) -> Path:
    tag = hashlib.sha256(" ".join([*requirements, str(sys.version_info[:2])]).encode())
    return _cache_dir() / "venvs" / f"{name}-{tag.hexdigest()[:8]}"


def python_of(root: Path) -> Path:
    return root / "bin" / "python"


def ensure_venv(name: str, requirements: Sequence[str]) -> Path:
    """The python of environment `name` holding `requirements`, made on first use (a minute
    or two). RuntimeError with pip's own words when pip cannot install them."""
    root = venv_dir(name, requirements)
    build_once(root, (root / _MARK).exists, lambda: _build(root, name, requirements))
    _keep_bytecode(root)  # also in an environment made before this line existed
    return python_of(root)


def _keep_bytecode(root: Path) -> None:
    name, line = _BYTECODE
    for site in root.glob("lib/python*/site-packages"):
        if not (site / name).is_file():
            tmp = site / f".{name}.{os.getpid()}"
            tmp.write_text(line)
            os.replace(tmp, site / name)  # whole or absent: another process may start now


def _build(root: Path, name: str, requirements: Sequence[str]) -> None:
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}."))
    try:
        venv.create(tmp, with_pip=True, symlinks=True)
        # --no-compile: modules compile when first imported, only those a tool imports
        done = subprocess.run([str(python_of(tmp)), "-m", "pip", "install", "-q",
                               "--disable-pip-version-check", "--no-compile", *requirements],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"pip could not install {' '.join(requirements)} for the {name} "
                               f"environment: {done.stderr[-3000:]}")
        (tmp / _MARK).write_text(" ".join(requirements) + "\n")
        shutil.rmtree(root, ignore_errors=True)  # a stale, unmarked one
        os.replace(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def build_in_background(environments: Sequence[tuple[str, Sequence[str]]]
                        ) -> subprocess.Popen | None:
    """One process that makes these environments in turn (those not made yet), its output
    dropped: a caller's own ensure_venv waits for it and, should pip fail, fails with pip's
    words itself. None when all are made."""
    todo = [(n, list(r)) for n, r in environments if not (venv_dir(n, r) / _MARK).exists()]
    if not todo:
        return None
    return subprocess.Popen([sys.executable, "-m", "models.venvs", json.dumps(todo)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=Path(__file__).resolve().parent.parent)


def _exit(signum, frame):  # noqa: ARG001 - a terminated build removes its temporary folder
    raise SystemExit(1)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _exit)
    for env_name, reqs in json.loads(sys.argv[1]):
        try:
            ensure_venv(env_name, reqs)
        except RuntimeError:
            pass  # the caller's own ensure_venv says why
