"""shapetuner: pad an exported transformer's GEMM dimensions to sizes the hardware likes,
prove the outputs unchanged, measure, and serve the fastest exact variant."""

__version__ = "0.1.0"
