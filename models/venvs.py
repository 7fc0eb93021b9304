"""Virtual environments for tools whose dependencies clash with ours, made on first use and
cached under $SHAPETUNER_CACHE/venvs/:

  - Optimum (optimum-onnx) pins an older transformers than the one we build models with;
  - onnxruntime-genai needs the `onnxruntime` CPU wheel, which writes the same `onnxruntime`
    module as the one wheel our own environment holds (README: "One onnxruntime").

Each environment is keyed by its requirements and built in a temporary folder that is
renamed into place once pip succeeds, so an interrupted build is never mistaken for a
finished one. Run its tools as `python -P -m ...` or `python -P script`: pip writes script
shebangs for the temporary folder, and -P keeps the script's own folder off sys.path.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path
from typing import Sequence

from models.build import _cache_dir

TORCH = "torch==2.13.0"  # the CPU wheel (a plain `torch` downloads GBs of CUDA)
_MARK = ".complete"


def venv_dir(name: str, requirements: Sequence[str]) -> Path:
    tag = hashlib.sha256(" ".join([*requirements, str(sys.version_info[:2])]).encode())
    return _cache_dir() / "venvs" / f"{name}-{tag.hexdigest()[:8]}"


def python_of(root: Path) -> Path:
    return root / "bin" / "python"


def ensure_venv(name: str, requirements: Sequence[str]) -> Path:
    """The python of environment `name` holding `requirements`, made on first use (a minute
    or two). RuntimeError with pip's own words when pip cannot install them."""
    root = venv_dir(name, requirements)
    if (root / _MARK).exists():
        return python_of(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}."))
    try:
        venv.create(tmp, with_pip=True, symlinks=True)
        done = subprocess.run([str(python_of(tmp)), "-m", "pip", "install", "-q",
                               "--disable-pip-version-check", *requirements],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"pip could not install {' '.join(requirements)} for the {name} "
                               f"environment: {done.stderr[-3000:]}")
        (tmp / _MARK).write_text(" ".join(requirements) + "\n")
        if (root / _MARK).exists():  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            shutil.rmtree(root, ignore_errors=True)  # a stale, unmarked one
            os.replace(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return python_of(root)
