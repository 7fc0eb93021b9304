"""Windowed caches: onnxruntime-genai's builder gives a sliding-window layer (Gemma 2 and 3,
GPT-OSS) a cache that holds only its window. Its GroupQueryAttention carries
`sliding_window_cache = 1` beside `local_window_size = W`, and its past is a buffer of its
own capacity C >= W (`past_sliding_length`), apart from the full layers' caches
(`past_sequence_length`):

    past (B, kv, C, d) --> GroupQueryAttention(local_window_size=W, sliding_window_cache=1)
                           the newest entries at [0, end(P)), end a function of the
                           absolute length P (from seqlens_k); older ones compacted away

Each layer keeps its window whatever the capacity, so the same op without the flag, fed the
whole past, computes the same attention (tuner.rewrite.unwindow): one cache length for
every layer, which the engine holds.

    found = windowed_cache(graph)      # None where no layer keeps only its window
    found.window, found.pasts          # 16, ('past_key_values.0.key', ...)
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from tuner.graph.walk import MS, op

GQA = f"{MS}.GroupQueryAttention"
FLAG = "sliding_window_cache"
PAST_SLOTS, PRESENT_SLOTS = (3, 4), (1, 2)  # GroupQueryAttention's past and present K, V
SEQ_AXIS = 2  # its caches are (B, kv_heads, P, d)


@dataclass(frozen=True)
class WindowedCache:
    """The layers whose cache holds only their window."""

    nodes: tuple[str, ...]  # their GroupQueryAttention nodes
    window: int  # the smallest local_window_size among them
    pasts: tuple[str, ...]  # their past K and V graph inputs
    presents: tuple[str, ...]  # their present K and V graph outputs


def _attr(node: ir.Node, name: str, default: int) -> int:
    a = node.attributes.get(name)
    return default if a is None else int(a.value)


def windowed_nodes(graph: ir.Graph) -> list[ir.Node]:
    """The GroupQueryAttention nodes that keep a windowed cache."""
    return [n for n in graph if op(n) == GQA and _attr(n, FLAG, 0) == 1]


def windowed_cache(graph: ir.Graph) -> WindowedCache | None:
    nodes = windowed_nodes(graph)
    if not nodes:
        return None
    names = lambda vals: tuple(v.name for v in vals if v is not None and v.name)  # noqa: E731
    return WindowedCache(tuple(n.name or "" for n in nodes),
                         min(_attr(n, "local_window_size", -1) for n in nodes),
                         names(n.inputs[i] for n in nodes for i in PAST_SLOTS
                               if i < len(n.inputs)),
                         names(n.outputs[i] for n in nodes for i in PRESENT_SLOTS
                               if i < len(n.outputs)))
