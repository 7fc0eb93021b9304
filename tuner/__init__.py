"""shapetuner: pad an exported transformer's GEMM dimensions to sizes the hardware likes,
prove the outputs unchanged, measure, and serve the fastest exact variant."""

from importlib import metadata

try:  # one home for the version: pyproject.toml, read from the installed package
    __version__ = metadata.version("shapetuner")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
