"""Image transformers as Optimum exports them (ViT, CLIP's and SigLIP's vision towers:
`feature-extraction`, pixels in; models/optimum.py), with SigLIP-so400m's head dim of 72.

Optimum declares every axis of `pixel_values` symbolic; the graph takes one size only,
which tuner.graph.pixels reads (channels from the patch Conv, the size from the position
table's rows): the gate feeds that, so verify, pad (head dim and FFN, exact) and optimize
run, and the server answers Triton's client as ONNX Runtime does on the original. CLIP's
and SigLIP's attention reshape their output to the width read from the residual's shape,
which the head-dim rewrite now writes as the padded width."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from models import optimum
from tests.serving_support import free_port, perturbed_copy, serve_process
from tuner.cli import main

FAMILIES = [n for n, f in optimum.FAMILIES.items() if f.tasks == (optimum.VISION_TASK,)]


@pytest.fixture(scope="module")
def exports() -> dict[str, Path]:
    cells = [(n, optimum.VISION_TASK) for n in FAMILIES]
    return dict(zip(FAMILIES, optimum.export_all(cells)))


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_families():
    assert sorted(FAMILIES) == ["clip_vision", "siglip_vision", "vit"]


@pytest.mark.parametrize("family", FAMILIES)
def test_pixels_read_gated_and_padded(exports, family, tmp_path):
    src = exports[family]
    code, out, err = _run(["inspect", str(src), "--json"])
    assert code == 0, err
    shape = json.loads(out)
    want = optimum.FAMILIES[family].expect
    assert {k: shape[k] for k in want} == want
    pixels = shape["inputs"][0]
    assert (pixels["role"], pixels["dims"][1:], pixels["batch_axis"]) == (
        "pixel_values", [3, 32, 32], 0)
    assert _run(["verify", str(src), str(src)])[0] == 0
    code, out, _ = _run(["verify", str(src), str(perturbed_copy(src, tmp_path / "bad.onnx"))])
    assert code == 1 and "FAIL" in out
    code, out, err = _run(["pad", str(src), "-o", str(tmp_path / "p.onnx"), "--head-dim",
                           "128", "--ffn-multiple", "64"])
    assert code == 0, err
    assert "head_dim 72->128" in out and "ffn 200->256" in out


def test_served_as_a_tensor_model(exports, tmp_path):
    """SigLIP's tower optimized and served: Triton's gRPC client sends images of batch 1 and
    2, at once; each answer is ONNX Runtime's on the original."""
    import tritonclient.grpc as tg
    from concurrent.futures import ThreadPoolExecutor

    src = exports["siglip_vision"]
    art = tmp_path / "art"
    code, _, err = _run(["optimize", str(src), "-o", str(art), "--rounds", "2", "--warmup", "0",
                         "--no-probe", "--no-fuse", "--max-variants", "2", "--no-cache",
                         "--bucket-rounds", "1", "--max-buckets", "2", "--no-plots"])
    assert code == 0, err
    sess = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    port = free_port()
    proc = serve_process(art, port, "siglip")
    try:
        client = tg.InferenceServerClient(f"127.0.0.1:{port}")

        def one(seed: int) -> float:
            pixels = np.random.default_rng(seed).standard_normal(
                (1 + seed % 2, 3, 32, 32)).astype(np.float32)
            made = tg.InferInput("pixel_values", list(pixels.shape), "FP32")
            made.set_data_from_numpy(pixels)
            got = client.infer("siglip", [made])
            want = sess.run(["pooler_output"], {"pixel_values": pixels})[0]
            return float(np.abs(got.as_numpy("pooler_output") - want).max())

        with ThreadPoolExecutor(4) as pool:
            assert max(pool.map(one, range(8))) < 1e-5
    finally:
        proc.kill()
        proc.communicate()
