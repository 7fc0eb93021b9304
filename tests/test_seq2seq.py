"""Encoder-decoders as Optimum exports them (T5, Flan-T5, Marian, BART, Whisper, ViT + GPT-2:
a folder of encoder_model.onnx, decoder_model.onnx, decoder_with_past_model.onnx and the merged
decoder; models/optimum.py).

A decoder attends to the encoder's output too (cross-attention): inspect counts its layers
(not its cross blocks), finds what it takes from the encoder (roles encoder_states,
encoder_mask, encoder_cache) and feeds those at the encoder's own length; the gate compares
every output and FAILS a copy whose cross-attention is off; `tuner pad FOLDER` pads every
graph alike and the padded folder generates in Optimum's own loop exactly what the original
does; a decoder file is optimized and served as a tensor model (Triton's client, encoder
lengths of its own per request)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from models import optimum
from tests.serving_support import (free_port, perturbed_copy, quantize_dynamic_copy,
                                   scaled_weight, serve_process)
from tuner.cli import main
from tuner.gate.kv_gate import SEQ2SEQ_STEPS, gate_feeds
from tuner.graph.inspect import inspect_path
from tuner.graph.io import max_positions
from tuner.graph.load import load_model
from tuner.graph.roles import input_specs

FAMILIES = {name: fam.tasks[0] for name, fam in optimum.FAMILIES.items()
            if fam.tasks[0] in optimum.SEQ2SEQ_TASKS}  # T5, Flan-T5, Marian, BART, Whisper
DECODERS = ("decoder_model.onnx", "decoder_with_past_model.onnx")
# the MatMul of layer 0's cross-attention keys, by exporter naming (the corrupted copies)
CROSS_KEY = {"t5": "EncDecAttention/k/MatMul", "flan_t5": "EncDecAttention/k/MatMul",
             "marian": "encoder_attn/k_proj/MatMul", "bart": "encoder_attn/k_proj/MatMul",
             "whisper": "encoder_attn/k_proj/MatMul", "vit_gpt2": "crossattention/c_attn/Gemm"}
# the decoders that take the encoder's mask (Whisper's and the image captioner's take none)
MASKED = ("t5", "flan_t5", "marian", "bart")


@pytest.fixture(scope="module")
def exports() -> dict[str, Path]:
    """family -> its Optimum export folder (cached; one Optimum process for all three)."""
    cells = list(FAMILIES.items())
    return {name: path.parent for (name, _), path in zip(cells, optimum.export_all(cells))}


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _cross_corrupted(src: Path, dst: Path, family: str) -> Path:
    """`src` with layer 0's cross-attention key weights scaled: the decoder's own tokens
    are untouched, only what it reads from the encoder changes."""
    return scaled_weight(src, dst, (CROSS_KEY[family],))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("file", DECODERS)
def test_decoder_reads_as_one_with_cross_attention(exports, family, file):
    shape = inspect_path(exports[family] / file)
    want = optimum.FAMILIES[family].expect
    assert (shape.num_layers, shape.num_heads, shape.head_dim, shape.ffn_size, shape.ffn_gated,
            shape.vocab_size) == (2, want["num_heads"], want["head_dim"], want["ffn_size"],
                                  want["ffn_gated"], want["vocab_size"])
    assert shape.cross_attention == 2 and shape.kind == "decoder"
    roles = {s.name: s.role for s in input_specs(exports[family] / file)}
    if file == "decoder_model.onnx":
        assert roles["encoder_hidden_states"] == "encoder_states"
        assert shape.encoder_input == "encoder_hidden_states" and shape.cache is None
    elif family == "vit_gpt2":  # GPT-2 recomputes its cross keys every step
        assert roles["encoder_hidden_states"] == "encoder_states"
        assert shape.cache is not None and shape.cache.num_layers == 2
    else:
        assert shape.cache is not None and shape.cache.num_layers == 2  # the growing one
        cross = [n for n, r in roles.items() if r == "encoder_cache"]
        assert len(cross) == 4 and all(".encoder." in n for n in cross)
        assert all(r == "kv_cache" for n, r in roles.items() if ".decoder." in n)
    assert (roles.get("encoder_attention_mask") == "encoder_mask") == (family in MASKED)
    assert roles["input_ids"] == "token_ids"


@pytest.mark.parametrize("family", FAMILIES)
def test_encoder_reads_as_an_encoder(exports, family):
    shape = inspect_path(exports[family] / "encoder_model.onnx")
    assert shape.kind == "encoder" and shape.num_layers == 2 and shape.cross_attention == 0


def test_inspect_says_what_it_can_do(exports):
    code, out, _ = _run(["inspect", str(exports["bart"] / "decoder_with_past_model.onnx"),
                         "--json"])
    assert code == 0
    shape = json.loads(out)
    assert shape["cross_attention"] == 2
    rules = {f["rule"] for f in shape["findings"]}
    assert "encoder-decoder" in rules and "logits-every-position" not in rules


def test_gate_feeds_the_encoder_at_its_own_length(exports):
    """The decoder's tokens and the encoder's length differ; the encoder mask pads rows;
    the with-past file is fed decode steps and a chunk against caches of several lengths."""
    first = gate_feeds(load_model(exports["bart"] / "decoder_model.onnx"), 1003)
    for feed in first:
        ids, states, mask = (feed["input_ids"], feed["encoder_hidden_states"],
                             feed["encoder_attention_mask"])
        assert states.shape[:2] == mask.shape and states.shape[1] != ids.shape[1]
    assert any(not feed["encoder_attention_mask"].all() for feed in first)  # padded rows
    later = gate_feeds(load_model(exports["bart"] / "decoder_with_past_model.onnx"), 1003)
    assert [(f["input_ids"].shape, f["past_key_values.0.decoder.key"].shape[2]) for f in later] \
        == [((b, s), p) for b, s, p in SEQ2SEQ_STEPS]
    for f in later:
        assert f["past_key_values.0.encoder.key"].shape[2] == f["encoder_attention_mask"].shape[1]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("file", DECODERS)
def test_gate_passes_itself_and_fails_a_corrupted_copy(exports, family, file, tmp_path):
    src = exports[family] / file
    assert _run(["verify", str(src), str(src)])[0] == 0
    # the first step computes the cross keys: corrupt them; later steps take them as a
    # cache, so a corrupted norm stands in
    bad = (_cross_corrupted(src, tmp_path / file, family) if file == "decoder_model.onnx"
           else perturbed_copy(src, tmp_path / file))
    code, out, _ = _run(["verify", str(src), str(bad)])
    assert code == 1 and "FAIL" in out


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_folder_generates_what_the_original_does(exports, family, tmp_path):
    out = tmp_path / "padded"
    code, text, err = _run(["pad", str(exports[family]), "-o", str(out),
                            "--vocab-multiple", "64", "--ffn-multiple", "64"])
    assert code == 0, err
    assert "left out decoder_model_merged.onnx" in text
    assert sorted(p.name for p in out.glob("*.onnx")) == sorted(
        ["encoder_model.onnx", *DECODERS])
    assert (out / "config.json").is_file()
    for file in DECODERS:
        shape = inspect_path(out / file)
        assert (shape.ffn_size, shape.vocab_size) == (256, 1024)
    assert inspect_path(out / "encoder_model.onnx").ffn_size == 256  # ViT's pixels too
    assert _run(["verify", str(exports[family]), str(out)])[0] == 0  # graph by graph
    original, padded = optimum.seq2seq_greedy([exports[family], out])
    assert "decoder_model_merged.onnx" in original["files"]  # Optimum ran the merged one
    assert "decoder_model_merged.onnx" not in padded["files"]
    np.testing.assert_array_equal(original["tokens"], padded["tokens"])
    a, b = original["scores"], padded["scores"]  # (steps, rows, vocab); -inf where suppressed
    assert a.shape == b.shape and a.shape[0] == 12
    finite = np.isfinite(a)
    np.testing.assert_array_equal(finite, np.isfinite(b))
    assert finite.sum() > 1000 and np.abs(a[finite] - b[finite]).max() < 1e-4


def test_quantized_folder_pads_exactly(exports, tmp_path):
    """Each graph of BART's export through ONNX Runtime's dynamic int8 quantizer (what
    Optimum's ORTQuantizer runs per file): padded through its MatMulInteger weights, the
    folder still generates in Optimum's loop what the quantized original does."""
    src = tmp_path / "quantized"
    shutil.copytree(exports["bart"], src, ignore=shutil.ignore_patterns("*.onnx"))
    for name in ("encoder_model.onnx", *DECODERS):
        quantize_dynamic_copy(exports["bart"] / name, src / name)
    out = tmp_path / "padded"
    code, _, err = _run(["pad", str(src), "-o", str(out), "--vocab-multiple", "64",
                         "--ffn-multiple", "64"])
    assert code == 0, err
    assert inspect_path(out / "decoder_with_past_model.onnx").ffn_size == 256
    original, padded = optimum.seq2seq_greedy([src, out])
    np.testing.assert_array_equal(original["tokens"], padded["tokens"])
    finite = np.isfinite(original["scores"])
    assert np.abs(original["scores"][finite] - padded["scores"][finite]).max() < 1e-4


def test_pad_folder_refusals_write_nothing(exports, tmp_path):
    src = exports["t5"]
    out = tmp_path / "out"
    decoders = tmp_path / "decoders"  # heads: the decoders keep theirs, so nothing to pad
    decoders.mkdir()
    for name in (*DECODERS, "config.json"):
        shutil.copy2(src / name, decoders / name)
    code, _, err = _run(["pad", str(decoders), "-o", str(out), "--head-dim", "64"])
    assert code == 2 and "no graph could be padded" in err and "cross-attention" in err
    assert not out.exists()
    merged_only = tmp_path / "merged-only"
    merged_only.mkdir()
    for name in ("encoder_model.onnx", "decoder_model_merged.onnx", "config.json"):
        shutil.copy2(src / name, merged_only / name)
    code, _, err = _run(["pad", str(merged_only), "-o", str(out), "--ffn-multiple", "64"])
    assert code == 2 and "only there merged" in err and not out.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _run(["pad", str(empty), "-o", str(out), "--ffn-multiple", "64"])
    assert code == 2 and "no .onnx graph" in err and not out.exists()
    out.mkdir()
    code, _, err = _run(["pad", str(src), "-o", str(out), "--ffn-multiple", "64"])
    assert code == 2 and "--force" in err
    assert not list(tmp_path.glob(".out.*"))  # no staging folder left behind
    code, _, err = _run(["optimize", str(decoders), "-o", str(tmp_path / "o")])
    assert code == 2 and "decoder_with_past_model.onnx" in err  # (no encoder: not a folder
    assert "give one of them" in err  # `tuner optimize FOLDER` takes: tests/test_optimize_folder.py)


def test_inspect_a_folder(exports):
    """Each graph of the export in turn; the merged decoder named, not read."""
    code, out, err = _run(["inspect", str(exports["bart"]), "--json"])
    assert code == 0, err
    folder = json.loads(out)
    assert sorted(folder["graphs"]) == sorted(["encoder_model.onnx", *DECODERS])
    assert folder["merged"] == ["decoder_model_merged.onnx"]
    assert folder["graphs"]["decoder_model.onnx"]["cross_attention"] == 2
    assert folder["graphs"]["encoder_model.onnx"]["kind"] == "encoder"
    code, out, _ = _run(["inspect", str(exports["bart"])])
    assert code == 0 and out.count("decoder (of an encoder-decoder) transformer") == 2
    assert "encoder transformer" in out and "a merged decoder" in out


def test_a_decoder_only_folder_beside_its_merged_copy(tmp_path):
    """Optimum's decoder-only export folder (model.onnx, tokenizer) with the legacy merged
    decoder beside it: model.onnx padded (its cache gated by rollouts), the merged one left
    out, the tokenizer copied: no encoder-decoder needed for a folder."""
    kv = optimum.cached("llama")
    src = tmp_path / "llama"
    src.mkdir()
    for f in kv.parent.iterdir():
        if f.suffix != ".onnx" or f.name == "model.onnx":
            shutil.copy2(f, src / f.name)
    shutil.copy2(optimum.merged("llama"), src / "decoder_model_merged.onnx")
    out = tmp_path / "out"
    code, text, err = _run(["pad", str(src), "-o", str(out), "--vocab-multiple", "64",
                            "--head-dim", "32"])
    assert code == 0, err
    assert "model.onnx: vocab 1003->1024, head_dim 24->32" in text
    assert "left out decoder_model_merged.onnx" in text
    assert sorted(p.name for p in out.glob("*.onnx")) == ["model.onnx"]
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


def test_heads_pad_the_encoder_and_keep_the_decoders(exports, tmp_path):
    """--head-dim on a folder: the encoder's heads are its own (padded); the decoders hand
    their cross keys from file to file, so they are kept as they were, and say why."""
    out = tmp_path / "out"
    code, text, err = _run(["pad", str(exports["t5"]), "-o", str(out), "--head-dim", "64"])
    assert code == 0, err
    assert inspect_path(out / "encoder_model.onnx").head_dim == 64
    for name in DECODERS:
        assert f"{name}: kept as it was" in text
        assert (out / name).read_bytes() == (exports["t5"] / name).read_bytes()
    code, text, _ = _run(["verify", str(exports["t5"]), str(out)])
    assert code == 0 and text.count("the same bytes as") == 2  # the kept ones are not run
    assert "encoder_model.onnx: accuracy" in text


def test_verify_folders_graph_by_graph(exports, tmp_path):
    """`tuner verify A B` on two folders: each graph against its namesake; one corrupted
    graph FAILS the whole (exit 1), a missing one is bad input (exit 2)."""
    src = exports["t5"]
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    perturbed_copy(src / "encoder_model.onnx", copy / "encoder_model.onnx")
    code, out, _ = _run(["verify", str(src), str(copy)])
    assert code == 1
    tables = out.split("encoder_model.onnx: accuracy")  # sorted: the decoders come first
    assert len(tables) == 2 and tables[0].count("the same bytes as") == 2  # copies: not run
    assert tables[1].strip().endswith("FAIL")
    (copy / "decoder_model.onnx").unlink()
    code, _, err = _run(["verify", str(src), str(copy)])
    assert code == 2 and "no decoder_model.onnx" in err
    code, _, err = _run(["verify", str(src), str(src / "decoder_model.onnx")])
    assert code == 2 and "two folders" in err


def test_merged_decoder_points_at_its_branches(exports, tmp_path):
    """Optimum's merged decoder of an encoder-decoder: its branches are already files of the
    export, so unmerge refuses it (exit 2, nothing written) rather than fail its gate."""
    merged = exports["bart"] / "decoder_model_merged.onnx"
    out = tmp_path / "plain.onnx"
    code, _, err = _run(["unmerge", str(merged), "-o", str(out)])
    assert code == 2 and "decoder_with_past_model.onnx" in err and not out.exists()
    code, _, err = _run(["inspect", str(merged)])
    assert code == 2 and "decoder_with_past_model.onnx" in err


def test_learned_positions_shifted_by_two(exports):
    """BART's 258-row position table takes 256 tokens (positions start at row 2): optimize
    measured an encoder at 258 and stopped inside ONNX Runtime."""
    encoder = load_model(exports["bart"] / "encoder_model.onnx")
    assert max_positions(encoder, inspect_path(exports["bart"] / "encoder_model.onnx")) == 256


def test_decoder_served_as_a_tensor_model(exports, tmp_path):
    """optimize + serve on BART's first decoder step: Triton's gRPC client sends requests
    of their own encoder lengths, at once; each answer is ONNX Runtime's on the original."""
    import tritonclient.grpc as tg

    src = exports["bart"] / "decoder_model.onnx"
    art = tmp_path / "art"
    code, _, err = _run(["optimize", str(src), "-o", str(art), "--rounds", "2", "--warmup", "0",
                         "--no-probe", "--no-fuse", "--max-variants", "2", "--no-cache",
                         "--bucket-rounds", "1", "--max-buckets", "2", "--no-plots"])
    assert code == 0, err
    assert "tensor model" in (art / "report.md").read_text()
    code, _, err = _run(["optimize", str(exports["bart"] / "decoder_with_past_model.onnx"),
                         "-o", str(tmp_path / "later")])  # a step against a cache: refused
    assert code == 2 and "one token against a cache" in err and not (tmp_path / "later").exists()
    sess = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    port, http_port = free_port(), free_port()
    proc = serve_process(art, port, "bart", "--max-batch", "4", "--http-port", str(http_port))
    try:
        client = tg.InferenceServerClient(f"127.0.0.1:{port}")

        def one(seed: int) -> float:
            rng = np.random.default_rng(seed)
            rows, enc, seq = 1 + seed % 2, 5 + seed, 1 + seed % 3
            mask = np.ones((rows, enc), np.int64)
            mask[0, enc - 2:] = 0
            feed = {"encoder_attention_mask": mask,
                    "input_ids": rng.integers(0, 1003, (rows, seq)),
                    "encoder_hidden_states": rng.standard_normal((rows, enc, 80)).astype(
                        np.float32)}
            made = []
            for name, arr in feed.items():
                made.append(tg.InferInput(name, list(arr.shape),
                                          "INT64" if arr.dtype == np.int64 else "FP32"))
                made[-1].set_data_from_numpy(arr)
            got = client.infer("bart", made)
            want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))
            return max(float(np.abs(got.as_numpy(n) - want[n]).max())
                       for n in ("logits", "present.0.encoder.key", "present.1.decoder.value"))

        with ThreadPoolExecutor(6) as pool:
            assert max(pool.map(one, range(12))) < 1e-5
        # a text API asked of it says why not (the artifact has BART's tokenizer.json)
        ask = urllib.request.Request(
            f"http://127.0.0.1:{http_port}/v1/completions", method="POST",
            data=json.dumps({"model": "bart", "prompt": "w5 w6", "max_tokens": 2}).encode(),
            headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(ask, timeout=30)
        assert refused.value.code == 400
        assert "tensor model" in json.loads(refused.value.read())["error"]["message"]
    finally:
        proc.kill()
        proc.communicate()
