"""`tuner inspect MODEL.onnx [--json] [--device D]`."""
from tuner.cli.app import app  # noqa: F401  (the inspect helper fills this in)
