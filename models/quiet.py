"""The exporters' known, harmless warnings, silenced while a reference model is exported
(models.build and models.kv both export)."""

from __future__ import annotations

import contextlib
import warnings


@contextlib.contextmanager
def quiet_exporters():
    """Silence the exporters' known, harmless warnings: the legacy exporter's deprecation
    notice, transformers' tracer warnings about mask-shape checks, torch.export's own
    deprecations and axis renames. tests/test_models.py and tests/test_models_kv.py prove each
    export equals torch at other batch/sequence/past shapes with padded masks."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", "Exporting aten::index operator")  # no negative ids
        warnings.filterwarnings("ignore", "# The axis name: .* will not be used")  # same axis
        yield
