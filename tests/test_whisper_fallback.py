"""Whisper's temperature fallback and silence rule (serving/http/fallback.py), as OpenAI's
whisper package decides them (transcribe.py's decode_with_fallback and no-speech skip) and
transformers scores them, served through the real `openai` client.

The tests' random Whisper is unsure of everything (a greedy window's average log-prob about
-6, its text one word repeated: compression ratio about 18), so its windows fall back to
1.0. Two copies of it reach the other branches: one sure of a short answer (its output
projection scaled up, the end token's column set to win after the first word), one that
hears silence as <|nospeech|> (that token's column set along the difference between the
start token's hidden state for silence and for a tone; the token suppressed, as it is never
generated)."""

from __future__ import annotations

import json
import math
import shutil
import zlib
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import pytest

from models import optimum
from models.whisper import RATE, tone, wav, whisper_copy, with_timestamps
from serving.audio import FeatureConfig, log_mel, pieces, read_audio
from serving.generation.timestamps import TimestampRule, segments
from serving.http.fallback import (TEMPERATURES, Scores, compression_ratio, is_silence,
                                   needs_fallback, scored, seed_of, temperatures)
from serving.sampling import Chunk, GenerationRequest, Sampling
from serving_support import scraped_metrics
from tests.audio_support import ONE_TRY, loop
from tests.llm_support import openai_client, start

RULE = TimestampRule(900, 2, 50)  # the tests' folder: timestamps 901..1002
NO_SPEECH = 899
DECODERS = ("decoder_model.onnx", "decoder_with_past_model.onnx")


# ------------------------------------------------------------------ the decision


def test_the_decision_on_crafted_scores():
    """decode_with_fallback's rule: too repetitive or too unsure is redone, unless it is
    silence (no-speech over 0.6 with a log-prob under -1); the skip keeps a window whose
    log-prob is over -1 whatever its no-speech probability; the thresholds are strict."""
    assert needs_fallback(Scores(-0.3, 2.5, 0.0))  # repetitive
    assert needs_fallback(Scores(-1.5, 1.2, 0.0))  # unsure
    assert needs_fallback(Scores(-1.5, 1.2, 0.6))  # (0.6 is not over 0.6)
    assert not needs_fallback(Scores(-0.3, 1.2, 0.0))
    assert not needs_fallback(Scores(-1.0, 2.4, 0.0))  # both at their thresholds pass
    for silent in (Scores(-1.5, 1.2, 0.7), Scores(-1.5, 18.0, 0.9)):  # repetitive too
        assert not needs_fallback(silent) and is_silence(silent)
    sure_speech = Scores(-0.3, 2.5, 0.9)  # no-speech high but the log-prob is not low
    assert needs_fallback(sure_speech) and not is_silence(sure_speech)
    assert not is_silence(Scores(-0.3, 1.2, 0.9)) and not is_silence(Scores(-1.5, 1.2, 0.5))
    at_threshold = Scores(-1.0, 1.2, 0.7)  # passes, and is skipped (not over -1)
    assert not needs_fallback(at_threshold) and is_silence(at_threshold)
    # whisper's measure: UTF-8 bytes over zlib's; a repeated word is far over 2.4
    text = "w217 " * 63
    assert compression_ratio(text) == len(text.encode()) / len(zlib.compress(text.encode()))
    assert compression_ratio(text) > 15 and compression_ratio("") == 0.0
    assert compression_ratio("w558 w80 w328 w871 w549 w158 w75 w579") < 2.4


def test_the_tries_and_their_seeds():
    """0 climbs to 1.0 by whisper's 0.2 (or a given step); a temperature over 0, or no step,
    is one try; a seed follows the window's features and the temperature."""
    assert temperatures(0.0) == TEMPERATURES == (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    assert temperatures(0.3) == (0.3,) and temperatures(0.0, None) == (0.0,)
    assert temperatures(0.0, 0.5) == (0.0, 0.5, 1.0)
    features = log_mel(tone(1.0), FeatureConfig())
    assert seed_of(features, 0.2) == seed_of(features.copy(), 0.2)
    assert len({seed_of(features, 0.2), seed_of(features, 0.4),
                seed_of(log_mel(tone(1.0, seed=1), FeatureConfig()), 0.2)}) == 3


def test_average_log_prob_as_whisper_and_transformers_count_it():
    """The end token's log-prob counts, over the text tokens + 1 (whisper's DecodingTask);
    the same number as transformers' _retrieve_avg_logprobs on the same scores; a try the
    length cut off (no end token) is still over its tokens + 1; the end token leaves the
    ids, and the no-speech probability is the probe's."""
    import torch
    from transformers.models.whisper.generation_whisper import WhisperGenerationMixin

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 10)).astype(np.float32) * 3
    ids = (5, 7, 2)
    logprobs = torch.log_softmax(torch.tensor(logits), -1)[torch.arange(3), list(ids)]
    chunk = Chunk(ids, None, True, "stop", logprobs=tuple(logprobs.tolist()),
                  probe=(math.log(0.25),))
    window = scored(chunk, frozenset({2}), lambda t: " ".join(f"w{i}" for i in t), 0.4, 3)
    theirs = WhisperGenerationMixin._retrieve_avg_logprobs(
        list(torch.tensor(logits)), torch.tensor(ids), 0.0)
    assert window.scores.avg_logprob == pytest.approx(float(logprobs.sum()) / 3, abs=1e-6)
    assert window.scores.avg_logprob == pytest.approx(float(theirs), abs=1e-5)
    assert window.chunk.ids == (5, 7) and len(window.chunk.logprobs) == 2
    assert window.scores.no_speech_prob == pytest.approx(0.25)
    assert (window.temperature, window.tries) == (0.4, 3)
    cut = scored(Chunk((5, 7, 9), None, True, "length", logprobs=(-1.0, -1.0, -1.0)),
                 frozenset({2}), str, 0.0, 1)
    assert cut.scores.avg_logprob == -0.75 and cut.chunk.ids == (5, 7, 9)


# ------------------------------------------------------------------ the copies


def _head(folder: Path, change: Callable[[np.ndarray], np.ndarray]) -> None:
    """Both decoders' output projection (80, vocab) changed alike (their cache path stays
    exact)."""
    for name in DECODERS:
        proto = onnx.load(str(folder / name))
        weight = next(n.input[1] for n in proto.graph.node if n.name.endswith("proj_out/MatMul"))
        init = next(i for i in proto.graph.initializer if i.name == weight)
        value = change(onnx.numpy_helper.to_array(init).copy()).astype(np.float32)
        init.CopyFrom(onnx.numpy_helper.from_array(value, weight))
        onnx.save(proto, str(folder / name))


def _hidden(folder: Path, features: np.ndarray, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The decoder's last hidden state at each position of `ids` (read back from the logits
    through the output projection, which has full rank) and the logits."""
    import onnxruntime as ort

    encoder = ort.InferenceSession(str(folder / "encoder_model.onnx"))
    states = encoder.run(None, {"input_features": features[None]})[0]
    decoder = ort.InferenceSession(str(folder / "decoder_model.onnx"))
    logits = decoder.run(["logits"], {"input_ids": np.array([ids], np.int64),
                                      "encoder_hidden_states": states})[0][0].astype(np.float64)
    proto = onnx.load(str(folder / "decoder_model.onnx"))
    weight = next(n.input[1] for n in proto.graph.node if n.name.endswith("proj_out/MatMul"))
    head = onnx.numpy_helper.to_array(
        next(i for i in proto.graph.initializer if i.name == weight)).astype(np.float64)
    hidden = np.linalg.lstsq(head.T, logits.T, rcond=None)[0].T
    return hidden, logits


def _features(audio: np.ndarray) -> np.ndarray:
    return log_mel(read_audio(wav(audio), 60)[0], FeatureConfig())


@pytest.fixture(scope="module")
def stamped(tmp_path_factory) -> Path:
    export = optimum.export_all([("whisper", optimum.SEQ2SEQ_TASKS[1])])[0].parent
    return with_timestamps(whisper_copy(export, tmp_path_factory.mktemp("fallback") / "w"))


@pytest.fixture(scope="module")
def sure(stamped, tmp_path_factory) -> Path:
    """The copy sure of "w217" for a tone: its projection x40 (a greedy window's average
    log-prob -0.2), the end token's column the least one under the first text token's logit
    - 10 where it follows the first timestamp, and over every logit + 10 after it."""
    folder = tmp_path_factory.mktemp("sure") / "w"
    shutil.copytree(stamped, folder)
    _head(folder, lambda w: w * 40)
    first = _run(folder, _features(tone(1.5)), (1,), 0.0)[:2]  # [timestamp, text]
    hidden, logits = _hidden(folder, _features(tone(1.5)), [1, *first])
    end = np.linalg.lstsq(hidden[1:3], [logits[1].max() - 10, logits[2].max() + 10],
                          rcond=None)[0]
    _head(folder, lambda w: np.concatenate([w[:, :2], end[:, None], w[:, 3:]], axis=1))
    return folder


@pytest.fixture(scope="module")
def quiet(stamped, tmp_path_factory) -> Path:
    """The copy that hears silence: <|nospeech|>'s column along h(silence) - h(tone) at the
    start token, its logit 40 higher for silence than for the tone; suppressed."""
    folder = tmp_path_factory.mktemp("quiet") / "w"
    shutil.copytree(stamped, folder)
    silence = _hidden(folder, _features(np.zeros(2 * RATE, np.float32)), [1])[0][0]
    heard = _hidden(folder, _features(tone(1.5)), [1])[0][0]
    d = silence - heard

    def column(w: np.ndarray) -> np.ndarray:
        w[:, NO_SPEECH] = d / (d @ d) * 40
        return w
    _head(folder, column)
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "suppress_tokens": [NO_SPEECH]}))
    return folder


def _run(folder: Path, features: np.ndarray, prefix: tuple[int, ...], temperature: float
         ) -> list[int]:
    """The loop's tokens for one window as the server asks them (its length limit, the end
    token left out), sampled with the server's seed for that window and temperature."""
    generator = loop(folder)
    try:
        seed = seed_of(features, temperature) if temperature else None
        request = GenerationRequest(
            prompt=prefix, max_tokens=generator.max_target - len(prefix) + 1,
            sampling=Sampling(temperature=temperature, seed=seed), stop_ids=frozenset({2}),
            encoder_input=features, timestamps=prefix == (1,))
        return [t for chunk in generator.generate(request) for t in chunk.ids]
    finally:
        generator.close()


def _streams(server) -> float:
    """Streams the engine has ended: one per try (and per language detection)."""
    return sum(v for (name, _), v in scraped_metrics(server).items()
               if name == "tuner_finished_streams_total")


def _asked(server, client, data: bytes, **options) -> tuple[object, float]:
    """The answer and how many tries it took."""
    before = _streams(server)
    got = client.audio.transcriptions.create(model="whisper", file=("a.wav", data), **options)
    return got, _streams(server) - before


# ------------------------------------------------------------------ served


def test_a_repetitive_window_falls_back_to_sampling(stamped):
    """A 1.5 s tone: greedy repeats one word (compression ratio about 18, log-prob about
    -6), so the window is tried at all six temperatures and the last kept: its segments say
    1.0 and are the loop's tokens sampled at 1.0 with the window's seed, another text than
    greedy's, the same on a second request, in every format and streamed; temperature 0.3
    is one try, as is temperature 0 without a step (a step that is not one is refused)."""
    import openai

    data = wav(tone(1.5))
    features = _features(tone(1.5))
    sampled = _run(stamped, features, (1,), 1.0)
    at_03 = _run(stamped, features, (1,), 0.3)
    server = start(stamped, model_name="whisper")
    try:
        client = openai_client(server)
        greedy, tries = _asked(server, client, data, response_format="verbose_json", **ONE_TRY)
        assert tries == 1 and {s.temperature for s in greedy.segments} == {0.0}
        first = greedy.segments[0]
        assert first.compression_ratio > 2.4 and first.avg_logprob < -1.0
        got, tries = _asked(server, client, data, response_format="verbose_json")
        assert tries == 6 and {s.temperature for s in got.segments} == {1.0}
        assert [t for s in got.segments for t in s.tokens] == \
            [t for s in segments(sampled, RULE, 0.0, 1.5) for t in s.ids]
        assert got.text != greedy.text
        assert _asked(server, client, data, response_format="verbose_json")[0].text == got.text
        srt, tries = _asked(server, client, data, response_format="srt")
        assert tries == 6 and srt.count(" --> ") == len(got.segments)
        text, tries = _asked(server, client, data)  # json: its own start (<|notimestamps|>)
        assert tries == 6 and text.text != _asked(server, client, data, **ONE_TRY)[0].text
        events = list(client.audio.transcriptions.create(model="whisper", stream=True,
                                                         file=("a.wav", data)))
        assert events[-1].text == text.text and len(events) == 2  # one delta per window
        warm, tries = _asked(server, client, data, response_format="verbose_json",
                             temperature=0.3)
        assert tries == 1 and {s.temperature for s in warm.segments} == {0.3}
        assert [t for s in warm.segments for t in s.tokens] == \
            [t for s in segments(at_03, RULE, 0.0, 1.5) for t in s.ids]
        for bad in ("0", "1.5", "often"):
            with pytest.raises(openai.BadRequestError, match="increment_on_fallback"):
                client.audio.transcriptions.create(
                    model="whisper", file=("a.wav", data),
                    extra_body={"temperature_increment_on_fallback": bad})
    finally:
        server.stop(0)


def test_a_window_that_passes_stays_greedy(sure):
    """The sure copy's greedy answer for a tone, "w217" (log-prob about -0.5, compression
    ratio 0.33), passes: one try, temperature 0.0, greedy's tokens."""
    data = wav(tone(1.5))
    want = _run(sure, _features(tone(1.5)), (1,), 0.0)
    server = start(sure, model_name="whisper")
    try:
        client = openai_client(server)
        got, tries = _asked(server, client, data, response_format="verbose_json")
        assert tries == 1 and [s.temperature for s in got.segments] == [0.0]
        (segment,) = got.segments
        assert segment.avg_logprob > -1.0 and segment.compression_ratio < 2.4
        assert segment.tokens == want and got.text == "w217"
        assert _asked(server, client, data)[0].text == "w217"
    finally:
        server.stop(0)


def test_silence_is_left_out_without_a_redo(quiet):
    """45 s, a tone up to 29.3 s and silence after: the first window is heard (no-speech
    about 0) and falls back; the silent one (no-speech about 1, log-prob about -6) is
    silence: tried once, its text left out of every format. Alone, silence answers
    nothing."""
    from tokenizers import Tokenizer

    audio = tone(45.0)
    audio[int(29.3 * RATE):] = 0
    data = wav(audio)
    server = start(quiet, model_name="whisper")
    try:
        client = openai_client(server)
        got, tries = _asked(server, client, data, response_format="verbose_json")
        assert tries == 6 + 1
        assert got.segments and {s.seek for s in got.segments} == {0}
        assert {s.temperature for s in got.segments} == {1.0}
        assert max(s.no_speech_prob for s in got.segments) < 0.01
        text, tries = _asked(server, client, data)
        assert tries == 7 and text.text
        heard = pieces(read_audio(data, 60)[0], FeatureConfig())[0]  # (cut in the pause)
        sampled = _run(quiet, log_mel(heard, FeatureConfig()), (1, 900), 1.0)
        assert text.text == Tokenizer.from_file(str(quiet / "tokenizer.json")).decode(sampled)
        nothing, tries = _asked(server, client, wav(np.zeros(2 * RATE, np.float32)),
                                response_format="verbose_json")
        assert tries == 1 and nothing.segments == [] and nothing.text == ""
        greedy, _ = _asked(server, client, wav(np.zeros(2 * RATE, np.float32)),
                           response_format="verbose_json", **ONE_TRY)
        assert greedy.segments == []  # (one try: silence still left out)
    finally:
        server.stop(0)
