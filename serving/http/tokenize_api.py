"""vLLM's tokenizer endpoints on the HTTP port, for clients that count tokens with the
server's own tokenizer instead of a copy of it (lm-evaluation-harness's `remote` tokenizer
backend, prompt-budget tools): `POST /tokenize` (a prompt, or chat messages rendered with the
chat template and chat completions' options, to ids: {"count", "max_model_len", "tokens", "token_strs"}), `POST
/detokenize` (ids to text: {"prompt"}) and `GET /tokenizer_info` (the special tokens, the chat
template, the longest sequence). `model` is optional in a body; when given it must name the
served model. Errors are OpenAI error objects, as vLLM answers them."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving.decoder import DecoderEngine
from serving.errors import InvalidArgument
from serving.http.chat import chat_prompt
from serving.http.openai_api import error
from serving.tokenizer import token_text


def _engine(frontend, name) -> DecoderEngine:
    if name is not None and not isinstance(name, str):
        raise InvalidArgument("'model' must be the name of a served model")
    engine = frontend.slot.find(frontend.slot.name if name is None else name)
    if not isinstance(engine, DecoderEngine):
        raise InvalidArgument(f"model '{frontend.slot.name}' is not a decoder: the tokenizer "
                              "endpoints serve decoder artifacts")
    if engine.tokenizer is None:
        raise InvalidArgument(f"model '{frontend.slot.name}' has no tokenizer (tokenizer.json "
                              "in its artifact)")
    return engine


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise InvalidArgument(f"'{name}' must be true or false")
    return value


async def tokenize(frontend, request: Request) -> Response:
    body = await frontend.json(request)
    engine = _engine(frontend, body.get("model"))
    if "messages" in body:  # a chat: its template adds the special tokens
        text = chat_prompt(engine.text, body)
        special = _flag(body, "add_special_tokens", False)
    elif isinstance(body.get("prompt"), str):
        text, special = body["prompt"], _flag(body, "add_special_tokens", True)
    else:
        raise InvalidArgument("'prompt' must be a string (or send 'messages')")
    ids = engine.tokenizer.encode(text, add_special_tokens=special).ids
    strs = [token_text(engine.tokenizer, t) for t in ids] \
        if _flag(body, "return_token_strs", False) else None
    return JSONResponse({"count": len(ids), "max_model_len": engine.generator.max_cache_len,
                         "tokens": ids, "token_strs": strs})


async def detokenize(frontend, request: Request) -> Response:
    body = await frontend.json(request)
    engine = _engine(frontend, body.get("model"))
    tokens = body.get("tokens")
    vocab = engine.tokenizer.get_vocab_size(with_added_tokens=True)
    if not isinstance(tokens, list) or any(
            not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in tokens):
        raise InvalidArgument(f"'tokens' must be a list of token ids in [0, {vocab})")
    return JSONResponse({"prompt": engine.tokenizer.decode(tokens, skip_special_tokens=False)})


async def tokenizer_info(frontend, request: Request) -> Response:
    engine = _engine(frontend, None)
    text, eos = engine.text, engine.text.eos_token
    if not eos and text.eos_ids:
        eos = token_text(engine.tokenizer, text.eos_ids[0])
    return JSONResponse({"tokenizer_class": "PreTrainedTokenizerFast",
                         "model_max_length": engine.generator.max_cache_len,
                         "bos_token": text.bos_token or None, "eos_token": eos or None,
                         "pad_token": None, "chat_template": text.chat_template})


ROUTES = [("/tokenize", ["POST"], "tokenize", tokenize, error),
          ("/detokenize", ["POST"], "detokenize", detokenize, error),
          ("/tokenizer_info", ["GET"], "tokenizer_info", tokenizer_info, error)]
