"""bench/soak.py's clients for a served Whisper folder: OpenAI's audio API through the `openai`
client (every response format, streamed transcriptions dropped midway, translations, audio
past 30 s cut into pieces), Triton's whisper_bls tensors through tritonclient.grpc, requests
whose connection closes before the answer, and malformed uploads that must be answered 4xx.
Greedy requests (temperature 0, one try per window) must transcribe each file as the idle
server did; the others run whisper's fallback (windows redone at higher temperatures), whose
text is sampled and so only has to come back.
"""

from __future__ import annotations

import http.client
import random
import uuid
import warnings

import numpy as np

from serve_common import MODEL_NAME

# one greedy try per window: a random Whisper fails whisper's thresholds on every window
ONE_TRY = {"extra_body": {"temperature_increment_on_fallback": "none"}}
SECONDS = (1.0, 2.5, 4.0, 7.0, 12.0, 35.0)  # the last one past Whisper's 30-s window


class AudioClients:
    """One action per client kind, as bench/soak.py's generation clients."""

    checked_what = "greedy transcriptions"

    def __init__(self, grpc_port: int, http_port: int) -> None:
        import openai

        from models.whisper import PREFIX, tone, wav

        self.grpc_port, self.http_port, self.prefix = grpc_port, http_port, PREFIX
        self.openai = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1",
                                    api_key="unused", max_retries=0, timeout=300)
        self.audio = [tone(s, seed=k) for k, s in enumerate(SECONDS)]
        self.files = [wav(a) for a in self.audio]
        self.refs: dict[tuple[str, int], str] = {}
        self.checked = 0
        self.mismatches: list[str] = []

    def _greedy(self, how: str, k: int) -> str:
        if how == "bls":
            return self._bls(k)
        create = (self.openai.audio.transcriptions.create if how == "transcribe"
                  else self.openai.audio.translations.create)
        with warnings.catch_warnings():  # (some openai versions mark translations deprecated)
            warnings.simplefilter("ignore", DeprecationWarning)
            return create(model=MODEL_NAME, file=(f"{k}.wav", self.files[k]), temperature=0,
                          **ONE_TRY).text

    def record_references(self) -> None:
        self.refs = {(how, k): self._greedy(how, k) for how in ("transcribe", "translate", "bls")
                     for k in self._pool(how)}

    def unchanged(self) -> bool:
        return all(self._greedy("transcribe", k) == self.refs["transcribe", k] for k in (0, 5))

    def _pool(self, how: str) -> range:
        """The files `how` takes: Triton's Whisper names take one 30-s window, as
        tensorrtllm_backend's whisper_bls does (longer audio is refused)."""
        return range(len(SECONDS) - 1 if how == "bls" else len(SECONDS))

    def _checked(self, how: str, r: random.Random) -> str:
        k = r.choice(self._pool(how))
        got = self._greedy(how, k)
        self.checked += 1
        if got != self.refs[how, k]:
            self.mismatches.append(f"{how} {SECONDS[k]} s: {got!r} against "
                                   f"{self.refs[how, k]!r}")
        return f"{how}, greedy, checked"

    def greedy_transcription(self, r: random.Random) -> str:
        return self._checked("transcribe", r) + " (openai)"

    def greedy_translation(self, r: random.Random) -> str:
        return self._checked("translate", r) + " (openai)"

    def whisper_bls(self, r: random.Random) -> str:
        return self._checked("bls", r) + " (tritonclient.grpc, Triton's Whisper names)"

    def _bls(self, k: int) -> str:
        """The tensors as tensorrtllm_backend's Whisper client builds them: the samples
        zero-padded to a 10-s multiple, their count in WAV_LENS, the prompt as text."""
        import tritonclient.grpc as tg

        audio = self.audio[k]
        samples = np.zeros((1, 160000 * (len(audio) // 160000 + 1)), np.float32)
        samples[0, :len(audio)] = audio
        inputs = [tg.InferInput("WAV", list(samples.shape), "FP32"),
                  tg.InferInput("WAV_LENS", [1, 1], "INT32"),
                  tg.InferInput("TEXT_PREFIX", [1, 1], "BYTES")]
        inputs[0].set_data_from_numpy(samples)
        inputs[1].set_data_from_numpy(np.array([[len(audio)]], np.int32))
        inputs[2].set_data_from_numpy(np.array([[self.prefix]], object))
        client = tg.InferenceServerClient(f"127.0.0.1:{self.grpc_port}")
        try:
            value = client.infer(MODEL_NAME, inputs).as_numpy("TRANSCRIPTS").reshape(-1)
        finally:
            client.close()
        return b" ".join(value).decode()

    def formats(self, r: random.Random) -> str:
        fmt = r.choice(("json", "text", "verbose_json", "srt", "vtt"))
        got = self.openai.audio.transcriptions.create(
            model=MODEL_NAME, file=("a.wav", r.choice(self.files)), response_format=fmt)
        if not (got if isinstance(got, str) else got.text) and fmt in ("json", "text"):
            raise RuntimeError(f"an empty {fmt} transcription")
        return f"transcription as {fmt}, fallback on (openai)"

    def streamed(self, r: random.Random) -> str:
        stream = self.openai.audio.transcriptions.create(
            model=MODEL_NAME, file=("a.wav", r.choice(self.files)), stream=True)
        drop = r.randint(0, 6) if r.random() < 0.5 else None
        for k, event in enumerate(stream):
            if k == drop:
                stream.close()
                return "transcription streamed, dropped (openai)"
        if event.type != "transcript.text.done":
            raise RuntimeError(f"a stream ended with {event.type}")
        return "transcription streamed (openai)"

    def _upload(self, fields: dict[str, str], file: bytes | None, read: bool = True) -> int:
        """A multipart POST to the transcriptions API as raw HTTP; its status (0 unread)."""
        boundary = uuid.uuid4().hex
        parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'
                 .encode() for k, v in fields.items()]
        if file is not None:
            parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
                         f'filename="a.wav"\r\nContent-Type: audio/wav\r\n\r\n'.encode() + file +
                         b"\r\n")
        body = b"".join(parts) + f"--{boundary}--\r\n".encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=300)
        try:
            conn.request("POST", "/v1/audio/transcriptions", body,
                         {"Content-Type": f"multipart/form-data; boundary={boundary}"})
            return conn.getresponse().status if read else 0
        finally:
            conn.close()

    def dropped(self, r: random.Random) -> str:
        self._upload({"model": MODEL_NAME}, self.files[-1], read=False)
        return "transcription dropped before its answer (http)"

    def malformed(self, r: random.Random) -> str:
        fields, file = r.choice((
            ({"model": MODEL_NAME}, b"RIFF not really a wav file"),
            ({"model": MODEL_NAME}, None),
            ({"model": MODEL_NAME, "response_format": "xml"}, self.files[0]),
            ({"model": MODEL_NAME, "temperature": "hot"}, self.files[0]),
            ({"model": MODEL_NAME, "language": "not a language"}, self.files[0])))
        status = self._upload(fields, file)
        if not 400 <= status < 500:
            raise RuntimeError(f"a malformed upload ({sorted(fields)}, file "
                               f"{None if file is None else len(file)}) answered HTTP {status}")
        return "malformed, answered 4xx (http)"

    def actions(self):
        return (self.greedy_transcription, self.greedy_transcription, self.greedy_translation,
                self.whisper_bls, self.formats, self.streamed, self.dropped, self.malformed)
