"""The axis engine: widen one axis through a graph region, exactly (see engine.py).

The engine reads one table, (domain, op type) -> handler; it is filled here from an explicit
list of op-family modules, one file per family. A new op is a function in its family's module
and an entry in that module's HANDLERS.
"""

from tuner.rewrite.axis import (attention_op, elementwise, gather, layout, matmul, quantize, reduce,
                                reshape, slice)
from tuner.rewrite.axis.engine import HANDLERS, Track, Widen, identity, scatter

for _family in (elementwise, layout, matmul, gather, reshape, slice, reduce, attention_op,
                quantize):
    HANDLERS.update(_family.HANDLERS)

__all__ = ["HANDLERS", "Track", "Widen", "identity", "scatter"]
