"""A chat (OpenAI `messages`) as the model's prompt text: the model's chat template
(serving/text_config.py), rendered with jinja2 the way transformers'
`apply_chat_template` renders it (a sandboxed, immutable environment with trim_blocks and
lstrip_blocks, the loop-control extension, `raise_exception`, `strftime_now` and a `tojson`
that keeps non-ASCII text), so the prompt is the one the model was trained on."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from serving.errors import InvalidArgument
from serving.text_config import TextConfig

ROLES = ("system", "developer", "user", "assistant", "tool")


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def messages_of(raw) -> list[dict]:
    """OpenAI messages, checked, each content as one string (text parts joined)."""
    if not isinstance(raw, list) or not raw:
        raise InvalidArgument("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise InvalidArgument(f"messages[{i}] must be an object with a 'role' in "
                                  f"{list(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text"
                   or not isinstance(p.get("text"), str) for p in content):
                raise InvalidArgument(f"messages[{i}]: only text content parts are supported")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise InvalidArgument(f"messages[{i}].content must be a string or text parts")
        out.append({**m, "content": content})
    return out


def render(text: TextConfig, messages: list[dict], add_generation_prompt: bool = True,
           tools: list | None = None) -> str:
    """The prompt text; `tools` (OpenAI's tool list) reaches the template as `tools`, as
    transformers' apply_chat_template passes it (None when there are none)."""
    if text.chat_template is None:
        raise InvalidArgument("this model has no chat template (no chat_template.jinja, and "
                              "no 'chat_template' in the artifact's tokenizer_config.json): "
                              "use /v1/completions")
    try:
        return _compiled(text.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools or None,
            bos_token=text.bos_token, eos_token=text.eos_token)
    except jinja2.exceptions.TemplateError as e:
        raise InvalidArgument(f"the chat template refused these messages: {e}") from None
