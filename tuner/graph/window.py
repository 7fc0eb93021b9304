"""A sliding-window mask, and its width in slots. transformers builds one (Mistral, Gemma 2 and
3, Qwen2 with use_sliding_window) as

    keep = kv_idx > q_idx - W          # q_idx: cache_position, a Range over the past's length

so the window counts slots, masked ones included: a row with masked slots between its cache
and its new tokens (a short prompt chunk padded to a longer one in the same run) sees fewer
of its own entries than W. The server's runner keeps such a chunk out of longer chunks' runs
where the graph has a window (serving/generation/runner.py)."""

from __future__ import annotations

import onnx_ir as ir

from tuner.graph.walk import const_array, op, walk_back

_LIMIT = 16  # nodes walked back from the Sub to the Range


def sliding_window(graph: ir.Graph) -> int | None:
    """W of the first `q_idx - W` (a Sub of an integer constant >= 2 from a value computed
    from a Range), or None where the graph has none."""
    for node in graph:
        if op(node) != "Sub" or len(node.inputs) != 2 or node.inputs[0] is None:
            continue
        w = const_array(node.inputs[1])
        if w is None or w.size != 1 or w.dtype.kind not in "iu" or int(w.reshape(-1)[0]) < 2:
            continue
        hits, _ = walk_back(node.inputs[0], lambda n: range(len(n.inputs)),
                            lambda v: op(v.producer()) == "Range", limit=_LIMIT)
        if hits:
            return int(w.reshape(-1)[0])
    return None
