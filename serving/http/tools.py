"""Tool calling on chat completions. The tools reach the chat template as `tools` (as
transformers' apply_chat_template passes them), and the output comes back as the message's
`tool_calls` (finish reason "tool_calls") in one of two ways:

- the client forces the call, `tool_choice` "required" (one or more calls of the given
  tools; one with `parallel_tool_calls` false) or a named function: the output is held to
  a JSON schema of the call(s) by structured output (vLLM's way for these two choices), so
  any model works, whatever its own call syntax;
- `tool_choice` "auto" (the default with tools: the model decides) with `tuner serve
  --tool-call-parser NAME`: the model writes calls in its own syntax, parsed out of the
  text as vLLM's parser of that name does: `hermes` (Qwen 2.5 / 3, Hermes and many
  fine-tunes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), `mistral`
  (`[TOOL_CALLS]...`) or `llama3_json` (Llama 3.1 - 3.3: the output is the call's JSON).
  Text before the first call is the content. Streamed, the content flows until a call may
  start, the calls come whole at the end. Without a parser "auto" is refused with 400
  naming the choices that work.

A reader sees a choice's text grow (`held`) and says what may be sent now: content text,
and at the end the calls (None: the text stays content, e.g. a call the model wrote that
does not parse; a forced call cut by max_tokens comes back as a call on OpenAI's chat
completions, its arguments as far as they came, finish reason "length", as OpenAI and vLLM
answer it)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from serving.errors import InvalidArgument
from serving.sampling import Grammar, held_back

def _call(name: str, arguments) -> dict:
    """A call in OpenAI's shape; arguments as text: as given, or an object written as vLLM
    writes parsed ones (JSON, other scripts as they are, not escaped)."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                   ensure_ascii=False)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": text}}


@dataclass(frozen=True)
class Forced:
    """Calls the client forced: a `named` one, or any of the tools ("required")."""

    tools: tuple[dict, ...]  # each {"name", "parameters"} of the body's function tools
    named: str | None
    parallel: bool = True  # "required": several calls allowed (parallel_tool_calls)
    # a call cut by max_tokens comes back as a call, its arguments as far as they came (what
    # OpenAI's API and vLLM's answer: an agent then sees a failed call, not a text answer);
    # False keeps the text, for the APIs whose calls carry parsed arguments (Anthropic's)
    cut_calls: bool = False

    @property
    def grammar(self) -> Grammar:
        """The output's grammar: the named function's parameters, or the list of calls."""
        if self.named is not None:
            return Grammar.of("json", next(t["parameters"] for t in self.tools
                                           if t["name"] == self.named))
        # vLLM's "required": a list of {"name", "parameters"}, each name one of the tools
        calls = [{"type": "object", "properties": {
            "name": {"type": "string", "enum": [t["name"]]}, "parameters": t["parameters"]},
            "required": ["name", "parameters"], "additionalProperties": False}
            for t in self.tools]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return Grammar.of("json", array if self.parallel else {**array, "maxItems": 1})

    def read(self, held: str, sent: int, final: bool) -> tuple[str, list[dict] | None]:
        """Nothing before the end (the text is JSON for the calls); then the calls."""
        if not final:
            return "", None
        try:
            value = json.loads(held)
        except ValueError:  # cut by max_tokens
            calls = self._cut(held) if self.cut_calls else None
            return ("", calls) if calls else (held, None)
        # a named call's arguments are the model's text, as OpenAI and vLLM return them
        pairs = [(self.named, held)] if self.named is not None else [
            (c["name"], c["parameters"]) for c in value]
        return "", [_call(name, arguments) for name, arguments in pairs]

    def _cut(self, held: str) -> list[dict]:
        """The calls of a text cut short: the whole ones, then the last as far as it came
        (once its name is whole: the grammar writes `{"name":...,"parameters":...}`)."""
        if self.named is not None:
            return [_call(self.named, held)]
        calls, at, decoder = [], 1, json.JSONDecoder()  # (1: after the list's "[")
        while at < len(held):
            try:
                call, at = decoder.raw_decode(held, at)
            except ValueError:
                started = re.match(r'\{"name":"([^"]*)","parameters":', held[at:])
                if started:
                    calls.append(_call(started.group(1), held[at + started.end():]))
                break
            calls.append(_call(call["name"], call["parameters"]))
            at += 1  # the comma
        return calls


class _Marked:
    """Calls that start at a marker in the text, content before it (vLLM's `hermes` and
    `mistral` parsers). Streamed, content flows up to where a call starts or may start."""

    OPEN = ""
    grammar = None  # the model writes freely

    def read(self, held: str, sent: int, final: bool) -> tuple[str, list[dict] | None]:
        start = held.find(self.OPEN)
        if not final:  # content up to where a call starts or may start
            end = start if start >= 0 else len(held) - held_back(held, (self.OPEN,))
            return held[sent:max(sent, end)], None
        calls = self.calls(held[start:]) if start >= 0 else None
        if calls is None:
            return held[sent:], None
        return held[sent:max(sent, start)], calls

    def calls(self, text: str) -> list[dict] | None:
        """The calls of `text` (which starts at the marker); None if they do not parse:
        then it all stays content, as vLLM answers."""
        raise NotImplementedError


class Hermes(_Marked):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen 2.5 / 3,
    Hermes and many fine-tunes; a last block may be left unclosed at the end)."""

    OPEN = "<tool_call>"

    def calls(self, text: str) -> list[dict] | None:
        out = []
        for block in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text, re.DOTALL):
            try:
                call = _named(json.loads(block))
            except ValueError:
                return None
            out.append(call)
        return out or None


class Mistral(_Marked):
    """Mistral's `[TOOL_CALLS]` token, then the calls in either of its tokenizers' syntaxes:
    a JSON list `[{"name": ..., "arguments": {...}}, ...]` (before v11), or `name{...}`,
    `name[ARGS]{...}` in later ones, one call after each `[TOOL_CALLS]`."""

    OPEN = "[TOOL_CALLS]"

    def calls(self, text: str) -> list[dict] | None:
        out = []
        try:
            for part in text.split(self.OPEN)[1:]:
                part = part.strip()
                if part.startswith("["):
                    listed = _whole_json(part)
                    if not isinstance(listed, list):
                        return None
                    out += [_named(c) for c in listed]
                    continue
                name, _, arguments = part.partition("{")
                name = name.removesuffix("[ARGS]").strip()
                if not name or not arguments:
                    return None
                out.append(_call(name, _whole_json("{" + arguments)))
        except ValueError:
            return None
        return out or None


class Llama3Json:
    """Llama 3.1 - 3.3's JSON calls (vLLM's `llama3_json`): the whole output is
    `{"name": ..., "parameters": {...}}` (or "arguments"), several joined by "; ", perhaps
    after the `<|python_tag|>` token. Output that starts otherwise is content, streamed as
    it comes; output that starts like a call is held until the end (vLLM also finds a call
    inside prose when the answer is whole; here whole and streamed answers always agree)."""

    TAG = "<|python_tag|>"
    grammar = None

    def _maybe_call(self, held: str) -> bool:
        text = held.lstrip()
        return self.TAG.startswith(text) or text.startswith((self.TAG, "{"))

    def read(self, held: str, sent: int, final: bool) -> tuple[str, list[dict] | None]:
        if not self._maybe_call(held):
            return held[sent:], None
        if not final:
            return "", None
        calls = self.calls(held.lstrip().removeprefix(self.TAG))
        return ("", calls) if calls is not None else (held[sent:], None)

    @staticmethod
    def calls(text: str) -> list[dict] | None:
        decoder, out, at = json.JSONDecoder(), [], 0
        try:
            while True:
                at = len(text) - len(text[at:].lstrip())
                value, at = decoder.raw_decode(text, at)
                if not isinstance(value, dict) or not {"arguments", "parameters"} & set(value):
                    return None  # JSON that is not a call (an answer in JSON) is content
                out.append(_named({"name": value.get("name"), "arguments": value.get(
                    "arguments", value.get("parameters"))}))
                rest = text[at:].lstrip()
                if not rest:
                    return out
                if not rest.startswith(";"):
                    return None
                at = len(text) - len(rest) + 1
        except ValueError:
            return None


def _whole_json(text: str):
    """`text` as one JSON value (ValueError if it is not, or if more follows it)."""
    value, end = json.JSONDecoder().raw_decode(text)
    if text[end:].strip():
        raise ValueError("text after the JSON value")
    return value


def _named(value) -> dict:
    """A call from `{"name": ..., "arguments": ...}` (ValueError if it is not one)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ValueError("a call is an object with a name")
    return _call(value["name"], value.get("arguments", {}))


READERS = {"hermes": Hermes, "llama3_json": Llama3Json, "mistral": Mistral}
PARSERS = tuple(READERS)  # --tool-call-parser's choices, vLLM's names
Reader = Forced | Hermes | Mistral | Llama3Json


def _function(i: int, tool) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(
            tool.get("function"), dict) or not isinstance(tool["function"].get("name"), str):
        raise InvalidArgument(f"tools[{i}] must be {{'type': 'function', 'function': "
                              "{'name': ..., 'parameters': {...}}}")
    parameters = tool["function"].get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise InvalidArgument(f"tools[{i}].function.parameters must be a JSON schema object")
    return {"name": tool["function"]["name"], "parameters": parameters}


def tool_reader(body: dict, parser: str | None, cut_calls: bool = False) -> Reader | None:
    """How a chat body's tool calls are made and read; None without tools or with
    tool_choice "none" (the tools are then only shown to the model). `parser`: the
    server's --tool-call-parser, which "auto" needs; `cut_calls`: Forced's."""
    tools, choice = body.get("tools") or [], body.get("tool_choice")
    if body.get("functions"):
        raise InvalidArgument("'functions' is not supported: send 'tools'")
    if not isinstance(tools, list):
        raise InvalidArgument("'tools' must be a list")
    functions = tuple(_function(i, t) for i, t in enumerate(tools))
    if not functions:
        if choice not in (None, "none"):
            raise InvalidArgument("'tool_choice' needs 'tools'")
        return None
    if choice == "none":
        return None
    if choice == "required":
        parallel = body.get("parallel_tool_calls", True)
        if not isinstance(parallel, bool):
            raise InvalidArgument("'parallel_tool_calls' must be true or false")
        return Forced(functions, None, parallel, cut_calls)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in {f["name"] for f in functions}:
            raise InvalidArgument(f"tool_choice names {name!r}, which is not among the tools")
        return Forced(functions, name, cut_calls=cut_calls)
    if choice in (None, "auto") and parser is not None:
        return READERS[parser]()
    if choice in (None, "auto"):
        raise InvalidArgument("tool_choice 'auto' (the model decides) needs the model's own "
                              "call syntax parsed: start the server with --tool-call-parser "
                              f"({' | '.join(PARSERS)}), or send tool_choice 'required' or a "
                              "named function")
    raise InvalidArgument("'tool_choice' must be 'none', 'auto', 'required' or a named "
                          "function")
