"""How many bytes a model takes on disk: its graph file and the external data its tensors name.

Exporters and tools name external data differently (`model.onnx.data`, `model.onnx_data`,
torch's one file per tensor past 2 GB), so the graph is read for the names rather than the
folder globbed: a folder can hold other models' data too.
"""

from __future__ import annotations

import os
from pathlib import Path

from tuner.graph.load import _external_entries, read_proto


def external_files(path: str | os.PathLike) -> list[Path]:
    """The external-data files the graph names, each once, resolved beside the graph."""
    path = Path(path)
    proto = read_proto(path)  # the graph only: the weights stay on disk
    locations = {dict((e.key, e.value) for e in t.external_data).get("location", "")
                 for t in _external_entries(proto)}
    return sorted({(path.parent / loc).resolve() for loc in locations if loc})


def model_bytes(path: str | os.PathLike) -> int:
    """The graph file plus every external-data file it names (missing ones count 0: the
    loader reports those)."""
    path = Path(path)
    return path.stat().st_size + sum(f.stat().st_size for f in external_files(path)
                                     if f.is_file())
