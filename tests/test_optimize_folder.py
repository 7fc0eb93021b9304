"""`tuner optimize FOLDER -o OUT` (and inspect, pad, verify) on export folders as users
bring them (Optimum's flat layout, a transformers.js repository's with the graphs under
onnx/). An encoder-decoder's: every variant is the whole folder padded and gated, its cache
path checked, timed on whole requests; OUT is the selected folder, which the server loads
and which generates the source's tokens. A decoder-only's: its model.onnx optimized, the
tokenizer beside it carried into the artifact. Bad input exits 2 and writes nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from models import optimum
from serving.seq2seq import load_seq2seq
from tests.serving_support import quantize_dynamic_copy, scaled_weight, seq2seq_tokens
from tuner.cli import main
from tuner.graph.seq2seq_record import FILES, find_seq2seq_record
from tuner.jobs import optimize_folder as job
from tuner.measure.select import Selection
from tuner.measure.stats import RatioCI

FAST = ["-q", "--rounds", "5", "--warmup", "1"]


@pytest.fixture(scope="module")
def exports() -> dict[str, Path]:
    cells = [(f, optimum.FAMILIES[f].tasks[0]) for f in ("bart", "whisper")]
    return {f: p.parent for (f, _), p in zip(cells, optimum.export_all(cells))}


def test_a_folder_is_optimized_into_a_folder_that_serves(exports, tmp_path, capsys):
    src, out = exports["bart"], tmp_path / "out"
    assert main(["optimize", str(src), "-o", str(out), "--json", *FAST]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record == json.loads((out / "selection.json").read_text())
    names = [v["name"] for v in record["variants"]]
    assert names[0] == "original" and len(names) >= 2 and record["selected"] in names
    for v in record["variants"]:
        assert v["gate_max_abs"] <= 1e-4 and v["cache_path_max_abs"] <= 1e-4
        assert v["request_ms"] > 0 and all(p > 0 for p in v["parts_ms"])
        assert (v["speedup"] is None) == (v["name"] == "original")
    padded = record["variants"][1]
    assert padded["transforms"] and all(":" in t for t in padded["transforms"])
    vocab = next(v for v in record["variants"] if v["name"].startswith("vocab"))
    assert [part for part, ratio in vocab["unchanged"] if ratio > 0] == ["encoder"]  # (A/A)
    assert record["variants"][0]["unchanged"] == []
    assert record["workload"] == {"batch": 1, "source_tokens": 32, "output_tokens": 32,
                                  "note": record["workload"]["note"]}
    assert {*FILES, "config.json", "tokenizer.json", "report.md", "timings.png"} <= {
        f.name for f in out.iterdir()}
    assert not (out / "variants").exists()
    assert (out / "timings.png").read_bytes()[:4] == b"\x89PNG"
    assert "| original |" in (out / "report.md").read_text()
    if record["selected"] == "original":  # (the honest answer on a CPU)
        for name in FILES:
            assert (out / name).read_bytes() == (src / name).read_bytes()
    assert seq2seq_tokens(out) == seq2seq_tokens(src)
    assert main(["optimize", str(src), "-o", str(out), *FAST]) == 2  # exists, no --force
    assert "--force" in capsys.readouterr().err


def test_the_selected_padded_variant_is_what_out_holds(exports, tmp_path, monkeypatch):
    """The selection rule is tested on its own (tests/test_bench.py); here it is made to pick
    the padded vocabulary, so that OUT is that folder: padded graphs, the same tokens."""
    monkeypatch.setattr(job, "select", lambda speedups, margin, **_: Selection(
        next(n for n in speedups if n.startswith("vocab")), "chosen by the test"))
    src, out = exports["bart"], tmp_path / "out"
    assert main(["optimize", str(src), "-o", str(out), *FAST]) == 0
    record = json.loads((out / "selection.json").read_text())
    assert record["selected"].startswith("vocab-")
    assert (out / "decoder_model.onnx").read_bytes() != (src / "decoder_model.onnx").read_bytes()
    assert find_seq2seq_record(out).vocab == find_seq2seq_record(src).vocab  # sliced back
    assert seq2seq_tokens(out) == seq2seq_tokens(src)


def test_a_win_must_clear_what_the_same_work_shows():
    """Whisper-tiny's vocabulary padding measured 1.047x [1.026, 1.067] in one run while its
    encoder, the original's bytes, timed 1.063x: above the 3% margin, and still no win; the
    same interval where the unchanged parts agree within it is one."""
    ci = RatioCI(1.047, 1.026, 1.067, 0.95, 9)
    speedups = {"original": RatioCI(1, 1, 1, 0.95, 9), "vocab-51904": ci}
    for unchanged, selected in (((("encoder", 1.063),), "original"),
                                ((("encoder", 1.004),), "vocab-51904"),
                                ((("encoder", 0.95),), "vocab-51904"), ((), "vocab-51904")):
        chosen = job.select(speedups, 0.02, eligible=job.clears_noise(
            speedups, {"vocab-51904": unchanged}))
        assert chosen.name == selected, unchanged
    assert "timed 1.063x" in job._vetoed("vocab-51904", ci, (("encoder", 1.063),))


def test_a_transformers_js_layout_and_audio(exports, tmp_path, capsys):
    """Whisper with its graphs under onnx/ (configs at the top), two streams at once: OUT is
    flat, the audio's one shape timed, and the same tokens come out (--no-plots: no
    timings.png, nor a word of it)."""
    src = tmp_path / "repo"
    (src / "onnx").mkdir(parents=True)
    for f in exports["whisper"].iterdir():
        shutil.copy(f, src / "onnx" / f.name if f.name in FILES else src / f.name)
    (src / "decoder_model_merged.onnx").unlink(missing_ok=True)
    out = tmp_path / "out"
    assert main(["optimize", str(src), "-o", str(out), "--streams", "2", "--no-plots",
                 *FAST]) == 0
    printed = capsys.readouterr().out
    assert "selected " in printed and "ms/request (encoder" in printed
    assert not (out / "timings.png").exists() and "timings.png" not in printed  # --no-plots
    assert "timings.png" not in (out / "report.md").read_text()
    record = json.loads((out / "selection.json").read_text())
    assert record["workload"]["source_tokens"] is None and record["workload"]["batch"] == 2
    assert "audio features" in record["workload"]["note"]
    assert seq2seq_tokens(out) == seq2seq_tokens(exports["whisper"])


def test_traffic_from_a_requests_file(exports, tmp_path):
    src, out = exports["bart"], tmp_path / "out"
    jsonl = tmp_path / "traffic.jsonl"
    jsonl.write_text('{"prompt_tokens": 12, "output_tokens": 6}\n'
                     '{"prompt_tokens": 20, "output_tokens": 10}\n'
                     '{"prompt_tokens": 40, "output_tokens": 8}\n')
    assert main(["optimize", str(src), "-o", str(out), "--requests", str(jsonl),
                 "--max-variants", "2", *FAST]) == 0
    workload = json.loads((out / "selection.json").read_text())["workload"]
    assert (workload["source_tokens"], workload["output_tokens"]) == (20, 8)
    csv = tmp_path / "traffic.csv"
    csv.write_text("seq\n12\n")
    assert main(["optimize", str(src), "-o", str(tmp_path / "o2"), "--requests", str(csv),
                 *FAST]) == 2
    assert not (tmp_path / "o2").exists()


def test_bad_folders_exit_2_and_write_nothing(exports, tmp_path, capsys):
    src = exports["bart"]
    merged = tmp_path / "merged"
    merged.mkdir()
    for name in ("encoder_model.onnx", "decoder_model_merged.onnx", "config.json"):
        shutil.copy(src / name, merged / name)
    broken = tmp_path / "broken"  # a with-past decoder unlike its first step
    shutil.copytree(src, broken)
    scaled_weight(src / "decoder_with_past_model.onnx", broken / "decoder_with_past_model.onnx",
                  ("self_attn/v_proj",))
    cases = [(merged, "tuner unmerge"), (broken, "does not agree"),
             (tmp_path, "nor an encoder-decoder's three graphs")]
    for folder, said in cases:
        out = tmp_path / f"out-{folder.name}"
        assert main(["optimize", str(folder), "-o", str(out), *FAST]) == 2, folder
        assert said in capsys.readouterr().err
        assert not out.exists()
    assert main(["optimize", str(src), "-o", str(src / "inside"), *FAST]) == 2
    assert "inside the model's own folder" in capsys.readouterr().err
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no stage left


def test_a_decoder_only_folder_optimizes_its_model_onnx(tmp_path):
    """A transformers.js repository of a decoder-only model: onnx/model.onnx (a quantized
    copy beside it), configs and tokenizer at the top: the artifact of model.onnx, with the
    tokenizer the server reads."""
    (export,) = optimum.export_all([("llama", "text-generation-with-past")])
    repo = tmp_path / "repo"
    (repo / "onnx").mkdir(parents=True)
    shutil.copy(export, repo / "onnx" / "model.onnx")
    shutil.copy(export, repo / "onnx" / "model_quantized.onnx")  # (not taken)
    for f in export.parent.glob("*.json"):
        shutil.copy(f, repo / f.name)
    out = tmp_path / "out"
    assert main(["optimize", str(repo), "-o", str(out), "--rounds", "2", "--bucket-rounds", "1",
                 "--max-variants", "1", "--no-fuse", "--no-probe", "-q", "--json"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert Path(manifest["source"]["path"]) == (repo / "onnx" / "model.onnx").resolve()
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= {
        f.name for f in out.iterdir()}
    assert main(["optimize", str(repo), "-o", str(repo), "-q"]) == 2  # its own folder


def test_a_dynamically_quantized_folder(exports, tmp_path):
    """Each graph through ONNX Runtime's quantize_dynamic: every variant checked as the
    server checks such a folder (exact with its activations in float, and within the
    quantization's own noise as served); the vocabulary padded through the int8 weights;
    a head dim, which quantized weights refuse, skipped saying why; OUT loads."""
    src = tmp_path / "quantized"
    shutil.copytree(exports["bart"], src, ignore=shutil.ignore_patterns("*.onnx"))
    for name in FILES:
        quantize_dynamic_copy(exports["bart"] / name, src / name)
    out = tmp_path / "out"
    assert main(["optimize", str(src), "-o", str(out), *FAST]) == 0
    record = json.loads((out / "selection.json").read_text())
    names = [v["name"] for v in record["variants"]]
    assert "vocab-1024" in names
    assert any(n.startswith("skipped head_dim") and "quantized" in n for n in record["notes"])
    assert all(v["cache_path_max_abs"] <= 1e-4 for v in record["variants"])  # (in float)
    assert find_seq2seq_record(out).activations_quantized
    load_seq2seq(out).runners.close()


def test_inspect_pad_verify_take_the_transformers_js_layout(exports, tmp_path, capsys):
    """Graphs under onnx/, configs at the top: inspect reads each graph, pad writes OUT flat
    (as Optimum writes a folder), verify pairs each graph with its namesake there."""
    src = tmp_path / "repo"
    (src / "onnx").mkdir(parents=True)
    for f in exports["bart"].iterdir():
        shutil.copy(f, src / "onnx" / f.name if f.name in FILES else src / f.name)
    (src / "decoder_model_merged.onnx").unlink(missing_ok=True)
    assert main(["inspect", str(src), "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["graphs"]) == set(FILES)
    out = tmp_path / "padded"
    assert main(["pad", str(src), "-o", str(out), "--vocab-multiple", "64"]) == 0
    assert set(FILES) <= {f.name for f in out.iterdir()} and not (out / "onnx").exists()
    assert (out / "tokenizer.json").is_file()
    capsys.readouterr()
    assert main(["verify", str(src), str(out)]) == 0
    assert "PASS" in capsys.readouterr().out
    assert seq2seq_tokens(out) == seq2seq_tokens(exports["bart"])
