"""Embedding models as their hub repositories hold them (models/embedding_repos.py): the
sentence-transformers files at the top, the graphs Optimum wrote under onnx/ (model.onnx,
model_O2.onnx, model_qint8_avx512_vnni.onnx), all-MiniLM-L6-v2's real weights and a
Qwen3-Embedding-shaped decoder. What a user does with such a repository:

- `tuner optimize REPO/onnx/model_O2.onnx`: the tokenizer and pooling files come from the
  repository's top (they were left behind: the artifact could not embed text), and the
  served vectors are sentence-transformers' own;
- the fused copies: ONNX Runtime's optimizer, as Optimum runs it, feeds Attention each row's
  count of ones, which is wrong for a left-padded row; the gate sees it. Our own fusion feeds
  the raw mask and is exact there (it was refused on every BERT-like encoder before);
- Qwen3-Embedding's fused graph (com.microsoft.RotaryEmbedding takes position_ids itself):
  its positions were taken for a second mask, and serve refused the artifact optimize wrote;
- torch's dynamo export at opset 23 (SDPA as ONNX's own Attention op, which takes the mask):
  the mask's values reached no Where or Softmax, and its length (through Shape) reached the
  position table, so it was taken for the positions; served, every vector was wrong;
- the encoder families embedding models are built on (MPNet, XLM-RoBERTa, ModernBERT,
  DeBERTa-v2, ELECTRA, DistilBERT, ALBERT): inspected, padded exactly (or refused naming the
  node) and the padded graph served, its vectors sentence-transformers' own.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from llm_support import openai_client, start
from serving_support import make_artifact, perturbed_copy

from models import optimum
from models.embedding_repos import ENCODERS, REPOS, repos
from tuner.artifact.records import Buckets
from tuner.cli import main
from tuner.graph.roles import input_specs
from tuner.jobs.optimize import _copy_text_files
from tuner.runtime.ort_fusion import fuse_file

pytestmark = pytest.mark.venv(*optimum.VENV)  # built beside the first tests (conftest)

TEXTS = ["A fox jumps over the lazy dog.", "Ein Fuchs springt über den faulen Hund.",
         "Le renard saute.", "shapes " * 40]
FAST = ["-q", "--rounds", "3", "--warmup", "1"]
BUCKETS = Buckets(batch=(1, 2, 4), seq=(16, 64, 256))


@pytest.fixture(scope="module")
def built() -> dict[str, Path]:
    """Every repository, those missing exported in one Optimum process."""
    return dict(zip(REPOS, repos(list(REPOS))))


@pytest.fixture(scope="module")
def minilm(built) -> Path:
    return built["minilm"]


@pytest.fixture(scope="module")
def qwen3(built) -> Path:
    return built["qwen3_embedding"]


def _encode(folder: Path, texts: list[str], **kwargs) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(texts, **kwargs)


def _embeddings(server, texts: list[str]) -> np.ndarray:
    got = openai_client(server).embeddings.create(model=server.slot.name, input=texts,
                                                  encoding_format="float")
    return np.array([d.embedding for d in got.data])


def _served(out: Path, texts: list[str]) -> np.ndarray:
    server = start(out)
    try:
        return _embeddings(server, texts)
    finally:
        server.stop(5)


@pytest.fixture(scope="module")
def encoders(built) -> dict[str, Path]:
    return {name: built[name] for name in ENCODERS}


# DeBERTa's disentangled attention multiplies the query by the relative position keys,
# which the head-dim rewrite does not widen: refused, naming that MatMul
HEAD_DIM_REFUSED = {"deberta_v2": "contracts the widened axis with an unwidened one"}


@pytest.mark.parametrize("family", list(ENCODERS))
def test_encoder_families_pad_exactly_and_serve(encoders, family, tmp_path, capsys) -> None:
    from tuner.graph.inspect import inspect_path

    src = encoders[family] / "onnx" / "model.onnx"
    shape = inspect_path(src)
    assert (shape.kind, shape.num_layers, shape.hidden_size, shape.num_heads, shape.head_dim,
            shape.ffn_size) == ("encoder", 2, 96, 4, 24, 200)
    padded = tmp_path / "padded.onnx"
    wider = ["--head-dim", "32"] if family not in HEAD_DIM_REFUSED else []
    if not wider:
        assert main(["pad", str(src), "-o", str(padded), "--head-dim", "32"]) == 2
        assert HEAD_DIM_REFUSED[family] in capsys.readouterr().err
    assert main(["pad", str(src), "-o", str(padded), "--ffn-multiple", "64", *wider]) == 0
    out = make_artifact(tmp_path / "out", src, BUCKETS, variant=padded)
    _copy_text_files(encoders[family], out)
    server = start(out)
    try:
        assert server.slot.engine.model.served == "padded", server.slot.engine.model.note
        np.testing.assert_allclose(_embeddings(server, TEXTS), _encode(encoders[family], TEXTS),
                                   atol=1e-5)
    finally:
        server.stop(5)


def test_a_copy_under_onnx_takes_the_repositorys_tokenizer(minilm, tmp_path) -> None:
    out = tmp_path / "out"
    assert main(["optimize", str(minilm / "onnx" / "model_O2.onnx"), "-o", str(out),
                 *FAST]) == 0
    for name in ("tokenizer.json", "modules.json", "sentence_bert_config.json",
                 "1_Pooling/config.json"):
        assert (out / name).read_bytes() == (minilm / name).read_bytes(), name
    np.testing.assert_allclose(_served(out, TEXTS), _encode(minilm, TEXTS), atol=1e-5)


def test_the_quantized_copy_serves_its_own_vectors(minilm, tmp_path) -> None:
    """The int8 copy's vectors are its own (as ONNX Runtime runs the file, pooled as
    sentence-transformers pools), near the float model's."""
    src = minilm / "onnx" / "model_qint8_avx512_vnni.onnx"
    out = make_artifact(tmp_path / "out", src, BUCKETS)
    _copy_text_files(src.parent, out)
    got = _served(out, TEXTS[:3])
    from tokenizers import Tokenizer

    tok, session = Tokenizer.from_file(str(minilm / "tokenizer.json")), ort.InferenceSession(
        str(src), providers=["CPUExecutionProvider"])
    tok.no_padding()
    for row, text in zip(got, TEXTS[:3]):
        ids = np.array([tok.encode(text).ids])
        states, = session.run(["last_hidden_state"], {
            "input_ids": ids, "attention_mask": np.ones_like(ids),
            "token_type_ids": np.zeros_like(ids)})
        mean = states[0].mean(0)
        np.testing.assert_allclose(row, mean / np.linalg.norm(mean), atol=1e-5)
    floats = _encode(minilm, TEXTS[:3])
    assert ((got * floats).sum(1) > 0.9).all()  # quantized: near, not equal


def test_fused_attention_is_gated_on_left_padded_rows(minilm, tmp_path) -> None:
    """The gate's feeds hold left-padded rows: Optimum's O2 copy (the mask as each row's
    length) FAILS on them; our fusion (the raw mask) passes, and a corrupted copy of it
    FAILS."""
    plain = minilm / "onnx" / "model.onnx"
    assert main(["verify", str(plain), str(minilm / "onnx" / "model_O2.onnx")]) == 1
    fused = tmp_path / "fused.onnx"
    ops = fuse_file(plain, fused, num_heads=12, hidden_size=384)
    assert ops["Attention"] == 6
    assert main(["verify", str(plain), str(fused)]) == 0
    assert main(["verify", str(plain), str(perturbed_copy(fused, tmp_path / "bad.onnx"))]) == 1


def test_a_head_padded_variant_fused_keeps_the_models_scale(minilm, tmp_path) -> None:
    """Fused, an attention op scales its scores by 1/sqrt(its head size) unless told: after
    head-dim padding (32 -> 64) that is the wrong width's. The model's own scale (inspect's,
    1/sqrt(32)) is written on each fused op; without it the gate FAILS the variant. inspect
    reads the padded graph's own scale back (it reported none before)."""
    from tuner.graph.inspect import inspect_path

    plain, padded = minilm / "onnx" / "model.onnx", tmp_path / "padded.onnx"
    assert main(["pad", str(plain), "-o", str(padded), "--head-dim", "64"]) == 0
    scale = inspect_path(plain).softmax_scale()
    assert scale == pytest.approx(32 ** -0.5)
    # the padded graph reads its pinned scale back (a Sqrt of 1 / sqrt(32) on q and on k)
    assert inspect_path(padded).softmax_scale() == pytest.approx(scale)
    for pinned, code in ((None, 1), (scale, 0)):
        fused = tmp_path / f"fused-{code}.onnx"
        assert fuse_file(padded, fused, num_heads=12, hidden_size=384, scale=pinned)
        assert main(["verify", str(plain), str(fused)]) == code


def test_a_mask_read_as_lengths_is_named_and_left_padding_refused(minilm, tmp_path) -> None:
    """inspect warns of Optimum's O2 copy; served, its right-padded rows answer as the plain
    export does and a left-padded row is INVALID_ARGUMENT (it would be wrong), over
    tritonclient's HTTP client."""
    import tritonclient.http as http
    from tritonclient.utils import InferenceServerException

    o2, plain = minilm / "onnx" / "model_O2.onnx", minilm / "onnx" / "model.onnx"
    [finding] = [f for f in _findings(o2) if f.rule == "mask-as-lengths"]
    assert finding.severity == "warning" and "Attention_0" in finding.message
    assert not [f for f in _findings(plain) if f.rule == "mask-as-lengths"]
    ids = np.random.default_rng(0).integers(1000, 20000, (2, 12))
    right = np.ones_like(ids)
    right[1, 7:] = 0
    server = start(make_artifact(tmp_path / "out", o2, BUCKETS))
    try:
        client = http.InferenceServerClient(f"127.0.0.1:{server.http_port}")

        def infer(mask: np.ndarray) -> np.ndarray:
            inputs = []
            for name, array in (("input_ids", ids), ("attention_mask", mask),
                                ("token_type_ids", np.zeros_like(ids))):
                inputs.append(http.InferInput(name, list(array.shape), "INT64"))
                inputs[-1].set_data_from_numpy(array)
            return client.infer(server.slot.name, inputs).as_numpy("last_hidden_state")

        want, = ort.InferenceSession(str(plain), providers=["CPUExecutionProvider"]).run(
            ["last_hidden_state"], {"input_ids": ids, "attention_mask": right,
                                    "token_type_ids": np.zeros_like(ids)})
        got = infer(right)
        np.testing.assert_allclose(got[0], want[0], atol=1e-4)
        np.testing.assert_allclose(got[1, :7], want[1, :7], atol=1e-4)
        with pytest.raises(InferenceServerException, match="row 1 of input 'attention_mask' "
                           "is padded on the left or has holes"):
            infer(right[:, ::-1].copy())
    finally:
        server.stop(5)


def test_a_decoder_embedding_model_fused_and_served(qwen3, tmp_path) -> None:
    """Qwen3-Embedding's layout: optimize the repository, serve it; the fused variant (each
    rotary a com.microsoft.RotaryEmbedding fed position_ids) keeps its positions' role and
    is served; last-token vectors equal sentence-transformers', prompts included."""
    out = tmp_path / "out"
    assert main(["optimize", str(qwen3), "-o", str(out), *FAST]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    fused = next(v for v in manifest["variants"] if v["name"] == "fuse")
    graph = out / fused["path"]
    roles = {s.name: s.role for s in input_specs(graph)}
    assert roles == {"input_ids": "token_ids", "attention_mask": "attention_mask",
                     "position_ids": "position_ids"}
    assert sum(n.op_type == "RotaryEmbedding" for n in _nodes(graph)) == 4
    served = make_artifact(tmp_path / "fused", qwen3 / "onnx" / "model.onnx", BUCKETS,
                           variant=graph, variant_name="fuse")
    _copy_text_files(qwen3, served)
    server = start(served)
    try:
        assert server.slot.engine.model.served == "fuse", server.slot.engine.model.note
        np.testing.assert_allclose(_embeddings(server, TEXTS), _encode(qwen3, TEXTS),
                                   atol=1e-5)
        import requests

        r = requests.post(f"http://127.0.0.1:{server.http_port}/embed",
                          json={"inputs": TEXTS[:2], "prompt_name": "query"}, timeout=60)
        np.testing.assert_allclose(r.json(), _encode(qwen3, TEXTS[:2], prompt_name="query"),
                                   atol=1e-5)
    finally:
        server.stop(5)


def test_a_dynamo_export_with_onnx_attention_keeps_its_mask(minilm, tmp_path) -> None:
    import torch
    import transformers

    from tuner.graph.inspect import inspect_path

    model = transformers.AutoModel.from_pretrained(minilm, attn_implementation="sdpa").eval()

    class Hidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask)[0]

    ids = torch.randint(1000, 5000, (2, 16))
    src = tmp_path / "model.onnx"
    axes = {0: "batch", 1: "sequence"}
    torch.onnx.export(Hidden(), (ids, torch.ones_like(ids)), dynamo=True, opset_version=23,
                      input_names=["input_ids", "attention_mask"],
                      output_names=["last_hidden_state"],
                      dynamic_shapes={"input_ids": axes, "attention_mask": axes}).save(str(src))
    assert any(n.op_type == "Attention" and n.domain == "" for n in _nodes(src))
    assert {s.name: s.role for s in input_specs(src)} == {"input_ids": "token_ids",
                                                          "attention_mask": "attention_mask"}
    assert inspect_path(src).head_dim == 32
    out = make_artifact(tmp_path / "out", src, BUCKETS)
    _copy_text_files(minilm, out)
    np.testing.assert_allclose(_served(out, TEXTS), _encode(minilm, TEXTS), atol=1e-5)


def _findings(path: Path):
    from tuner.graph.inspect import inspect_path
    from tuner.plan.findings import audited

    return audited(inspect_path(path)).findings


def _nodes(path: Path):
    import onnx

    return onnx.load(str(path), load_external_data=False).graph.node


def test_a_text_past_xlm_robertas_positions_is_cut_where_sentence_transformers_cuts_it(
        encoders, tmp_path) -> None:
    """Without sentence_bert_config.json's max_seq_length, sentence-transformers cuts a text
    at the tokenizer's 512; the server cut it at config.json's max_position_embeddings, 514
    for XLM-R and RoBERTa, whose positions start at 2 (and refused the request: longer than
    the largest bucket). It cuts at the 512 the graph's position table takes now."""
    repo = tmp_path / "repo"
    shutil.copytree(encoders["xlm_roberta"], repo)
    (repo / "sentence_bert_config.json").unlink()
    out = make_artifact(tmp_path / "out", repo / "onnx" / "model.onnx",
                        Buckets(batch=(1,), seq=(128, 512)))
    _copy_text_files(repo, out)
    texts = ["shapes and sizes " * 200]  # 600 tokens and more
    server = start(out)
    try:
        assert server.slot.engine.model.max_positions == 512
        np.testing.assert_allclose(_embeddings(server, texts), _encode(repo, texts), atol=1e-5)
    finally:
        server.stop(5)
