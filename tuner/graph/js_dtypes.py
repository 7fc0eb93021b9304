"""The precisions a transformers.js repository ships, one file each: beside
`onnx/encoder_model.onnx` (fp32), `encoder_model_quantized.onnx`, `encoder_model_fp16.onnx`,
... named as transformers.js names them (DEFAULT_DTYPE_SUFFIX_MAPPING in its
src/utils/dtypes.js), so that `tuner unmerge FOLDER --dtype q8` picks the files its users'
`dtype: "q8"` loads.

    suffix("q8")                           # "_quantized"
    variant("encoder_model.onnx", "q8")    # "encoder_model_quantized.onnx"
    present(folder, ("encoder_model.onnx", "decoder_model_merged.onnx"))  # ["fp32", "q8"]
"""

from __future__ import annotations

from pathlib import Path

from tuner.errors import BadInput

# transformers.js's own table (fp32 the plain file)
SUFFIXES = {"fp32": "", "fp16": "_fp16", "int8": "_int8", "uint8": "_uint8",
            "q8": "_quantized", "q4": "_q4", "q4f16": "_q4f16", "bnb4": "_bnb4"}
# transformers.js v2's `quantized: true`, the q8 file
ALIASES = {"quantized": "q8"}


def dtype_of(name: str) -> str:
    """The dtype `name` stands for (an alias resolved); BadInput naming the known ones."""
    dtype = ALIASES.get(name, name)
    if dtype not in SUFFIXES:
        raise BadInput(f"no dtype {name!r}: transformers.js names "
                       f"{', '.join([*SUFFIXES, *ALIASES])}")
    return dtype


def suffix(dtype: str) -> str:
    return SUFFIXES[dtype_of(dtype)]


def variant(file: str, dtype: str) -> str:
    """`file` (a plain graph's name) as the file of `dtype`."""
    stem = file.removesuffix(".onnx")
    return f"{stem}{suffix(dtype)}.onnx"


def graphs_of(folder: Path, files: tuple[str, ...], dtype: str) -> Path | None:
    """Where `files` of `dtype` all lie: `folder` or its `onnx/` (None: in neither)."""
    for where in (folder, folder / "onnx"):
        if all((where / variant(f, dtype)).is_file() for f in files):
            return where
    return None


def present(folder: Path, files: tuple[str, ...]) -> list[str]:
    """The dtypes whose every one of `files` the folder (or its `onnx/`) holds."""
    return [d for d in SUFFIXES if graphs_of(folder, files, d) is not None]
