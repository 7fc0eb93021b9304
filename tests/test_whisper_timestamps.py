"""Whisper's timestamps and prompts, served (`tuner serve FOLDER`, OpenAI's audio API with
the real `openai` client): the timestamp rule equals transformers' WhisperTimeStampLogitsProcessor
on random logits; generation with it, and with a prompt of earlier text, equals Optimum's
own `generate(return_timestamps=True, prompt_ids=...)` token for token; `verbose_json`,
`srt` and `vtt` are the segments of the loop's own tokens, with the no-speech probability of
the first-step decoder run apart in ONNX Runtime."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from models import optimum
from models.whisper import tone, wav, whisper_copy, with_timestamps
from serving.audio import FeatureConfig, WhisperPrompt, language_code, log_mel, read_audio
from serving.errors import InvalidArgument
from serving.generation.timestamps import Segment, TimestampRule, constrain, segments
from serving.sampling import GenerationRequest, Sampling
from tests.audio_support import ONE_TRY, loop
from tests.llm_support import openai_client, start

NO_TIMESTAMPS, PREVIOUS = 900, 898  # the tests' folder: timestamps 901..1002 (0.00-2.02 s)
RULE = TimestampRule(NO_TIMESTAMPS, 2, 50)


# ------------------------------------------------------------------------------- the rule


def _history(rng: np.random.Generator, begin: int, vocab: int) -> list[int]:
    """A made-up output so far: text and timestamps mixed, in pairs or not, rising or not."""
    out: list[int] = []
    for _ in range(int(rng.integers(0, 8))):
        out.append(int(rng.integers(begin, vocab)) if rng.random() < 0.5
                   else int(rng.integers(3, begin - 1)))
    return out


def test_rule_equals_transformers_processor():
    """500 random (history, logits) pairs, the timestamps' logits raised in half of them so
    that their summed probability wins: the same ids at -inf as transformers'
    WhisperTimeStampLogitsProcessor (begin index after a 3-token prefix)."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.logits_process import WhisperTimeStampLogitsProcessor

    vocab, rule = 120, TimestampRule(90, 50, 5)
    processor = WhisperTimeStampLogitsProcessor(
        GenerationConfig(no_timestamps_token_id=90, eos_token_id=50,
                         max_initial_timestamp_index=5), begin_index=3)
    rng = np.random.default_rng(0)
    forced = 0
    for case in range(500):
        generated = _history(rng, rule.begin, vocab)
        scores = rng.standard_normal(vocab).astype(np.float32) * 3
        if case % 2:
            scores[rule.begin:] += 4.0
        want = processor(torch.tensor([[7, 8, 9, *generated]]),
                         torch.tensor(scores[None]))[0].numpy()
        got = scores.copy()
        constrain(got, generated, rule)
        assert np.array_equal(np.isinf(got), np.isinf(want)), (generated, case)
        assert np.array_equal(got[~np.isinf(got)], want[~np.isinf(want)])
        forced += bool(np.isinf(got[:rule.begin]).all() and not np.isinf(got[rule.begin:]).all())
    assert forced > 50  # (the "timestamps outweigh the text" branch was reached)


def test_segments_of_an_output():
    """Pairs close and open segments; a lone last timestamp closes one; text after the last
    timestamp ends with the audio; times held to the piece, shifted by its offset."""
    t = lambda s: RULE.begin + round(s / RULE.precision)  # noqa: E731 - a timestamp's id
    ids = [t(0.0), 10, 11, t(0.5), t(0.5), 12, t(1.2), t(1.2), 13]
    assert segments(ids, RULE, offset=30.0, duration=1.5) == [
        Segment(30.0, 30.5, (t(0), 10, 11, t(0.5)), (10, 11)),
        Segment(30.5, 31.2, (t(0.5), 12, t(1.2)), (12,)),
        Segment(31.2, 31.5, (t(1.2), 13), (13,))]
    # a timestamp past the piece's end is held to it; timestamps without text make nothing
    assert segments([t(1.0), 14, t(2.0), t(2.0)], RULE, duration=1.5) == [
        Segment(1.0, 1.5, (t(1.0), 14, t(2.0)), (14,))]
    assert segments([], RULE) == [] and segments([t(0.2), t(0.4)], RULE) == []


def test_prefix_with_timestamps_and_a_prompt():
    w = WhisperPrompt(50258, {"en": 50259}, {"transcribe": 50359}, 50363, previous=50361)
    assert w.prefix("en", "transcribe") == (50258, 50259, 50359, 50363)
    assert w.prefix("en", "transcribe", timestamps=True) == (50258, 50259, 50359)
    assert w.prefix("en", "transcribe", before=(5, 6)) == (50361, 5, 6, 50258, 50259, 50359,
                                                           50363)
    assert w.no_speech == 50362
    old = WhisperPrompt(1, {}, {}, 14, (10, 12, 14))  # forced_decoder_ids ending in it
    assert old.prefix(None, "transcribe") == (1, 10, 12, 14)
    assert old.prefix(None, "transcribe", timestamps=True) == (1, 10, 12)
    with pytest.raises(InvalidArgument, match="takes no prompt"):
        WhisperPrompt(1, {}, {}).prefix(None, "transcribe", before=(5,))
    assert language_code("English") == "en" and language_code("de") == "de"


# ------------------------------------------------------------------- generation, served


@pytest.fixture(scope="module")
def stamped(tmp_path_factory) -> Path:
    """The tests' Whisper export with a tokenizer and Whisper's timestamp, prompt and
    initial-timestamp settings in its generation config."""
    export = optimum.export_all([("whisper", optimum.SEQ2SEQ_TASKS[1])])[0].parent
    return with_timestamps(whisper_copy(export, tmp_path_factory.mktemp("stamped") / "whisper"),
                           NO_TIMESTAMPS, PREVIOUS)


def _run(generator, features, prefix, n, at_least=None, **asked) -> list[int]:
    request = GenerationRequest(prompt=tuple(prefix), max_tokens=n,
                                min_tokens=n if at_least is None else at_least,
                                sampling=Sampling(), stop_ids=frozenset({2}),
                                encoder_input=features, **asked)
    return [t for chunk in generator.generate(request) for t in chunk.ids]


def test_timestamps_and_prompts_equal_optimum_generate(stamped):
    """Optimum's generate(return_timestamps=True) on two random feature windows, without and
    with prompt_ids: its first window's 30 tokens are the loop's."""
    prompt = [PREVIOUS, 10, 11, 12]
    plain = optimum.seq2seq_greedy([stamped], 30, {"return_timestamps": True})
    prompted = optimum.seq2seq_greedy([stamped], 30, {"return_timestamps": True,
                                                      "prompt_ids": prompt})[0]
    generator = loop(stamped)
    try:
        for reference, prefix in ((plain[0], [1]), (prompted, [*prompt, 1])):
            for row, features in enumerate(reference["input_input_features"]):
                want = reference[f"window_{row}"].tolist()
                assert want[:len(prefix)] == prefix
                got = _run(generator, features, prefix, 30, timestamps=True)
                assert got == want[len(prefix):]
                assert any(t > NO_TIMESTAMPS for t in got)
        with pytest.raises(InvalidArgument, match="beam search"):
            _run(generator, plain[0]["input_input_features"][0], [1], 4, timestamps=True,
                 beams=2)
    finally:
        generator.close()


def _no_speech(folder: Path, features: np.ndarray) -> float:
    """The probability of <|nospeech|> at the start token, from the folder's encoder and
    first-step decoder run here in ONNX Runtime (not through the server's loop)."""
    import onnxruntime as ort

    encoder = ort.InferenceSession(str(folder / "encoder_model.onnx"))
    states = encoder.run(None, {"input_features": features[None]})[0]
    decoder = ort.InferenceSession(str(folder / "decoder_model.onnx"))
    logits = decoder.run(["logits"], {"input_ids": np.array([[1]], np.int64),
                                      "encoder_hidden_states": states})[0]
    row = logits[0, 0].astype(np.float64)
    return float(np.exp(row[NO_TIMESTAMPS - 1] - row.max()) / np.exp(row - row.max()).sum())


def test_verbose_json_srt_and_vtt_through_the_openai_client(stamped):
    """A 1.5 s WAV: verbose_json's segments are those of the loop's own tokens (timestamps
    generated from the same features), with the window's scores; srt and vtt write the same
    segments; a prompt changes the start as transformers' prompt_ids do; word timestamps,
    a streamed srt and timestamps from a model without timestamp tokens are refused."""
    import openai
    from tokenizers import Tokenizer

    audio = tone(1.5)
    data = wav(audio)
    features = log_mel(read_audio(data, 60)[0], FeatureConfig())
    generator = loop(stamped)
    try:
        room = generator.max_target + 1  # (the server's max_tokens: room - the prefix)
        tokens = _run(generator, features, [1], room - 1, 0, timestamps=True)
        prompted = _run(generator, features, [PREVIOUS, 10, 11, 1, NO_TIMESTAMPS], room - 5, 0)
    finally:
        generator.close()
    tokenizer = Tokenizer.from_file(str(stamped / "tokenizer.json"))
    want = segments(tokens, RULE, 0.0, 1.5)
    assert want
    server = start(stamped, model_name="whisper")
    try:
        client = openai_client(server)
        got = client.audio.transcriptions.create(
            model="whisper", file=("a.wav", data), response_format="verbose_json",
            timestamp_granularities=["segment"], **ONE_TRY)
        assert got.duration == 1.5 and got.usage.seconds == 2
        assert [(s.start, s.end, s.tokens) for s in got.segments] == \
            [(round(s.start, 3), round(s.end, 3), list(s.ids)) for s in want]
        texts = [tokenizer.decode(list(s.text_ids)) for s in want]
        assert [s.text for s in got.segments] == texts
        assert got.text == " ".join(texts) and got.language == "english"
        first = got.segments[0]
        assert first.no_speech_prob == pytest.approx(_no_speech(stamped, features), rel=1e-4)
        assert math.isfinite(first.avg_logprob) and first.avg_logprob < 0
        assert first.compression_ratio > 0
        assert [s.id for s in got.segments] == list(range(len(want)))

        srt = client.audio.transcriptions.create(model="whisper", file=("a.wav", data),
                                                 response_format="srt", **ONE_TRY)
        vtt = client.audio.transcriptions.create(model="whisper", file=("a.wav", data),
                                                 response_format="vtt", **ONE_TRY)
        s0 = want[0]
        clock = lambda s, m: f"00:{int(s // 60):02d}:{s % 60:06.3f}".replace(".", m)  # noqa
        assert srt.startswith(f"1\n{clock(s0.start, ',')} --> {clock(s0.end, ',')}\n"
                              f"{texts[0].strip()}\n\n")
        assert srt.count(" --> ") == len(want)
        assert vtt.startswith(f"WEBVTT\n\n{clock(s0.start, '.')[3:]} --> "
                              f"{clock(s0.end, '.')[3:]}\n{texts[0].strip()}\n\n")

        with_prompt = client.audio.transcriptions.create(model="whisper", file=("a.wav", data),
                                                         prompt="w10 w11", **ONE_TRY)
        assert with_prompt.text == tokenizer.decode(prompted)
        for kwargs, why in ((dict(response_format="verbose_json",
                                  timestamp_granularities=["word"]), "word timestamps"),
                            (dict(response_format="srt", stream=True), "not streamed"),
                            (dict(timestamp_granularities=["segment"]), "verbose_json")):
            with pytest.raises(openai.BadRequestError, match=why):
                client.audio.transcriptions.create(model="whisper", file=("a.wav", data),
                                                   **kwargs)
    finally:
        server.stop(0)


def test_long_audio_segments_are_timed_in_the_whole_audio(stamped):
    """45 s with a pause at 29.3 s: two pieces generated together; each piece's segments are
    those of its own tokens, shifted by where it starts (its `seek` in frames), in order."""
    from serving.audio import pieces

    audio = tone(45.0)
    audio[int(29.30 * 16000):int(29.45 * 16000)] = 0
    cut = pieces(audio, FeatureConfig())
    generator = loop(stamped)
    try:
        room = generator.max_target
        tokens = [_run(generator, log_mel(p, FeatureConfig()), [1], room, 0, timestamps=True)
                  for p in cut]
    finally:
        generator.close()
    offset = len(cut[0]) / 16000
    want = (segments(tokens[0], RULE, 0.0, offset)
            + segments(tokens[1], RULE, offset, len(cut[1]) / 16000))
    assert any(s.start >= offset for s in want)
    server = start(stamped, model_name="whisper")
    try:
        got = openai_client(server).audio.transcriptions.create(
            model="whisper", file=("a.wav", wav(audio)), response_format="verbose_json",
            **ONE_TRY)
    finally:
        server.stop(0)
    assert [(s.start, s.end, s.tokens) for s in got.segments] == \
        [(round(s.start, 3), round(s.end, 3), list(s.ids)) for s in want]
    assert {s.seek for s in got.segments} == {0, round(offset * 100)}
    assert got.duration == 45.0
