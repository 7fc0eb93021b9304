"""OpenAI's audio API for a Whisper export folder (`tuner serve FOLDER`):
`POST /v1/audio/transcriptions` and `POST /v1/audio/translations`, multipart form data as
the `openai` client sends it: `file` (WAV, FLAC, OGG, MP3 or AIFF, any rate, any channels;
up to 60 minutes: audio longer than the encoder's 30 s is cut into pieces at quiet moments,
generated together and joined), `model`, `language` (a code or a name; without one a
multilingual model detects it first, as transformers' generate does), `prompt` (earlier
text, after <|startofprev|>: its last tokens up to half the decoder's length, as OpenAI's
whisper keeps them), `temperature` (0, the default: greedy, each window redone at higher
temperatures while it fails whisper's thresholds, serving/http/fallback.py; over 0: one
sampled try; `temperature_increment_on_fallback`, whisper's option: the step, or "none" for
one try), `response_format` (`json`, `text`;
`verbose_json`, `srt`, `vtt` generate Whisper's timestamp tokens: segments with their times;
`timestamp_granularities[]` `segment`), `stream` (json / text: Server-Sent Events,
`transcript.text.delta` events, one per window once it is decided, then
`transcript.text.done`). A window whisper calls silence is left out. The log-mel features are
computed here (serving/audio.py) and generated from by the encoder-decoder loop. Errors are
OpenAI's."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from serving.audio import (LANGUAGES, MOST_PIECES, language_code, log_mel, pieces, read_audio,
                           resample)
from serving.errors import InvalidArgument
from serving.http.fallback import INCREMENT, Fallback, Window, temperatures
from serving.http.openai_api import error
from serving.http.streams import ChunkStream, until_disconnect
from serving.http.transcripts import Piece, Timed, joined, srt, timed, verbose, vtt
from serving.http.triton_generate import SSE_HEADERS, sse
from serving.sampling import GenerationRequest, Sampling, join_chunks
from serving.seq2seq import Seq2SeqEngine

PLAIN = ("json", "text")
TIMESTAMPED = ("verbose_json", "srt", "vtt")
FORMATS = PLAIN + TIMESTAMPED


def takes_audio(engine) -> bool:
    """A Whisper folder's engine: its encoder reads log-mel features."""
    return isinstance(engine, Seq2SeqEngine) and engine.audio is not None


def audio_engine(frontend, name: str) -> Seq2SeqEngine:
    engine = frontend.slot.find(name)
    if not takes_audio(engine):
        raise InvalidArgument(f"model '{name}' does not take audio: the audio API serves a "
                              "Whisper export folder (its encoder reads log-mel features, "
                              "preprocessor_config.json makes them)")
    if engine.tokenizer is None:
        raise InvalidArgument(f"model '{name}' has no tokenizer.json: its tokens cannot be "
                              "made text")
    return engine


def _field(form, name: str, default: str = "") -> str:
    value = form.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidArgument(f"'{name}' must be a form field, not a file")
    return default if value is None else value


def _temperature(form) -> float:
    raw = _field(form, "temperature", "0")
    try:
        value = float(raw)
    except ValueError:
        raise InvalidArgument(f"'temperature' must be a number, not {raw!r}") from None
    if not 0 <= value <= 2:
        raise InvalidArgument(f"'temperature' must be between 0 and 2, not {value}")
    return value


def _increment(form) -> float | None:
    """whisper's --temperature_increment_on_fallback: the step from 0 up to 1 (0.2), or
    "none": one try."""
    raw = _field(form, "temperature_increment_on_fallback", str(INCREMENT))
    if raw.strip().lower() in ("none", "null"):
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise InvalidArgument("'temperature_increment_on_fallback' must be a number in "
                              f"(0, 1] or none, not {raw!r}")
    return value


async def _detected(frontend, engine: Seq2SeqEngine, features) -> str:
    """A multilingual model's language for this audio: the first step's most likely
    language token (transformers' detect_language)."""
    languages = engine.whisper.languages
    request = GenerationRequest(prompt=(engine.whisper.start,), max_tokens=1,
                                sampling=Sampling(allowed_ids=tuple(languages.values())),
                                encoder_input=features)
    whole = join_chunks(await ChunkStream(engine, request).collect())
    by_id = {v: k for k, v in languages.items()}
    if not whole.ids or whole.ids[0] not in by_id:
        raise RuntimeError(f"language detection ended without a language: {whole.reason}")
    return by_id[whole.ids[0]]


@dataclass(frozen=True)
class Asked:
    engine: Seq2SeqEngine
    generations: tuple[GenerationRequest, ...]  # one per piece of the audio, in order
    format: str
    seconds: float  # the audio's length
    spans: tuple[tuple[float, float], ...]  # each piece's (offset, duration), seconds
    language: str  # a code; "" where the model has no language tokens (English-only)
    stream: bool
    task: str
    temperatures: tuple[float, ...]  # a window's tries (serving/http/fallback.py)


def _format(form, engine: Seq2SeqEngine) -> str:
    fmt = _field(form, "response_format", "json")
    if fmt not in FORMATS:
        raise InvalidArgument(f"response_format must be one of {', '.join(FORMATS)}")
    granularities = form.getlist("timestamp_granularities[]") + form.getlist(
        "timestamp_granularities")
    if any(g not in ("segment", "word") for g in granularities):
        raise InvalidArgument("timestamp_granularities must be 'segment' (or 'word')")
    if "word" in granularities:
        raise InvalidArgument("word timestamps are not generated here (they need the "
                              "decoder's cross-attention): ask for 'segment'")
    if granularities and fmt != "verbose_json":
        raise InvalidArgument("timestamp_granularities needs response_format 'verbose_json'")
    if fmt in TIMESTAMPED and engine.model.decoder.timestamps is None:
        raise InvalidArgument(f"response_format {fmt!r} needs timestamps, and this model's "
                              "generation config names no no_timestamps_token_id: use json "
                              "or text")
    return fmt


def _previous(form, engine: Seq2SeqEngine) -> tuple[int, ...]:
    """The prompt's ids (" " + the text, as transformers' get_prompt_ids), its last ones up
    to half the decoder's length (OpenAI's whisper keeps n_ctx // 2 - 1)."""
    text = _field(form, "prompt").strip()
    if not text:
        return ()
    ids = engine.tokenizer.encode(" " + text, add_special_tokens=False).ids
    return tuple(ids[-(engine.generator.max_target // 2 - 1):])


def _language(form, engine: Seq2SeqEngine) -> str | None:
    """The audio's language as the request names it (a code or a name, either task), as
    Whisper's code; None where it names none or the model is English-only (no language
    token: whisper transcribes such a model's audio as English whatever is asked). A name
    Whisper does not know is refused for every model, as OpenAI's API refuses it."""
    named = _field(form, "language")
    language = language_code(named) or None
    if language is not None and language not in LANGUAGES | engine.whisper.languages:
        raise InvalidArgument(f"language {named!r} is not one Whisper knows: give an ISO-639-1 "
                              "code ('en') or a name ('english')")
    return language if engine.whisper.languages else None


async def _asked(frontend, request: Request, task: str) -> Asked:
    form = await frontend.form(request, max_files=1, max_fields=32)  # (within the limit)
    upload = form.get("file")
    if upload is None or isinstance(upload, str):
        raise InvalidArgument("'file' (the audio: WAV, FLAC, OGG, MP3) is required")
    engine = audio_engine(frontend, _field(form, "model") or frontend.slot.name)
    return await asked_for(frontend, engine, form, await upload.read(), task)


async def asked_for(frontend, engine: Seq2SeqEngine, form, data: bytes, task: str) -> Asked:
    """The generations that transcribe (or translate) the audio file `data`, as the fields
    of `form` (a FormData: the OpenAI API's names) ask for them."""
    fmt = _format(form, engine)
    stream = _field(form, "stream", "false").lower() in ("true", "1")
    if stream and fmt in TIMESTAMPED:
        raise InvalidArgument(f"a streamed answer is text: response_format {fmt!r} is not "
                              "streamed (use json)")
    before = _previous(form, engine)
    language = _language(form, engine)
    config = engine.audio
    samples, rate = read_audio(data, MOST_PIECES * config.chunk_length)
    samples = resample(samples, rate, config.sampling_rate)
    cut = pieces(samples, config)
    features = [log_mel(piece, config) for piece in cut]
    if language is None and engine.whisper.languages:
        language = await _detected(frontend, engine, features[0])
    stamped = fmt in TIMESTAMPED
    prefix = engine.whisper.prefix(language, task, stamped, before)
    tries = temperatures(_temperature(form), _increment(form))
    no_speech = engine.whisper.no_speech
    probe = (None if no_speech is None
             else (prefix.index(engine.whisper.start), (no_speech,)))
    # every window is scored (log-probs, no-speech probability); its end token is a stop
    # sequence, sent with its log-prob, which whisper's average counts
    generations = tuple(GenerationRequest(
        prompt=prefix, max_tokens=engine.generator.max_target - len(prefix) + 1,
        stop_sequences=tuple((t,) for t in engine.text.eos_ids), encoder_input=f,
        id=_field(form, "request_id"), timestamps=stamped, logprobs=True,
        prompt_probe=probe) for f in features)
    starts = [sum(len(p) for p in cut[:i]) for i in range(len(cut))]
    spans = tuple((at / config.sampling_rate, len(p) / config.sampling_rate)
                  for at, p in zip(starts, cut))
    return Asked(engine, generations, fmt, len(samples) / config.sampling_rate, spans,
                 language or "", stream, task, tries)


def _text_of(asked: Asked) -> Callable[[Sequence[int]], str]:
    """A window's text from its ids: a timestamped one's timestamps left out (as whisper's
    decode)."""
    rule, decode = asked.engine.model.decoder.timestamps, asked.engine.tokenizer.decode
    begin = rule.begin if rule is not None and asked.format in TIMESTAMPED else math.inf
    return lambda ids: decode([t for t in ids if t < begin])


def fallback_of(asked: Asked) -> Fallback:
    return Fallback(asked.engine, asked.generations, asked.temperatures,
                    frozenset(asked.engine.text.eos_ids), _text_of(asked))


async def _in_order(asked: Asked, windows: AsyncIterator[Window]) -> AsyncIterator[str]:
    """The windows' text in order, each once it is decided, silence left out."""
    text, decode = "", _text_of(asked)
    async for window in windows:
        if not window.silent:
            piece = joined(text, decode(window.chunk.ids))
            text += piece
            yield piece


def _usage(seconds: float) -> dict:
    return {"type": "duration", "seconds": math.ceil(seconds)}


def _streamed(asked: Asked, texts: AsyncIterator[str], close: Callable[[], None]
              ) -> Response:
    async def events():
        text = ""
        try:
            async for piece in texts:
                text += piece
                yield sse({"type": "transcript.text.delta", "delta": piece})
        except RuntimeError as e:
            yield sse({"error": {"message": str(e)}})
            return
        finally:
            close()
        yield sse({"type": "transcript.text.done", "text": text.strip(),
                   "usage": _usage(asked.seconds)})

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


async def timed_parts(asked: Asked, fallback: Fallback) -> list[Timed]:
    """Every segment of the windows' kept outputs, in order, with its times."""
    windows = await fallback.all()
    engine = asked.engine
    rate = engine.audio.sampling_rate / engine.audio.hop_length  # frames per second
    kept = [Piece(w.chunk, at, length, round(at * rate), w.scores, w.temperature)
            for w, (at, length) in zip(windows, asked.spans) if not w.silent]
    rule, decode = engine.model.decoder.timestamps, engine.tokenizer.decode
    return timed(kept, rule, decode)


async def plain_text(asked: Asked, fallback: Fallback) -> str:
    """The windows' texts joined (silence left out)."""
    return "".join([piece async for piece in _in_order(asked, fallback.in_order())]).strip()


async def _timestamped(asked: Asked, fallback: Fallback) -> Response | str:
    """The segments' answer (verbose_json, srt, vtt) from each window's kept output."""
    parts = await timed_parts(asked, fallback)
    if asked.format == "srt":
        return srt(parts)
    if asked.format == "vtt":
        return vtt(parts)
    return JSONResponse({**verbose(parts, task=asked.task,
                                   language=LANGUAGES.get(asked.language or "en",
                                                          asked.language),
                                   seconds=asked.seconds),
                         "usage": _usage(asked.seconds)})


async def _answer(frontend, request: Request, task: str) -> Response:
    asked = await _asked(frontend, request, task)
    fallback = fallback_of(asked)  # (the first tries submitted: an error is the request's)
    if asked.stream:
        return _streamed(asked, _in_order(asked, fallback.in_order()), fallback.close)
    work = (_timestamped if asked.format in TIMESTAMPED else plain_text)(asked, fallback)
    answer = await until_disconnect(request.receive, work, fallback.close)
    if answer is None:
        return Response(status_code=499)  # the client went away; nothing to answer
    if isinstance(answer, Response):
        return answer
    if asked.format != "json":  # text, srt, vtt
        return PlainTextResponse(answer if asked.format in TIMESTAMPED else answer + "\n")
    body = {"text": answer, "usage": _usage(asked.seconds)}
    return JSONResponse({**body, "language": asked.language} if asked.language else body)


async def transcriptions(frontend, request: Request) -> Response:
    return await _answer(frontend, request, "transcribe")


async def translations(frontend, request: Request) -> Response:
    return await _answer(frontend, request, "translate")


ROUTES = [
    ("/v1/audio/transcriptions", ["POST"], "audio_transcriptions", transcriptions, error),
    ("/v1/audio/translations", ["POST"], "audio_translations", translations, error),
]
