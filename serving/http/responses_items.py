"""The Responses API's items in chat terms, and back: `input` items as the chat messages the
template renders (messages, the model's earlier `function_call`s, their
`function_call_output`s), its flat function tools and `tool_choice` as chat's, a reply as
the chat message a later turn renders, and the calls a tool reader found as
`function_call` output items. No HTTP here."""

from __future__ import annotations

from serving.errors import InvalidArgument
from serving.http.chat import messages_of
from serving.http.openai_requests import body_value

_PARTS = ("input_text", "output_text")  # the text content parts an input message may hold


def _text(where: str, content) -> str | list:
    """A message's content: a string, or its text parts as chat's text parts."""
    if not isinstance(content, list):
        return content
    if any(not isinstance(p, dict) or p.get("type") not in _PARTS for p in content):
        raise InvalidArgument(f"{where}: only input_text and output_text content parts are "
                              "supported")
    return [{"type": "text", "text": p.get("text")} for p in content]


def _call(i: int, item: dict) -> dict:
    """An earlier `function_call` item as a chat tool call."""
    if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
        raise InvalidArgument(f"input[{i}]: a function_call needs 'call_id', 'name' and "
                              "'arguments' (strings)")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def _result(i: int, item: dict) -> dict:
    """A `function_call_output` item as chat's tool message."""
    output = _text(f"input[{i}].output", item.get("output"))
    if not isinstance(item.get("call_id"), str) or output is None:
        raise InvalidArgument(f"input[{i}]: a function_call_output needs 'call_id' and "
                              "'output'")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def turn(body: dict) -> list[dict]:
    """`input` as chat messages (checked when the whole prompt is). Function calls join the
    assistant message before them (or start one), as chat completions' `tool_calls` do."""
    raw = body.get("input")
    items = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not items:
        raise InvalidArgument("'input' must be a string or a non-empty list of items")
    out: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            out.append({"role": item.get("role"),
                        "content": _text(f"input[{i}]", item.get("content"))})
        elif kind == "function_call":
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(_call(i, item))
        elif kind == "function_call_output":
            out.append(_result(i, item))
        elif kind == "reasoning":
            continue  # an earlier turn's thinking: reasoning models' templates drop it
        else:
            raise InvalidArgument(f"input[{i}] must be a message, a function_call, a "
                                  "function_call_output or a reasoning item")
    return out


def messages(body: dict, history: list[dict]) -> list[dict]:
    """The prompt's messages, checked: `instructions` first (a system message; an earlier
    response's are not carried over, as OpenAI answers), then the conversation."""
    instructions = body_value(body, "instructions", (str,))
    return messages_of(([{"role": "system", "content": instructions}] if instructions else [])
                       + history)


def reply(content: str, calls: list[dict] | None) -> dict:
    """A response's answer as the chat message a later turn's template renders."""
    return {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})


def chat_tools(body: dict) -> dict:
    """The body's `tools`, `tool_choice` and `parallel_tool_calls` as a chat body holds
    them (function tools only: the API's built-in tools run on OpenAI's side)."""
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise InvalidArgument("'tools' must be a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(
                t.get("name"), str):
            raise InvalidArgument(f"tools[{i}] must be {{'type': 'function', 'name': ..., "
                                  "'parameters': {...}} (built-in tools are not served)")
        out.append({"type": "function", "function": {
            k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}})
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice not in (None, "none", "auto", "required"):
        raise InvalidArgument("'tool_choice' must be 'none', 'auto', 'required' or "
                              "{'type': 'function', 'name': ...}")
    if not out and choice == "auto":
        choice = None  # what agent frameworks send with no tools
    chat = {"tools": out, "tool_choice": choice}
    if "parallel_tool_calls" in body:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    return chat


def function_call(call: dict, status: str, arguments: str | None = None) -> dict:
    """A chat tool call (serving/http/tools.py) as a `function_call` output item; the item's
    id is derived from the call's, so the same call gives the same item every time."""
    return {"id": "fc_" + call["id"].removeprefix("call_"), "type": "function_call",
            "status": status, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if arguments is None else arguments}
