"""`POST /v1/responses` requests, read as the chat completion they amount to.

OpenAI's Responses API says the same things as a chat completion in other words: `input` (a
string, or items: messages, the model's `function_call`s, the client's
`function_call_output`s) is the conversation, `instructions` the system prompt, `tools` are
flat function specs, `max_output_tokens` and `text.format` are `max_tokens` and
`response_format`. Turning a request into the `/v1/chat/completions` body it means lets one
path (`prepare_chat`) check and run both, so they cannot drift apart.

A `previous_response_id` names a kept response (`response_store`): its conversation goes
before this request's input. What the server cannot honour is refused with a 400 naming the
field, never ignored: a `conversation` (OpenAI's Conversations API), `background`, input other
than text (images, files), and item kinds other than messages and function calls (reasoning,
built-in tools).
"""

from __future__ import annotations

from typing import Any, Literal

from .schema import ApiError, RequestModel

LOGPROBS = "message.output_text.logprobs"  # the `include` that asks for them
MAX_ITEMS = 4096  # input items; a conversation's turns, far more than any context holds


class ResponseIn(RequestModel):
    model: str | None = None
    input: Any  # a string or a list of items (`as_chat` says which is wrong)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool = True
    top_logprobs: int | None = None
    include: list[str] | None = None  # only "message.output_text.logprobs" adds anything here
    conversation: str | dict[str, Any] | None = None
    background: bool = False
    truncation: Literal["auto", "disabled"] | None = None  # "auto": drop the oldest turns to fit
    priority: str | None = None  # npuchat's extension, as for chat completions
    conversation_id: str | None = None  # npuchat's extension


def _refuse(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def _text(content: Any, param: str) -> str:
    """A message's or an output's text: a string, or parts of text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refuse(param, "give a string or a list of text parts")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
            part.get("text"), str
        ):
            raise _refuse(
                f"{param}[{i}]", f"only text parts are read here, not {kind or 'this part'}"
            )
        texts.append(part["text"])
    return "".join(texts)


def _field(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _refuse(f"{param}.{key}", "give a string")
    return value


def _messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as chat messages; the calls of one turn join the assistant message before
    them, as a chat completion carries them."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise _refuse(param, "give an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _refuse(f"{param}.role", "give user, assistant, system or developer")
            out.append({"role": role, "content": _text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call = {
                "id": _field(item, "call_id", param),
                "type": "function",
                "function": {
                    "name": _field(item, "name", param),
                    "arguments": _field(item, "arguments", param),
                },
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": _field(item, "call_id", param),
                    "content": _text(item.get("output"), f"{param}.output"),
                }
            )
        else:
            raise _refuse(
                f"{param}.type",
                f"{kind!r} items are not read here; give messages, function_call and "
                "function_call_output items",
            )
    return out


def _tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise _refuse(f"tools[{i}].type", f"only function tools run here, not {kind!r}")
        spec = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": spec})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _refuse("tool_choice", 'give "auto", "none", "required" or a function by name')


def _format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as a chat completion's `response_format`."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _refuse("text.format", "give an object")
    if fmt.get("type") == "json_schema":
        inner = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    return fmt


def history(body: ResponseIn, before: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation this request's reply answers, as chat messages without the system
    prompt: what the kept response it continues ended with (`before`), then its input."""
    if body.conversation is not None:
        raise _refuse("conversation", "conversations are not kept here; send `input`")
    if body.background:
        raise _refuse("background", "replies run while the request waits; leave it false")
    if isinstance(body.input, str):
        return [*before, {"role": "user", "content": body.input}]
    if not isinstance(body.input, list):
        raise _refuse("input", "give a string or a list of items")
    if not 0 < len(body.input) <= MAX_ITEMS:
        raise _refuse("input", f"give 1 to {MAX_ITEMS:,} items")
    return [*before, *_messages(body.input)]


def as_chat(body: ResponseIn, turns: list[dict[str, Any]]) -> dict[str, Any]:
    """The `/v1/chat/completions` body this request means (module doc); `turns`: `history`.
    The instructions are this request's own: a continued response's are not carried over."""
    messages = turns
    if body.instructions:
        messages = [{"role": "system", "content": body.instructions}, *messages]
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "stream": body.stream,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    optional = {
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": _tools(body.tools) if body.tools else None,
        "tool_choice": _tool_choice(body.tool_choice),
        "response_format": _format(body.text),
        "priority": body.priority,
        "conversation_id": body.conversation_id,
    }
    chat.update({k: v for k, v in optional.items() if v is not None})
    if wants_logprobs(body):
        chat.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    return chat


def wants_logprobs(body: ResponseIn) -> bool:
    """Log probabilities come with the text when asked for by either of the API's ways."""
    return body.top_logprobs is not None or LOGPROBS in (body.include or [])


# a chat completion's fields, as this request named them (`as_chat`)
_NAMES = {
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
}


def renamed(exc: ApiError) -> ApiError:
    """A refusal of the chat completion `as_chat` made, naming the field the client sent."""
    head = (exc.param or "").split(".", 1)[0]
    if head not in _NAMES:
        return exc
    param = _NAMES[head] + (exc.param or "")[len(head) :]
    message = exc.message.replace(head, _NAMES[head], 1)
    return ApiError(exc.status, message, type=exc.type, param=param, code=exc.code)
