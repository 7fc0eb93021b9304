"""What the Whisper tests share beyond models/whisper.py (made-up audio and the Whisper export
that hears it): one greedy try per window, and the generation loop on a folder."""

from __future__ import annotations

from pathlib import Path

from serving.generation import GenerateOptions
from serving.generation.seq2seq import Seq2SeqGenerator
from serving.seq2seq import load_seq2seq

# One greedy try per window (whisper's --temperature_increment_on_fallback None), for tests
# that compare the served text with the loop's greedy tokens: the tests' random Whisper fails
# whisper's thresholds on every window, so a request at the default temperature 0 is redone
# up to 1.0 (serving/http/fallback.py; tests/test_whisper_fallback.py)
ONE_TRY = {"extra_body": {"temperature_increment_on_fallback": "none"}}


def loop(folder: Path) -> Seq2SeqGenerator:
    model = load_seq2seq(folder)
    return Seq2SeqGenerator(model.runners, model.record, model.decoder, GenerateOptions(),
                            max_target=model.max_target)
