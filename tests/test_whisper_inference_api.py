"""huggingface_hub's InferenceClient.automatic_speech_recognition on a Whisper folder
(serving/http/asr_api.py): it posts the audio file itself to `POST /` (or, with parameters,
JSON with the file base64-encoded) and reads transformers' pipeline's answer, `text` and,
with return_timestamps, `chunks`. Each answer is the one OpenAI's audio API gives on the same
server at one try (whose tokens tests/test_whisper_timestamps.py checks against the
generation loop's): the text, the segments' texts and times; SageMaker's /invocations takes
the same bodies; what is not served is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from models import optimum
from models.whisper import tone, wav, whisper_copy, with_timestamps
from tests.audio_support import ONE_TRY
from tests.llm_support import openai_client, start


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The tests' Whisper export, with a tokenizer and timestamp tokens."""
    export = optimum.export_all([("whisper", optimum.SEQ2SEQ_TASKS[1])])[0].parent
    folder = with_timestamps(whisper_copy(export, tmp_path_factory.mktemp("asr") / "whisper"))
    s = start(folder, model_name="whisper")
    yield s
    s.stop(0)


@pytest.fixture(scope="module")
def audio(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("audio") / "a.wav"
    path.write_bytes(wav(tone(1.5)))
    return path


def _client(server, monkeypatch):
    from huggingface_hub import InferenceClient, constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the suite's offline mode
    return InferenceClient(model=f"http://127.0.0.1:{server.http_port}", timeout=60)


def _openai(server, audio: Path, **asked):
    return openai_client(server).audio.transcriptions.create(
        model="whisper", file=("a.wav", audio.read_bytes()), **asked, **ONE_TRY)


def test_the_text_of_a_file_its_bytes_and_a_sagemaker_body(server, audio, monkeypatch):
    want = _openai(server, audio).text
    assert want
    client = _client(server, monkeypatch)
    assert client.automatic_speech_recognition(audio).text.strip() == want  # audio/x-wav
    assert client.automatic_speech_recognition(audio.read_bytes()).text.strip() == want
    r = requests.post(f"http://127.0.0.1:{server.http_port}/invocations", timeout=60,
                      data=audio.read_bytes(), headers={"content-type": "audio/wav"})
    assert r.status_code == 200 and r.json()["text"].strip() == want


def test_timestamps_are_the_segments(server, audio, monkeypatch):
    want = _openai(server, audio, response_format="verbose_json")
    assert want.segments
    got = _client(server, monkeypatch).automatic_speech_recognition(
        audio, extra_body={"return_timestamps": True})  # JSON, the file base64-encoded
    assert got.text.strip() == want.text
    assert [(c.text, c.timestamp) for c in got.chunks] == \
        [(s.text, [s.start, s.end]) for s in want.segments]


@pytest.mark.parametrize("body, says", [
    ({"return_timestamps": "word"}, "word timestamps are not generated"),
    ({"generate_kwargs": {"num_beams": 2}}, "['num_beams'] are not served"),
    ({"generate_kwargs": {"task": "sing"}}, "'task' must be"),
])
def test_what_is_not_served_is_refused(server, audio, monkeypatch, body, says):
    from huggingface_hub.errors import HfHubHTTPError

    with pytest.raises(HfHubHTTPError) as e:
        _client(server, monkeypatch).automatic_speech_recognition(audio, extra_body=body)
    assert e.value.response.status_code == 422 and says in e.value.response.json()["error"]
    r = requests.post(f"http://127.0.0.1:{server.http_port}/", data=b"not audio", timeout=60)
    assert r.status_code == 422 and "not in a format" in r.json()["error"]
