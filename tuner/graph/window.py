"""A sliding-window mask, and its width in slots. transformers builds one (Mistral, Gemma 2 and
3, Qwen2 with use_sliding_window) as

    keep = kv_idx > q_idx - W          # q_idx: cache_position, a Range over the past's length

and GPT-Neo's local layers slice a constant band table (slot j kept for slot i where
i - W < j <= i) by the cache's length. Either way the window counts slots, masked ones
included: a row with masked slots between its cache and its new tokens (a short prompt
chunk padded to a longer one in the same run) sees fewer of its own entries than W. The server's runner keeps such a chunk out of longer chunks' runs
where the graph has a window (serving/generation/runner.py)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from tuner.graph.walk import const_array, const_tensor, op, walk_back

_LIMIT = 16  # nodes walked back from the Sub to the Range


def sliding_window(graph: ir.Graph) -> int | None:
    """W of the first `q_idx - W` (a Sub of an integer constant >= 2 from a value computed
    from a Range), else of a constant band table (GPT-Neo's local layers), or None where
    the graph has neither."""
    return _computed_window(graph) or _table_window(graph)


def _computed_window(graph: ir.Graph) -> int | None:
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


def _table_window(graph: ir.Graph) -> int | None:
    """GPT-Neo's local attention: a constant (1, 1, N, N) boolean table, sliced by the cache's
    length, that keeps slot j for query slot i where i - W < j <= i (the causal table XOR
    its tril(-W)); W < N. The smallest W of such tables, or None."""
    found = []
    for v in _constants(graph):
        t = const_tensor(v)
        if t is None or t.dtype != ir.DataType.BOOL or len(t.shape) < 2:
            continue
        n = int(t.shape[-1])
        if n < 2 or int(t.shape[-2]) != n or t.size != n * n:
            continue
        table = np.asarray(t.numpy()).reshape(n, n)
        w = int(table[-1].sum())
        band = np.tril(np.ones((n, n), bool)) & ~np.tril(np.ones((n, n), bool), -w)
        if 1 < w < n and np.array_equal(table, band):
            found.append(w)
    return min(found) if found else None


def _constants(graph: ir.Graph):
    """Every initializer and Constant node output of `graph`."""
    yield from graph.initializers.values()
    for node in graph:
        if op(node) == "Constant":
            yield node.outputs[0]
