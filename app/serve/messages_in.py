"""`POST /v1/messages` requests (Anthropic's Messages API), read as the chat completion they
amount to.

Anthropic's API says what a chat completion says in other words, so clients written for it
(Claude Code, the `anthropic` SDK) run on the local model as llama.cpp's and vLLM's servers
let them: `system` is the system prompt; `messages` alternate user and assistant turns whose
content is text or blocks (`tool_use` blocks are the assistant's calls, `tool_result` blocks
the user's answers to them, each becoming a tool message); `tools` carry `input_schema`;
`tool_choice` `any` is `required`; `stop_sequences` are stop strings; `output_config.format`
is a JSON schema the reply is held to. A final assistant message is a prefill: the reply
continues it (vLLM's `continue_final_message`). Consecutive turns of one role are joined into
one, as Anthropic joins them. The body is turned into that chat completion and checked and
run by the same path (`prepare_chat`), so the endpoints cannot drift apart.

Refused with a 400 naming the field, never ignored: images and documents, server tools (web
search, code execution, ...), `max_tokens` below 1. `thinking` is accepted and has no effect:
the models served here write no separate reasoning, so a reply has no thinking blocks (the
API lets a model think less than its budget); thinking blocks sent back are left out of the
prompt, as Anthropic leaves out those of earlier turns. `cache_control` marks are ignored:
every conversation's KV is kept and reused here without them. What Claude Code sends beside
the API's fields is read as it means: `system` messages among the turns (its environment
notes), tools marked `defer_loading` (not shown to the model until searched for: left out),
and its billing line at the head of `system` (left out: it would defeat KV reuse).
"""

from __future__ import annotations

import json
import re
from typing import Any

from .schema import ApiError, RequestModel

MAX_MESSAGES = 100_000  # Anthropic's own limit; the body's size bounds them first
_SKIPPED = ("thinking", "redacted_thinking")  # the model's past reasoning: left out
_TOOL_TYPES = (None, "custom")  # client tools; any other type is a server tool
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


class MessagesBase(RequestModel):
    """What `/v1/messages` and `/v1/messages/count_tokens` both read. `model` may be left
    out, as for the other endpoints: the one model this server serves answers."""

    model: str | None = None
    messages: Any  # a list of turns (`history` says what is wrong with anything else)
    system: Any = None  # a string or text blocks
    tools: list[Any] | None = None
    tool_choice: Any = None
    thinking: Any = None  # accepted, no effect (module doc)
    output_config: Any = None
    conversation_id: str | None = None  # npuchat's extension


class MessagesIn(MessagesBase):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    priority: str | None = None  # npuchat's extension, as for chat completions


def _refuse(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def _block_type(block: Any) -> str | None:
    kind = block.get("type") if isinstance(block, dict) else None
    return kind if isinstance(kind, str) else None


def _texts(content: Any, param: str) -> list[str]:
    """The text of a string or of text blocks (a system prompt, a tool's result)."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise _refuse(param, "give a string or a list of text blocks")
    out = []
    for i, block in enumerate(content):
        if _block_type(block) != "text" or not isinstance(block.get("text"), str):
            kind = _block_type(block) or "this block"
            raise _refuse(f"{param}.{i}", f"only text blocks are read here, not {kind}")
        out.append(block["text"])
    return out


def _billing(text: str) -> bool:
    """Claude Code's billing line for Anthropic's servers, sent as the system prompt's first
    block (`x-anthropic-billing-header: cc_version=2.1.332.448; ...`). It means nothing to the
    model and changes with each request, so kept it would put every request's prompt on a new
    prefix and nothing could be reused; llama.cpp's and vLLM's servers leave it out too."""
    return text.startswith("x-anthropic-billing-header:") and "\n" not in text.strip()


def _joined(texts: list[str]) -> str:
    """Blocks of text as one message: a blank line between them (Claude Code sends a turn's
    reminders and its question as separate blocks)."""
    return "\n\n".join(t for t in texts if t)


def _string(block: dict[str, Any], key: str, param: str) -> str:
    value = block.get(key)
    if not isinstance(value, str) or not value:
        raise _refuse(f"{param}.{key}", "give a string")
    return value


def _reference(block: Any) -> str | None:
    """The tool a `tool_reference` block names (the answer of a tool search: that deferred
    tool is offered from then on), or None for any other block."""
    name = block.get("tool_name") if _block_type(block) == "tool_reference" else None
    return name if isinstance(name, str) and name else None


def _tool_result(block: dict[str, Any], param: str) -> dict[str, Any]:
    content = block.get("content", "")
    if isinstance(content, list):  # tool references read as the tools they load
        loaded = [f"Tool loaded: {name}" for b in content if (name := _reference(b))]
        content = [b for b in content if _reference(b) is None]
        text = _joined([*loaded, *_texts(content, f"{param}.content")])
    else:
        text = _joined(_texts(content, f"{param}.content"))
    if block.get("is_error") is True:
        text = f"Error: {text}"  # what the tool said went wrong, so the model reads it so
    return {"role": "tool", "tool_call_id": _string(block, "tool_use_id", param), "content": text}


def _tool_use(block: dict[str, Any], param: str) -> dict[str, Any]:
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise _refuse(f"{param}.input", "give an object")
    return {
        "id": _string(block, "id", param),
        "type": "function",
        "function": {
            "name": _string(block, "name", param),
            "arguments": json.dumps(arguments, ensure_ascii=False),
        },
    }


_OTHER_BLOCKS = {"user": ", tool_result", "assistant": ", tool_use", "system": ""}


def _turn(role: str, content: Any, param: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user turn's tool results (each a tool
    message) before its text; an assistant turn's text with its calls."""
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(blocks, list):
        raise _refuse(f"{param}.content", "give a string or a list of content blocks")
    texts: list[str] = []
    results: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(blocks):
        where, kind = f"{param}.content.{i}", _block_type(block)
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, where))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, where))
        elif kind in _SKIPPED and role == "assistant":
            continue
        else:
            raise _refuse(
                f"{where}.type",
                f"{kind or 'this block'} is not read in a {role} turn here; give text"
                + _OTHER_BLOCKS[role]
                + " blocks",
            )
    text = _joined(texts)
    if role == "system":
        return [{"role": "system", "content": text}]
    if role == "user":
        return [*results, {"role": "user", "content": text}] if text or not results else results
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]


def _merge(into: list[dict[str, Any]], message: dict[str, Any]) -> None:
    """Append `message`, joined with the last one where both are the same role's text."""
    last = into[-1] if into else None
    if last is None or last["role"] != message["role"] or last["role"] == "tool":
        into.append(message)
        return
    if last.get("tool_calls") and message["content"]:  # text after a call starts a new turn
        into.append(message)
        return
    last["content"] = _joined([last["content"], message["content"]])
    if message.get("tool_calls"):
        last["tool_calls"] = [*last.get("tool_calls", []), *message["tool_calls"]]


def history(body: MessagesBase) -> tuple[list[dict[str, Any]], list[int]]:
    """The turns as chat messages, and for each the index of the message it came from (an
    error about a chat message names the client's)."""
    if not isinstance(body.messages, list) or not 0 < len(body.messages) <= MAX_MESSAGES:
        raise _refuse("messages", f"give a list of 1 to {MAX_MESSAGES:,} messages")
    out: list[dict[str, Any]] = []
    origin: list[int] = []
    for i, message in enumerate(body.messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant", "system"):  # Claude Code sends system ones too
            raise _refuse(f"messages.{i}.role", 'give "user", "assistant" or "system"')
        for turn in _turn(role, message.get("content"), f"messages.{i}"):
            before = len(out)
            _merge(out, turn)
            if len(out) > before:
                origin.append(i)
    return out, origin


def _referenced(messages: list[Any]) -> set[str]:
    """The tools the conversation's tool searches loaded (`tool_reference` blocks)."""
    names = set()
    for message in messages:
        blocks = message.get("content") if isinstance(message, dict) else None
        for block in blocks if isinstance(blocks, list) else ():
            inner = block.get("content") if _block_type(block) == "tool_result" else None
            if isinstance(inner, list):
                names |= {name for b in inner if (name := _reference(b))}
    return names


def _tools(tools: list[Any], loaded: set[str]) -> list[dict[str, Any]]:
    """The tools as chat functions; a deferred one (`defer_loading`) only once a tool search
    has loaded it (`loaded`), as Anthropic's API shows it to the model."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else "this"
        if not isinstance(tool, dict) or kind not in _TOOL_TYPES:
            raise _refuse(
                f"tools.{i}.type",
                f"{kind!r} tools run on Anthropic's servers, not here; give tools with a "
                "name and an input_schema",
            )
        if tool.get("defer_loading") is True and tool.get("name") not in loaded:
            continue
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise _refuse(f"tools.{i}.input_schema", "give the tool's JSON schema (an object)")
        spec = {"name": tool.get("name"), "parameters": schema}
        if "description" in tool:
            spec["description"] = tool["description"]
        out.append({"type": "function", "function": spec})
    return out


def _tool_choice(choice: Any) -> tuple[Any, bool]:
    """The chat completion's `tool_choice` and `parallel_tool_calls`."""
    if choice is None:
        return None, True
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in (*_CHOICES, "tool"):
        raise _refuse("tool_choice", 'give {"type": "auto"}, "any", "none" or "tool" with a name')
    parallel = choice.get("disable_parallel_tool_use") is not True
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise _refuse("tool_choice.name", "give the name of one of the request's tools")
        return {"type": "function", "function": {"name": name}}, parallel
    return _CHOICES[kind], parallel


def _format(config: Any) -> dict[str, Any] | None:
    """`output_config.format` as a chat completion's `response_format` (`effort` has nothing
    to act on here)."""
    if config is None:
        return None
    fmt = config.get("format") if isinstance(config, dict) else "no object"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise _refuse("output_config.format", 'give {"type": "json_schema", "schema": {...}}')
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.get("schema")}}


def as_chat(body: MessagesBase, turns: list[dict[str, Any]], context: int) -> dict[str, Any]:
    """The `/v1/chat/completions` body this request means (module doc); `turns`: `history`.
    `max_tokens` is required here and clients send their own models' limits (32,000 and
    more), so it is capped at the model's `context`: a reply that fills the context ends
    with `model_context_window_exceeded`, Anthropic's word for it."""
    messages = turns
    if body.system is not None:
        system = _joined([t for t in _texts(body.system, "system") if not _billing(t)])
        messages = [{"role": "system", "content": system}, *turns] if system else turns
    choice, parallel = _tool_choice(body.tool_choice)
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "parallel_tool_calls": parallel,
        "continue_final_message": turns[-1]["role"] == "assistant",
    }
    optional: dict[str, Any] = {
        "tools": _tools(body.tools, _referenced(body.messages)) if body.tools else None,
        "tool_choice": choice,
        "response_format": _format(body.output_config),
        "conversation_id": body.conversation_id,
    }
    if isinstance(body, MessagesIn):
        if body.max_tokens < 1:
            raise _refuse("max_tokens", "give at least 1 (nothing here only fills the cache)")
        optional.update(
            max_tokens=min(body.max_tokens, context),
            stop=body.stop_sequences,
            stream=body.stream,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            priority=body.priority,
        )
    chat.update({k: v for k, v in optional.items() if v is not None})
    return chat


# a chat completion's fields, as this request names them (`renamed`)
_NAMES = [
    (r"tools\.(\d+)\.function\.parameters", r"tools.\1.input_schema"),
    (r"tools\.(\d+)\.function\.", r"tools.\1."),
    (r"tool_choice\.function\.name", "tool_choice.name"),
    (r"parallel_tool_calls", "tool_choice.disable_parallel_tool_use"),
    (r"response_format", "output_config.format"),
    (r"stop\b", "stop_sequences"),
]


def renamed(exc: ApiError, origin: list[int], system: bool) -> ApiError:
    """A refusal of the chat completion `as_chat` made, naming the field the client sent:
    `messages.N` the client's message that chat message came from (`history`); `system`:
    the chat's first message is the system prompt."""
    param = exc.param or ""
    message = exc.message
    at = re.match(r"messages\.(\d+)", param)
    if at is not None:
        index = int(at.group(1)) - system
        named = "system" if index < 0 else f"messages.{origin[min(index, len(origin) - 1)]}"
        message = message.replace(at.group(0), named, 1)
        param = named + param[at.end() :] if index >= 0 else "system"
    message = re.sub(r"^continue_final_message\b", param, message)  # the prefill's rule
    for pattern, name in _NAMES:
        param = re.sub("^" + pattern, name, param)
        message = re.sub("^" + pattern, name, message)
    return ApiError(exc.status, message, type=exc.type, param=param or None, code=exc.code)
