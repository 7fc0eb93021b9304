"""Our reference exports (models/build.py, models/kv.py) quantized by ONNX Runtime's own tools:

    python -m models.quantize dynamic llama            # prints the .onnx path
    python -m models.quantize nbits-asym llama-kv

Kinds:
  dynamic     quantize_dynamic, int8 weights (symmetric): DynamicQuantizeLinear + MatMulInteger
  dynamic-u8  the same with uint8 weights (asymmetric: zero points != 0)
  dynamic-pc  per-channel int8 weights (a scale and zero point per column)
  static      quantize_static, QDQ format, MatMul only, a small calibration reader of random ids
  nbits       MatMulNBitsQuantizer, 4 bits, block 32, symmetric (no zero points)
  nbits-asym  the same, asymmetric (packed uint8 zero points)
  nbits8      the same, 8 bits, asymmetric
  nbits-hqq   the same with HQQWeightOnlyQuantConfig (4 bits): float zero points, not integers
  bnb4        MatMulBnb4Quantizer, NF4, block 32 (bitsandbytes' 4-bit: what transformers.js
              repositories ship as onnx/model_bnb4.onnx)
  fp16        onnxruntime.transformers.float16's conversion with float32 inputs and outputs
              (keep_io_types), as transformers.js' scripts make a repository's model_fp16.onnx
  q4f16       nbits, then that conversion: transformers.js' model_q4f16.onnx
  qdq4        the nbits quantizer with quant_format=QDQ: int4 weights behind DequantizeLinear with
              block-wise scales (opset 21), symmetric; qdq4-asym with zero points. It writes
              opset 21 without converting the graph (an opset-17 export keeps ReduceMean's axes
              attribute: invalid), so the export is converted to opset 21 first, as a user must

Each is built once from the cached reference export (shape "awkward", TorchScript) and cached
under $SHAPETUNER_CACHE by (kind, model, this file's BUILD version).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from models.build import IR_VERSION, _cache_dir, cached as reference
from models.once import build_once

BUILD = 1  # bump when what this file builds changes: it is part of the cache key
KINDS = ("dynamic", "dynamic-u8", "dynamic-pc", "static", "nbits", "nbits-asym", "nbits8",
         "nbits-hqq", "qdq4", "qdq4-asym", "bnb4", "fp16", "q4f16")


def _calibration(path: Path, vocab: int):
    """A few random prompts (an empty past for a cache model): quantize_static's reader."""
    from onnxruntime.quantization import CalibrationDataReader

    from tuner.gate.feeds import make_feeds

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.feeds = iter(make_feeds(path, vocab, ((1, 8), (2, 12), (1, 16)), seed=1))

        def get_next(self):
            return next(self.feeds, None)

    return Reader()


def _quantize(kind: str, src: Path, dst: Path, vocab: int) -> None:
    import onnx
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    if kind.startswith("dynamic"):
        quantize_dynamic(str(src), str(dst), per_channel=kind == "dynamic-pc",
                         weight_type=QuantType.QUInt8 if kind == "dynamic-u8" else QuantType.QInt8)
    elif kind == "static":
        quantize_static(str(src), str(dst), _calibration(src, vocab), quant_format=QuantFormat.QDQ,
                        op_types_to_quantize=["MatMul"], weight_type=QuantType.QInt8,
                        activation_type=QuantType.QUInt8)
    elif kind == "fp16":
        _half(onnx.load(str(src)), dst)
    elif kind == "bnb4":
        from onnxruntime.quantization.matmul_bnb4_quantizer import MatMulBnb4Quantizer

        q = MatMulBnb4Quantizer(onnx.load(str(src)), quant_type=MatMulBnb4Quantizer.NF4,
                                block_size=32)
        q.process()
        onnx.save(q.model.model, str(dst))
    else:
        from onnx.version_converter import convert_version
        from onnxruntime.quantization.matmul_nbits_quantizer import (HQQWeightOnlyQuantConfig,
                                                                     MatMulNBitsQuantizer)

        how = {"nbits8": dict(bits=8),
               "nbits-hqq": dict(algo_config=HQQWeightOnlyQuantConfig(block_size=32, bits=4)),
               "qdq4": dict(quant_format=QuantFormat.QDQ),
               "qdq4-asym": dict(quant_format=QuantFormat.QDQ)}
        model = onnx.load(str(src))
        if kind.startswith("qdq"):
            model = convert_version(model, 21)
        symmetric = kind in ("nbits", "qdq4", "q4f16")
        q = MatMulNBitsQuantizer(model, block_size=32, is_symmetric=symmetric, **how.get(kind, {}))
        q.process()
        if kind == "q4f16":
            _half(q.model.model, dst)
        else:
            onnx.save(q.model.model, str(dst))
    proto = onnx.load(str(dst))
    proto.ir_version = min(proto.ir_version, IR_VERSION)
    onnx.save(proto, str(dst))


def _half(model, dst: Path) -> None:
    """float16 inside, float32 at the inputs and outputs. The conversion appends its input
    Casts after the nodes that read them (a graph out of order, which ONNX Runtime runs)."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    onnx.save(convert_float_to_float16(model, keep_io_types=True), str(dst))


def cached(kind: str, name: str) -> Path:
    """The quantized export (`name` one of models.build's, shape awkward, TorchScript)."""
    import logging

    from tuner.graph.inspect import inspect_path

    if kind not in KINDS:
        raise KeyError(f"no quantization kind {kind!r}; known: {KINDS}")
    key = hashlib.sha256(json.dumps([BUILD, kind, name]).encode()).hexdigest()[:12]
    path = _cache_dir() / key / f"{name}-{kind}.onnx"

    def build() -> None:
        src = reference(name, "awkward", "torchscript")
        vocab = inspect_path(src).vocab_size or 1000
        logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            staged = Path(tmp) / path.name
            _quantize(kind, src, staged, vocab)
            os.replace(staged, path)

    build_once(path, path.is_file, build)
    return path


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m models.quantize", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=KINDS)
    p.add_argument("name", help="a models.build reference name with an awkward shape, e.g. llama")
    a = p.parse_args(argv)
    np.seterr(all="ignore")
    print(cached(a.kind, a.name))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
