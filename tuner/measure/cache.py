"""Results cache: an interrupted or repeated `tuner optimize` reuses timings already taken.

One JSON file maps a key (graph sha256, backend, device, shape, session settings, rounds,
warm-up) to that measurement's per-round samples and the id of the interleaved group it was
measured in. Timings are only paired (and so only comparable) within one group, so a shape is
reused only when every variant's entry is there *and* they share one group (see
`tuner.measure.bench.measure`). The file is rewritten atomically after each group, so a kill leaves
the previous good file. It holds only numbers and strings: nothing is unpickled, and a
corrupt file is set aside and started afresh rather than trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from tuner.util.files import atomic_write

CACHE_FILE = "bench-cache.json"
_FORMAT = 1


def default_cache_dir() -> Path:
    env = os.environ.get("SHAPETUNER_RESULTS_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or (Path.home() / ".cache")
    return Path(base) / "shapetuner"


def device_key(info: Any, backend: str) -> str:
    """What a timing depends on beside the graph and the shape: the device, the provider
    (backend), the onnxruntime version, the NVIDIA driver and CUDA, and TensorRT's version
    (`info`: a tuner.hardware.detect.DeviceInfo). Part of every entry_key, so that an upgrade
    of any of them never reuses old timings."""
    parts = {"device": info.label, "provider": backend}
    for field in ("onnxruntime", "driver", "cuda_driver", "cuda_runtime", "cudnn", "tensorrt"):
        parts[field] = getattr(info, field, None) or "-"
    return "|".join(f"{k}={v}" for k, v in parts.items())


def entry_key(graph_sha: str, backend: str, device: str, shape: tuple[int, int],
              settings: Mapping[str, Any], rounds: int, warmup: int) -> str:
    payload = json.dumps([graph_sha, backend, device, list(shape), dict(settings), rounds, warmup],
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


@dataclass(frozen=True)
class Entry:
    samples_ms: tuple[float, ...]
    group: str


class ResultsCache:
    """A dict of Entry on disk. `path=None` keeps it in memory only (`--no-cache`)."""

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = Path(path) if path is not None else None
        self.entries: dict[str, Entry] = {}
        self.hits = 0
        if self.path is not None and self.path.exists():
            self.entries = self._load(self.path)

    @staticmethod
    def in_dir(cache_dir: str | os.PathLike | None) -> "ResultsCache":
        return ResultsCache(None if cache_dir is None else Path(cache_dir) / CACHE_FILE)

    @staticmethod
    def _load(path: Path) -> dict[str, Entry]:
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
            if obj.get("format") != _FORMAT:
                raise ValueError("unknown format")
            out = {}
            for k, v in obj["entries"].items():
                samples = tuple(float(x) for x in v["samples_ms"])
                if not samples or not all(x > 0 and x == x and x != float("inf") for x in samples):
                    raise ValueError("bad samples")
                out[str(k)] = Entry(samples, str(v["group"]))
            return out
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            # Never trust a damaged cache: keep it aside for a human, start empty.
            path.replace(path.with_suffix(".corrupt"))
            return {}

    def get(self, key: str) -> Entry | None:
        e = self.entries.get(key)
        if e is not None:
            self.hits += 1
        return e

    def put_group(self, items: Mapping[str, tuple[float, ...]], group: str) -> None:
        """Store one interleaved group's measurements and save the file at once."""
        for k, samples in items.items():
            self.entries[k] = Entry(tuple(float(x) for x in samples), group)
        self.save()

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Merge with what another run may have written meanwhile; ours win on conflicts.
        merged = self._load(self.path) if self.path.exists() else {}
        merged.update(self.entries)
        text = json.dumps({"format": _FORMAT, "entries": {
            k: {"samples_ms": list(e.samples_ms), "group": e.group} for k, e in merged.items()}})
        atomic_write(self.path, text)
