"""Tool calling on chat completions where the client decides that a tool is called:
`tool_choice` "required" (one or more calls of the given tools; one with
`parallel_tool_calls` false) or a named function. The
output is held to a JSON schema of the call(s) by structured output (vLLM's way for these
two choices), so no parser of the model's own call syntax is needed, and it comes back as
the message's `tool_calls` (finish reason "tool_calls"). The tools also reach the chat
template as `tools`, as transformers' apply_chat_template passes them. "auto" (the model
decides whether to call) would need the model family's call syntax parsed: refused with
400, naming the two choices that work."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from serving.errors import InvalidArgument
from serving.sampling import Grammar


@dataclass(frozen=True)
class ToolChoice:
    """The tools of a request whose calls are forced: `named` one, or any ("required")."""

    tools: tuple[dict, ...]  # each {"name", "parameters"} of the body's function tools
    named: str | None
    parallel: bool = True  # "required": several calls allowed (parallel_tool_calls)

    def grammar(self) -> Grammar:
        if self.named is not None:
            return Grammar.of("json", self._parameters(self.named))
        # vLLM's "required": a list of {"name", "parameters"}, each name one of the tools
        calls = [{"type": "object", "properties": {
            "name": {"type": "string", "enum": [t["name"]]}, "parameters": t["parameters"]},
            "required": ["name", "parameters"], "additionalProperties": False}
            for t in self.tools]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return Grammar.of("json", array if self.parallel else {**array, "maxItems": 1})

    def _parameters(self, name: str) -> dict:
        return next(t["parameters"] for t in self.tools if t["name"] == name)

    def calls(self, text: str) -> list[dict] | None:
        """The `tool_calls` of a whole output (None where it is not a complete call: the
        output was cut by max_tokens)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        pairs = [(self.named, value)] if self.named is not None else [
            (c["name"], c["parameters"]) for c in value]
        return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                 "function": {"name": name, "arguments": json.dumps(arguments)}}
                for name, arguments in pairs]


def _function(i: int, tool) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(
            tool.get("function"), dict) or not isinstance(tool["function"].get("name"), str):
        raise InvalidArgument(f"tools[{i}] must be {{'type': 'function', 'function': "
                              "{'name': ..., 'parameters': {...}}}")
    parameters = tool["function"].get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise InvalidArgument(f"tools[{i}].function.parameters must be a JSON schema object")
    return {"name": tool["function"]["name"], "parameters": parameters}


def tool_choice(body: dict) -> ToolChoice | None:
    """The forced calls a chat body asks for; None without tools or with tool_choice
    "none" (the tools are then only shown to the model)."""
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
        return ToolChoice(functions, None, parallel)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in {f["name"] for f in functions}:
            raise InvalidArgument(f"tool_choice names {name!r}, which is not among the tools")
        return ToolChoice(functions, name)
    raise InvalidArgument("'tool_choice' must be 'none', 'required' or a named function: "
                          "'auto' (the model decides) would need the model's own tool-call "
                          "syntax parsed, which this server does not do")
