"""Whisper served from its Optimum export folder (`tuner serve FOLDER`): OpenAI's audio API
(`/v1/audio/transcriptions`, `/v1/audio/translations`) with the real `openai` client.

The features are Whisper's (serving/audio.py against transformers' WhisperFeatureExtractor);
WAV files of every common sample format are read; greedy tokens on given features are
Optimum's own `generate` (ORTModelForSpeechSeq2Seq); a transcription through the client is
the tokens the loop generates from transformers' features of the same file; a multilingual
model's language is detected first (the first step's most likely language token), and its
language and task tokens start the decoder."""

from __future__ import annotations

import io
import json
import shutil
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest

from models import optimum
from models.whisper import RATE, tone, wav, whisper_copy
from serving.audio import FeatureConfig, WhisperPrompt, log_mel, pieces, read_audio, resample
from serving.errors import InvalidArgument
from serving.sampling import GenerationRequest, Sampling
from tests.audio_support import ONE_TRY, loop
from tests.llm_support import openai_client, start


def _float_wav(x: np.ndarray, rate: int = RATE, extensible: bool = False) -> bytes:
    """IEEE float WAV (format 3, or WAVE_FORMAT_EXTENSIBLE with the float sub-format), which
    the stdlib cannot write."""
    data = x.astype("<f4").tobytes()
    if extensible:
        fmt = struct.pack("<HHIIHHHHI16s", 0xFFFE, 1, rate, rate * 4, 4, 32, 22, 32, 0,
                          struct.pack("<H", 3) + b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa"
                          b"\x00\x38\x9b\x71")
    else:
        fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + \
        struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _24_bit(x: np.ndarray) -> bytes:
    ints = (x * 8388607).astype("<i4").view(np.uint8).reshape(-1, 4)[:, :3].tobytes()
    fmt = struct.pack("<HHIIHH", 1, 1, RATE, RATE * 3, 3, 24)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + \
        struct.pack("<I", len(ints)) + ints
    return b"RIFF" + struct.pack("<I", len(body)) + body


def test_features_are_whispers():
    """Noise, a tone, silence and a full 30 s window: transformers' extractor's features."""
    from transformers import WhisperFeatureExtractor

    theirs = WhisperFeatureExtractor(feature_size=80)
    for x in (tone(3), tone(30, seed=1), np.zeros(200, np.float32),
              np.random.default_rng(2).standard_normal(RATE).astype(np.float32) * 0.2):
        want = theirs(x, sampling_rate=RATE, return_tensors="np")["input_features"][0]
        got = log_mel(x, FeatureConfig())
        assert got.shape == want.shape == (80, 3000) and got.dtype == np.float32
        assert np.abs(got - want).max() < 1e-4
    with pytest.raises(InvalidArgument, match="at most 30 s"):
        log_mel(tone(30.5), FeatureConfig())


def _encoded(x: np.ndarray, fmt: str, channels: int = 1, rate: int = RATE) -> bytes:
    """`x` at `rate` written by libsndfile (soundfile) as a FLAC, OGG or MP3 file."""
    import soundfile

    out = io.BytesIO()
    soundfile.write(out, np.stack([x] * channels, axis=1), rate, format=fmt)
    return out.getvalue()


def _peak_hz(x: np.ndarray, rate: int = RATE) -> float:
    return float(np.argmax(np.abs(np.fft.rfft(x))) * rate / len(x))


def test_audio_files_of_every_common_format():
    """WAV of every sample format exactly; FLAC nearly so; OGG and MP3 (lossy, an MP3 shifted
    by its encoder's delay) keep the tone's length and frequency. A file no reader takes, a
    rate no audio has, audio over the limit and a damaged file are refused."""
    x = tone(0.5)
    for data, tolerance in ((wav(x), 1e-4), (wav(x, width=4), 1e-6),
                            (wav(x, width=1), 2e-2), (wav(x, channels=2), 1e-4),
                            (_float_wav(x), 0), (_float_wav(x, extensible=True), 0),
                            (_24_bit(x), 1e-6), (_encoded(x, "FLAC", 2), 1e-4)):
        got, rate = read_audio(data, 60)
        assert rate == RATE and got.shape == x.shape
        assert np.abs(got - x).max() <= tolerance + 1e-7
    for fmt in ("OGG", "MP3"):
        got, rate = read_audio(_encoded(x, fmt, 2), 60)
        assert rate == RATE and abs(len(got) - len(x)) <= 0.05 * len(x)
        assert abs(_peak_hz(got) - 300) < 4 and 0.1 < np.abs(got).max() < 0.5
    flac = _encoded(x, "FLAC")
    for bad, limit, why in ((b"ID3\x04mp3 bytes", 60, "not in a format this reads"),
                            (b"\x00\x00\x00\x20ftypM4A " + bytes(64), 60, "ffmpeg -i"),
                            (wav(x, rate=8), 60, "not audio this reads"),
                            (wav(tone(2.0)), 1, "at most 1 s"),
                            (wav(tone(2.0, rate=96000), rate=96000), 1.5, "at up to 48000 Hz"),
                            (flac[:len(flac) // 2], 60, "damaged")):
        with pytest.raises(InvalidArgument, match=why):
            read_audio(bad, limit)
    # 8 kHz up to 16 kHz: the tone stays at 300 Hz, the length doubles
    low = tone(1.0, rate=8000)
    up = resample(low, 8000, RATE)
    assert len(up) == RATE
    assert abs(np.argmax(np.abs(np.fft.rfft(up))) * RATE / len(up) - 300) < 2


def test_whisper_prompt_tokens():
    multilingual = WhisperPrompt(50258, {"en": 50259, "de": 50261},
                                 {"transcribe": 50359, "translate": 50358}, 50363)
    assert multilingual.prefix("de", "translate") == (50258, 50261, 50358, 50363)
    with pytest.raises(InvalidArgument, match="'xx' is not one of"):
        multilingual.prefix("xx", "transcribe")
    english = WhisperPrompt(50257, {}, {"transcribe": 50358, "translate": 50357}, 50362)
    assert english.prefix(None, "transcribe") == (50257, 50358, 50362)
    assert WhisperPrompt(1, {}, {}, None, (7, 8)).prefix(None, "transcribe") == (1, 7, 8)


@pytest.fixture(scope="module")
def export() -> Path:
    return optimum.export_all([("whisper", optimum.SEQ2SEQ_TASKS[1])])[0].parent


@pytest.fixture(scope="module")
def whisper(export, tmp_path_factory) -> Path:
    return whisper_copy(export, tmp_path_factory.mktemp("whisper") / "whisper")


def _greedy(generator, features: np.ndarray, n: int, at_least: int | None = None
            ) -> list[int]:
    """Up to `n` tokens, the end token (2) held back until `at_least` (default: n)."""
    request = GenerationRequest(prompt=(generator.decoder.start,), max_tokens=n,
                                min_tokens=n if at_least is None else at_least,
                                sampling=Sampling(), stop_ids=frozenset({2}),
                                encoder_input=features)
    return [t for chunk in generator.generate(request) for t in chunk.ids]


def test_greedy_equals_optimum_generate(export):
    """Optimum's ORTModelForSpeechSeq2Seq greedy `generate` on two random feature sets (its
    begin_suppress_tokens at the first step): the same 12 tokens here."""
    reference = optimum.seq2seq_greedy([export])[0]
    generator = loop(export)
    try:
        features = reference["input_input_features"]
        assert [_greedy(generator, f, 12) for f in features] == \
            reference["tokens"][:, 1:].tolist()
        with pytest.raises(InvalidArgument, match="audio features of shape"):
            generator.submit(GenerationRequest(prompt=(1,)), lambda c: None)
    finally:
        generator.close()


def test_transcriptions_through_the_openai_client(whisper):
    """A 2 s WAV at 44.1 kHz, stereo: the text is what the loop generates from the features
    transformers computes of the same audio resampled; `text` and streamed formats agree;
    translations answer; an MP3 of it is transcribed from its decoded samples; timestamped
    formats (this model has no timestamp tokens), a file no reader takes, a language Whisper
    does not know and a missing file are refused; a language it knows is transcribed as
    English (this model is English-only), as whisper does."""
    import openai
    from tokenizers import Tokenizer

    audio = tone(2.0, rate=44100)
    data = wav(audio, rate=44100, channels=2)
    generator = loop(whisper)
    try:
        from transformers import WhisperFeatureExtractor

        mono, rate = read_audio(data, 60)
        features = WhisperFeatureExtractor(feature_size=80)(
            resample(mono, rate, RATE), sampling_rate=RATE,
            return_tensors="np")["input_features"][0]
        tokens = _greedy(generator, features, generator.max_target, at_least=0)
        mp3 = _encoded(audio, "MP3", 2, rate=44100)
        decoded, mp3_rate = read_audio(mp3, 60)
        assert mp3_rate == 44100
        mp3_tokens = _greedy(generator, log_mel(resample(decoded, mp3_rate, RATE),
                                                FeatureConfig()), generator.max_target, 0)
    finally:
        generator.close()
    tokenizer = Tokenizer.from_file(str(whisper / "tokenizer.json"))
    server = start(whisper, model_name="whisper")
    try:
        client = openai_client(server)
        got = client.audio.transcriptions.create(model="whisper", file=("a.wav", data),
                                                 **ONE_TRY)
        assert got.text and got.text.split() == tokenizer.decode(tokens).split()
        assert got.usage.seconds == 2
        text = client.audio.transcriptions.create(model="whisper", file=("a.wav", data),
                                                  response_format="text", **ONE_TRY)
        assert text.strip() == got.text
        events = list(client.audio.transcriptions.create(model="whisper", stream=True,
                                                         file=("a.wav", data), **ONE_TRY))
        assert events[-1].type == "transcript.text.done" and events[-1].text == got.text
        assert "".join(e.delta for e in events[:-1]).strip() == got.text
        with warnings.catch_warnings():  # (some openai versions mark translations so)
            warnings.simplefilter("ignore", DeprecationWarning)
            translated = client.audio.translations.create(model="whisper", file=("a.wav", data),
                                                          **ONE_TRY)
        assert translated.text == got.text  # (this model has no task tokens: the same start)
        got = client.audio.transcriptions.create(model="whisper", file=("a.mp3", mp3),
                                                 **ONE_TRY)
        assert got.text.split() == tokenizer.decode(mp3_tokens).split()
        silence = client.audio.transcriptions.create(model="whisper",
                                                     file=("s.wav", wav(audio * 0)), **ONE_TRY)
        assert silence.text != got.text  # (the audio reaches the model)
        english = client.audio.transcriptions.create(model="whisper", file=("a.wav", data),
                                                     language="French", **ONE_TRY)
        assert english.text == text.strip()  # (an English-only model: as whisper, English)
        for kwargs, why in ((dict(file=("a.wav", data), response_format="srt"), "timestamps"),
                            (dict(file=("a.m4a", b"ID3 not audio")), "not in a format"),
                            (dict(file=("a.wav", data), language="Klingon"), "not one Whisper")):
            with pytest.raises(openai.BadRequestError, match=why):
                client.audio.transcriptions.create(model="whisper", **kwargs)
    finally:
        server.stop(0)


def test_a_multilingual_model_detects_its_language(whisper, tmp_path):
    """generation_config.json as a multilingual Whisper's (language and task tokens, no
    timestamps): without a language the first step's most likely language token is taken,
    and the decoder starts [start, language, task, notimestamps]."""
    from tokenizers import Tokenizer

    folder = tmp_path / "multilingual"
    shutil.copytree(whisper, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    config.update(is_multilingual=True, lang_to_id={"<|en|>": 10, "<|de|>": 11},
                  task_to_id={"transcribe": 12, "translate": 13}, no_timestamps_token_id=14)
    (folder / "generation_config.json").write_text(json.dumps(config))
    data = wav(tone(1.0))
    mono, _ = read_audio(data, 60)
    features = log_mel(mono, FeatureConfig())
    generator = loop(folder)
    try:
        detect = GenerationRequest(prompt=(1,), max_tokens=1,
                                   sampling=Sampling(allowed_ids=(10, 11)),
                                   encoder_input=features)
        (language,) = [t for c in generator.generate(detect) for t in c.ids]
        code = {10: "en", 11: "de"}[language]
        request = GenerationRequest(prompt=(1, language, 12, 14), max_tokens=8,
                                    sampling=Sampling(), stop_ids=frozenset({2}),
                                    encoder_input=features)
        want = [t for c in generator.generate(request) for t in c.ids]
    finally:
        generator.close()
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    server = start(folder, model_name="whisper")
    try:
        got = openai_client(server).audio.transcriptions.create(model="whisper",
                                                                file=("a.wav", data), **ONE_TRY)
        assert got.model_extra["language"] == code
        words = tokenizer.decode(want).split()
        assert words and got.text.split()[:len(words)] == words
    finally:
        server.stop(0)


def test_long_audio_in_pieces(whisper):
    """45 s with a pause at 29.3 s: cut there (the quietest 100 ms of the window's last
    second), both pieces generated together, their texts joined in order, whole or
    streamed; past the limit on pieces, refused."""
    from tokenizers import Tokenizer

    audio = tone(45.0)
    audio[int(29.30 * RATE):int(29.45 * RATE)] = 0
    cut = pieces(audio, FeatureConfig())
    assert [len(p) for p in cut][0] / RATE == pytest.approx(29.4, abs=0.06)
    with pytest.raises(InvalidArgument, match="at most 30 s are taken"):
        pieces(audio, FeatureConfig(), most=1)
    data = wav(audio)
    mono, _ = read_audio(data, 60)
    tokenizer = Tokenizer.from_file(str(whisper / "tokenizer.json"))
    generator = loop(whisper)
    try:
        texts = [tokenizer.decode(_greedy(generator, log_mel(p, FeatureConfig()),
                                          generator.max_target, at_least=0))
                 for p in pieces(mono, FeatureConfig())]
    finally:
        generator.close()
    server = start(whisper, model_name="whisper")
    try:
        client = openai_client(server)
        got = client.audio.transcriptions.create(model="whisper", file=("a.wav", data),
                                                 **ONE_TRY)
        assert got.text == " ".join(texts) and got.usage.seconds == 45
        events = list(client.audio.transcriptions.create(model="whisper", stream=True,
                                                         file=("a.wav", data), **ONE_TRY))
        assert events[-1].text == got.text
        assert "".join(e.delta for e in events[:-1]).strip() == got.text
    finally:
        server.stop(0)


def test_export_layouts(whisper, tmp_path):
    """The layout of transformers.js repositories (graphs under onnx/, configs and tokenizer
    at the top) is served as the flat folder is, the same text for the same file; a folder
    with Optimum's merged decoder but not the two plain ones exits 2 before listening,
    saying which files the loop runs and how to get them."""
    import subprocess
    import sys

    nested = tmp_path / "nested"
    (nested / "onnx").mkdir(parents=True)
    for f in whisper.iterdir():
        shutil.copy(f, nested / "onnx" / f.name if f.suffix == ".onnx" else nested / f.name)
    data = wav(tone(1.0))
    texts = []
    for folder in (whisper, nested):
        server = start(folder, model_name="whisper")
        try:
            texts.append(openai_client(server).audio.transcriptions.create(
                model="whisper", file=("a.wav", data)).text)
        finally:
            server.stop(0)
    assert texts[0] and texts[1] == texts[0]
    merged = tmp_path / "merged"  # (only the file names matter here)
    shutil.copytree(whisper, merged)
    (merged / "decoder_model.onnx").rename(merged / "decoder_model_merged.onnx")
    (merged / "decoder_with_past_model.onnx").unlink()
    done = subprocess.run([sys.executable, "-m", "tuner", "serve", str(merged), "--port", "0",
                           "--http-port", "-1", "--metrics-port", "-1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "decoder_model_merged.onnx only" in done.stderr
    assert "tuner unmerge" in done.stderr and "listening" not in done.stderr
