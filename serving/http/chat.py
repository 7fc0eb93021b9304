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


# what the renderer passes itself: chat_template_kwargs may not replace them
_RESERVED = ("messages", "tools", "documents", "add_generation_prompt", "bos_token",
             "eos_token")


def render(text: TextConfig, messages: list[dict], add_generation_prompt: bool = True,
           tools: list | None = None, *, documents: list | None = None,
           extra: dict | None = None, continue_final: bool = False) -> str:
    """The prompt text; `tools` (OpenAI's tool list) and `documents` reach the template as
    transformers' apply_chat_template passes them (None when there are none), `extra` as
    more variables (vLLM's chat_template_kwargs, e.g. Qwen 3's enable_thinking).
    `continue_final`: the text ends with the last message's content, which the model goes
    on writing (transformers' continue_final_message)."""
    if text.chat_template is None:
        raise InvalidArgument("this model has no chat template (no chat_template.jinja, and "
                              "no 'chat_template' in the artifact's tokenizer_config.json): "
                              "use /v1/completions")
    try:
        rendered = _compiled(text.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools or None,
            documents=documents or None, bos_token=text.bos_token, eos_token=text.eos_token,
            **(extra or {}))
    except jinja2.exceptions.TemplateError as e:
        raise InvalidArgument(f"the chat template refused these messages: {e}") from None
    return _continued(rendered, messages[-1]["content"]) if continue_final else rendered


def _continued(rendered: str, final: str) -> str:
    """The rendered chat cut right after the final message's content, as transformers cuts
    it (the template may have trimmed the message's trailing spaces)."""
    if final.strip() not in rendered:
        raise InvalidArgument("continue_final_message: the final message does not appear in "
                              "the chat the template renders")
    at = rendered.rindex(final.strip())
    if rendered[at:at + len(final.lstrip())] == final:
        return rendered[:at + len(final.lstrip())]
    return rendered[:at + len(final.strip())]


def chat_prompt(text: TextConfig, body: dict) -> str:
    """A chat body's prompt text: its `messages`, `tools` and vLLM's chat options
    (`add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`,
    `documents`)."""
    messages = messages_of(body.get("messages"))
    add = body.get("add_generation_prompt", True)
    final = body.get("continue_final_message", False)
    if not isinstance(add, bool) or not isinstance(final, bool):
        raise InvalidArgument("'add_generation_prompt' and 'continue_final_message' must be "
                              "true or false")
    if add and final:
        raise InvalidArgument("'continue_final_message' continues the last message: send "
                              "'add_generation_prompt': false with it")
    if final and messages[-1]["role"] != "assistant":
        raise InvalidArgument("'continue_final_message' needs an assistant message last")
    extra = body.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict) or any(k in _RESERVED for k in extra):
        raise InvalidArgument(f"'chat_template_kwargs' must be an object whose keys are none "
                              f"of {list(_RESERVED)}")
    documents = body.get("documents")
    if documents is not None and not (isinstance(documents, list) and all(
            isinstance(d, dict) for d in documents)):
        raise InvalidArgument("'documents' must be a list of objects")
    return render(text, messages, add, body.get("tools"), documents=documents, extra=extra,
                  continue_final=final)
