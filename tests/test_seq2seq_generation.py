"""Generation served from an encoder-decoder export folder (T5, Flan-T5, Marian, BART as
Optimum exports them; models/optimum.py): `tuner serve FOLDER`.

Greedy tokens equal Optimum's own `generate` (ORTModelForSeq2SeqLM on the same folder and
the same two sources, one padded), through Triton's gRPC client, the real `openai` client and
Triton's generate endpoint; each stream in a cohort equals itself alone; the start check
passes on every export and FAILS a folder whose with-past decoder is changed (serve refuses
it); a padded folder (`tuner pad`) generates what the original does; an image encoder is
refused before any port opens (Whisper's audio: tests/test_audio_transcription.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import shutil
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from models import optimum
from serving.errors import InvalidArgument
from serving.generation import GenerateOptions
from serving.sampling import GenerationRequest, Sampling
from serving.seq2seq import load_seq2seq
from serving.text_config import load_text_config
from serving.generation.seq2seq import Seq2SeqGenerator
from tests.llm_support import openai_client, start, wait_for
from tests.serving_support import scaled_weight
from tuner.cli import main
from tuner.errors import BadInput
from tuner.gate.seq2seq_steps import check_cache_path
from tuner.graph.seq2seq_record import find_seq2seq_record

TEXT = ("t5", "flan_t5", "marian", "bart")
NEW = 12  # tokens Optimum generated (min_new_tokens = max_new_tokens: no end token)


@pytest.fixture(scope="module")
def exports() -> dict[str, Path]:
    cells = [(name, optimum.FAMILIES[name].tasks[0]) for name in (*TEXT, "vit_gpt2")]
    return {name: path.parent for (name, _), path in zip(cells, optimum.export_all(cells))}


@pytest.fixture(scope="module")
def optimum_greedy(exports) -> dict[str, dict]:
    """family -> Optimum's greedy generate on its folder (tokens, scores, inputs)."""
    return dict(zip(TEXT, optimum.seq2seq_greedy([exports[f] for f in TEXT], NEW)))


def _sources(reference: dict) -> list[list[int]]:
    """The reference's two sources without their padding."""
    ids, mask = reference["input_input_ids"], reference["input_attention_mask"]
    return [row[m.astype(bool)].tolist() for row, m in zip(ids, mask)]


def _want(folder: Path, reference: dict) -> list[list[int]]:
    """Optimum's tokens after the decoder's start token. Marian's and BART's generation
    config name a `forced_eos_token_id`: transformers puts the end token at the last step
    the length allows, where this server (as vLLM's) generates on and says "length"; so
    there the last token is the end token and is not compared."""
    tokens = reference["tokens"][:, 1:]
    forced = json.loads((folder / "config.json").read_text()).get("forced_eos_token_id")
    if forced is not None:
        assert (tokens[:, -1] == forced).all()
        tokens = tokens[:, :-1]
    return tokens.tolist()


def _request(prompt, n: int = NEW, folder: Path | None = None) -> GenerationRequest:
    """Greedy, `n` tokens; the end tokens of `folder`'s config held back until then (as
    Optimum's min_new_tokens holds them back)."""
    eos = load_text_config(folder).eos_ids if folder is not None else ()
    return GenerationRequest(prompt=tuple(prompt), max_tokens=n, min_tokens=n,
                             sampling=Sampling(), stop_ids=frozenset(eos))


def _tokens(generator, request) -> list[int]:
    return [t for chunk in generator.generate(request) for t in chunk.ids]


def _with_past_changed(src: Path, dst: Path) -> Path:
    """`src` with the with-past decoder's first self-attention value weights scaled."""
    shutil.copytree(src, dst)
    path = dst / "decoder_with_past_model.onnx"
    scaled_weight(path, path, ("SelfAttention/v", "self_attn/v_proj"))
    return dst


@pytest.mark.parametrize("family", TEXT)
def test_cache_path_check_passes_and_a_changed_copy_fails(exports, family, tmp_path):
    model = load_seq2seq(exports[family])
    try:
        assert model.check.passed and model.check.outputs[0].compared >= 12 * model.record.vocab
        assert model.check.outputs[0].max_abs < 1e-4
    finally:
        model.runners.close()
    changed = _with_past_changed(exports[family], tmp_path / "changed")
    with pytest.raises(BadInput, match="does not agree") as refused:
        load_seq2seq(changed)
    assert "FAIL" in str(refused.value)


def test_cache_path_check_fails_closed(exports):
    """A with-past decoder that cannot run, or nothing to compare, is a FAIL, never a pass."""
    record = find_seq2seq_record(exports["bart"])
    model = load_seq2seq(exports["bart"])

    class Broken:
        def infer(self, feeds):
            raise RuntimeError("no session")

    failed = check_cache_path(record, model.runners.encoder, model.runners.first, Broken())
    assert not failed and "no session" in failed.table() and "nothing compared" in failed.table()
    none = check_cache_path(record, model.runners.encoder, model.runners.first,
                            model.runners.later, steps=0)
    assert none.passed  # step 0 alone: the first step against the whole sequence, compared
    assert none.outputs[0].compared == 2 * record.vocab


@pytest.mark.parametrize("family", TEXT)
def test_greedy_equals_optimum_generate(exports, optimum_greedy, family):
    """Both sources at once (one cohort, the second padded, as Optimum batched them) and
    each alone: every token is Optimum's."""
    reference = optimum_greedy[family]
    want = _want(exports[family], reference)
    model = load_seq2seq(exports[family])
    ask = lambda source: _request(source, len(want[0]), exports[family])  # noqa: E731
    generator = Seq2SeqGenerator(model.runners, model.record, model.decoder,
                                 GenerateOptions(max_streams=4), max_target=model.max_target)
    try:
        with ThreadPoolExecutor(2) as pool:
            together = list(pool.map(lambda s: _tokens(generator, ask(s)), _sources(reference)))
        assert together == want
        assert [_tokens(generator, ask(s)) for s in _sources(reference)] == want
    finally:
        generator.close()


def test_cohorts_each_stream_itself_alone_and_cancel_frees(exports):
    """Six sources of their own lengths at once (cohorts of up to 4, the later ones formed
    while the first decodes): each equals itself alone; a cancelled stream leaves its cohort
    at the next step and the others go on (Flan-T5: the random T5 answers all alike)."""
    model = load_seq2seq(exports["flan_t5"])
    generator = Seq2SeqGenerator(model.runners, model.record, model.decoder,
                                 GenerateOptions(max_streams=4), max_target=model.max_target)
    rng = np.random.default_rng(3)
    sources = [rng.integers(4, 1003, n).tolist() for n in (3, 17, 8, 30, 1, 12)]
    try:
        alone = [_tokens(generator, _request(s, 20)) for s in sources]
        with ThreadPoolExecutor(6) as pool:
            together = list(pool.map(lambda s: _tokens(generator, _request(s, 20)), sources))
        assert together == alone and len({tuple(t) for t in alone}) == len(sources)
        chunks = []
        handle = generator.submit(_request(sources[0], 200), chunks.append)
        others = [generator.submit(_request(s, 200), lambda c: None) for s in sources[1:3]]
        assert wait_for(lambda: generator.active == 3 and len(chunks) > 2)
        handle.cancel()
        assert wait_for(lambda: chunks[-1].final)
        assert chunks[-1].reason == "cancelled" and generator.active == 2
        for other in others:
            other.cancel()
        assert wait_for(lambda: generator.active == 0)
        for bad, why in ((_request([5, 10**6]), "outside the vocabulary"),
                         (_request([5], 5000), "decoder's positions")):
            with pytest.raises(InvalidArgument, match=why):
                generator.submit(bad, lambda c: None)
    finally:
        generator.close()


def test_served_to_real_clients(exports, optimum_greedy):
    """`tuner serve FOLDER` in-process: Triton's gRPC client streams Optimum's tokens; the
    openai client (text in, streaming and not) and Triton's generate endpoint answer; a chat
    is refused (no chat template: an encoder-decoder's text is not a chat)."""
    import tritonclient.grpc as tg

    reference, family = optimum_greedy["bart"], "bart"
    server = start(exports[family], model_name=family)
    try:
        client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
        config = client.get_model_config(family).config
        assert config.model_transaction_policy.decoupled
        got: list = []
        end = load_text_config(exports[family]).eos_ids[0]  # TensorRT-LLM clients send it
        client.start_stream(lambda result, error: got.append(error or result))
        for i, source in enumerate(_sources(reference)):
            inputs = []
            for name, arr, kind in (("input_ids", np.array([source], np.int64), "INT64"),
                                    ("max_tokens", np.array([NEW], np.int32), "INT32"),
                                    ("min_length", np.array([NEW], np.int32), "INT32"),
                                    ("end_id", np.array([end], np.int32), "INT32")):
                inputs.append(tg.InferInput(name, list(arr.shape), kind))
                inputs[-1].set_data_from_numpy(arr)
            client.async_stream_infer(family, inputs, request_id=str(i))
        assert wait_for(lambda: sum(
            r.get_response().parameters["triton_final_response"].bool_param
            for r in got if not isinstance(r, Exception)) == 2, 60)
        client.stop_stream()
        assert not [r for r in got if isinstance(r, Exception)]
        streamed = {"0": [], "1": []}
        for r in got:
            ids = r.as_numpy("output_ids")
            if ids is not None:
                streamed[r.get_response().id] += ids.reshape(-1).tolist()
        want = _want(exports[family], reference)
        assert [streamed["0"][:len(want[0])], streamed["1"][:len(want[0])]] == want

        oa = openai_client(server)
        text = oa.completions.create(model=family, prompt="w5 w9 w13", max_tokens=6,
                                     temperature=0, extra_body={"ignore_eos": True})
        pieces = [c.choices[0].text for c in oa.completions.create(
            model=family, prompt="w5 w9 w13", max_tokens=6, temperature=0, stream=True,
            extra_body={"ignore_eos": True})]
        assert text.choices[0].text and "".join(pieces) == text.choices[0].text
        assert text.usage.prompt_tokens == 3 and text.usage.completion_tokens == 6
        body = json.dumps({"text_input": "w5 w9 w13", "max_tokens": 6,
                           "min_length": 6}).encode()
        ask = urllib.request.Request(
            f"http://127.0.0.1:{server.http_port}/v2/models/{family}/generate", data=body,
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(ask, timeout=30) as r:
            assert json.loads(r.read())["text_output"].endswith(text.choices[0].text)
        import openai

        with pytest.raises(openai.BadRequestError, match="template"):
            oa.chat.completions.create(model=family, messages=[{"role": "user",
                                                                 "content": "w5"}])
    finally:
        server.stop(0)


def test_padded_folder_generates_what_the_original_does(exports, optimum_greedy, tmp_path):
    """`tuner pad FOLDER` then the padded folder served by the loop: Optimum's tokens."""
    out = tmp_path / "padded"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["pad", str(exports["marian"]), "-o", str(out), "--vocab-multiple", "64",
                     "--ffn-multiple", "64"]) == 0
    model = load_seq2seq(out)
    assert model.record.vocab == 1003  # (the padded logits are sliced back in the graph)
    generator = Seq2SeqGenerator(model.runners, model.record, model.decoder, GenerateOptions(),
                                 max_target=model.max_target)
    try:
        reference = optimum_greedy["marian"]
        want = _want(exports["marian"], reference)
        assert [_tokens(generator, _request(s, len(want[0]), out))
                for s in _sources(reference)] == want
    finally:
        generator.close()


def test_refused_before_any_port(exports, tmp_path):
    """An image encoder (a captioner's pixels) and a folder whose with-past decoder does
    not match its first step: exit 2, the first before listening, the second once its check
    FAILS (nothing was served)."""
    def serve(folder: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tuner", "serve", str(folder), "--port",
                               "0", "--http-port", "-1", "--metrics-port", "-1"],
                              capture_output=True, text=True, timeout=120)

    done = serve(exports["vit_gpt2"])
    assert done.returncode == 2 and "neither token ids nor audio features" in done.stderr
    assert "listening" not in done.stderr
    done = serve(_with_past_changed(exports["t5"], tmp_path / "changed"))
    assert done.returncode == 2 and "does not agree" in done.stderr
    assert "FAIL" in done.stderr and "answering 0 inference request(s)" in done.stderr


def test_generation_config_constraints(exports, tmp_path):
    """generation_config.json's forced_bos_token_id (mBART's target language) is the first
    token, and a one-token bad_words_ids entry (Marian's pad) is never generated."""
    folder = tmp_path / "bart"
    shutil.copytree(exports["bart"], folder)
    config = json.loads((folder / "generation_config.json").read_text())
    model = load_seq2seq(folder)
    generator = Seq2SeqGenerator(model.runners, model.record, model.decoder, GenerateOptions(),
                                 max_target=model.max_target)
    source = list(range(5, 16))
    try:
        free = _tokens(generator, _request(source, 8, folder))
    finally:
        generator.close()
    config.update(forced_bos_token_id=7, bad_words_ids=[[free[1]], [5, 6]])
    (folder / "generation_config.json").write_text(json.dumps(config))
    model = load_seq2seq(folder)
    assert model.decoder.forced_first == 7 and model.decoder.suppress == (free[1],)
    generator = Seq2SeqGenerator(model.runners, model.record, model.decoder, GenerateOptions(),
                                 max_target=model.max_target)
    try:
        got = _tokens(generator, _request(source, 8, folder))
    finally:
        generator.close()
    assert got[0] == 7 and free[1] not in got and len(got) == 8


# generate's beam settings as a generation config names them (Marian's: num_beams 4), the
# end token allowed early or held back, length penalties of each sign, each early_stopping
BEAMS = ({"num_beams": 4, "min_new_tokens": 0},
         {"num_beams": 3, "min_new_tokens": 0, "length_penalty": 0.0},
         {"num_beams": 4, "min_new_tokens": 0, "length_penalty": -2.0, "early_stopping": True},
         {"num_beams": 2, "min_new_tokens": 3, "length_penalty": 2.0,
          "early_stopping": "never"})


def _as_optimum_generates(exports, options: dict, folders: Path) -> None:
    """Each family's folder, `options` in its generation config (min_new_tokens: the
    request's), generates what Optimum's `generate` does with them (its forced end token
    off: this server does not force it), each answer cut at its end token."""
    references = optimum.seq2seq_greedy([exports[f] for f in TEXT], NEW,
                                        {"forced_eos_token_id": None, **options})
    settings = {k: v for k, v in options.items() if k != "min_new_tokens"}
    for family, reference in zip(TEXT, references):
        folder = folders / family
        shutil.copytree(exports[family], folder)
        config = json.loads((folder / "generation_config.json").read_text())
        (folder / "generation_config.json").write_text(json.dumps({**config, **settings}))
        model = load_seq2seq(folder)
        assert model.decoder.beams.beams == options.get("num_beams", 1)
        assert model.decoder.no_repeat_ngram == options.get("no_repeat_ngram_size", 0)
        eos = load_text_config(folder).eos_ids
        generator = Seq2SeqGenerator(model.runners, model.record, model.decoder,
                                     GenerateOptions(), max_target=model.max_target)
        try:
            for row, source in enumerate(_sources(reference)):
                want = reference["tokens"][row, 1:].tolist()
                want = want[:next((i for i, t in enumerate(want) if t in eos), len(want))]
                request = GenerationRequest(prompt=tuple(source), max_tokens=NEW,
                                            min_tokens=options.get("min_new_tokens", NEW),
                                            sampling=Sampling(), stop_ids=frozenset(eos))
                assert _tokens(generator, request) == want, (family, row)
        finally:
            generator.close()


@pytest.mark.parametrize("options", BEAMS, ids=lambda o: "-".join(map(str, o.values())))
def test_beam_search_equals_optimum_generate(exports, options, tmp_path):
    """A folder whose generation config names a beam search: a greedy request gets it, and
    its answer is Optimum's `generate`'s with the same settings, ending early where the
    end token wins (BART at length penalty 0: the empty answer)."""
    _as_optimum_generates(exports, options, tmp_path)


@pytest.mark.parametrize("options", [{"no_repeat_ngram_size": 2},
                                     {"no_repeat_ngram_size": 3, "num_beams": 3,
                                      "min_new_tokens": 0}], ids=["greedy", "beams"])
def test_no_repeat_ngram_equals_optimum_generate(exports, options, tmp_path):
    """generation_config.json's no_repeat_ngram_size (BART-CNN's 3): no n-gram of the
    decoder's ids twice, greedy or beam-searched, as Optimum's `generate` has it (these
    random models repeat tokens, so the rule acts at nearly every step)."""
    _as_optimum_generates(exports, options, tmp_path)


def test_beam_width_from_a_tensorrt_llm_client(exports, optimum_greedy):
    """TensorRT-LLM's `beam_width` over Triton's gRPC picks the search per request (BART's
    config names none): 4 beams, the in-process search's first; 1, greedy's; no sampling."""
    import tritonclient.grpc as tg
    from tritonclient.utils import InferenceServerException

    source, family = _sources(optimum_greedy["bart"])[0], "bart"
    model = load_seq2seq(exports[family])
    generator = Seq2SeqGenerator(model.runners, model.record, model.decoder, GenerateOptions(),
                                 max_target=model.max_target)
    try:
        beamed = _tokens(generator, dataclasses.replace(_request(source, 8, exports[family]),
                                                        beams=4))
        greedy = _tokens(generator, _request(source, 8, exports[family]))
        with pytest.raises(InvalidArgument, match="beam search"):
            sampled = GenerationRequest(tuple(source), beams=2, sampling=Sampling(temperature=.7))
            generator.submit(sampled, lambda c: None)
    finally:
        generator.close()
    assert beamed != greedy  # (the search finds another answer on this model)
    server = start(exports[family], model_name=family)
    try:
        client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")

        def ask(width: int) -> np.ndarray:
            inputs = []
            for name, arr, kind in (("input_ids", np.array([source], np.int64), "INT64"),
                                    ("max_tokens", np.array([8], np.int32), "INT32"),
                                    ("min_length", np.array([8], np.int32), "INT32"),
                                    ("end_id", np.array([2], np.int32), "INT32"),
                                    ("beam_width", np.array([width], np.int32), "INT32")):
                inputs.append(tg.InferInput(name, list(arr.shape), kind))
                inputs[-1].set_data_from_numpy(arr)
            return client.infer(family, inputs).as_numpy("output_ids")  # (beams, n)

        four = ask(4)  # every beam, best first, as TensorRT-LLM answers a beam width
        assert len(four) == 4 and (four[0][-8:].tolist(), ask(1)[0][-8:].tolist()) == (beamed,
                                                                                     greedy)
        with pytest.raises(InferenceServerException, match="beam_width 99 is not supported"):
            ask(99)
    finally:
        server.stop(0)
