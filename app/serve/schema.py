"""The OpenAI request schema, validated with pydantic and turned into the engine's `ChatRequest`.

Fields OpenAI defines and npuchat cannot honour (n > 1, images, a completion's echo) are refused
with a 400 that names the field, rather than silently ignored; fields unknown to the schema are
ignored, as OpenAI-compatible servers do, so newer clients keep working. Sampling values outside
the engine's domains (`engine.sampling_domain`: a negative temperature, top_p outside (0, 1],
...) and max_tokens beyond the context are refused here, before a request is queued, by the same
rule the engine applies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from npuchat.engine.events import (
    ChatMessage,
    ChatRequest,
    Priority,
    Role,
    SamplingParams,
    ToolCall,
    ToolSpec,
)
from npuchat.engine.grammar import ANY_OBJECT
from npuchat.engine.logprobs import MAX_TOP_LOGPROBS
from npuchat.engine.sampling_domain import sampling_problems

from .tools import CLOSE, forced_call_prefix

MAX_STOP_STRINGS = 4
MAX_CHOICES = 4  # `n`: one KV slot each on the CPU


class ApiError(Exception):
    """An error answered as OpenAI's `{"error": {...}}` object with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Model):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Model):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Model):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallIn


class MessageIn(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionSpecIn(_Model):
    name: str = Field(min_length=1, max_length=64)
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=dict)


class ToolIn(_Model):
    type: Literal["function"]
    function: FunctionSpecIn


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: dict[str, str]


class StreamOptions(_Model):
    include_usage: bool = False


class _Sampling(_Model):
    """Sampling fields shared by both endpoints; `top_k`, `min_p`, `repeat_penalty` are
    llama-server's extensions, `priority` and `conversation_id` are npuchat's. `model` may be
    left out, as llama-server and vLLM allow: the one model this server serves answers."""

    model: str | None = None
    # types only: the values are checked by the engine's own rule (`sampling_domain`)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: Priority = "interactive"
    conversation_id: str | None = Field(default=None, min_length=1, max_length=200)
    # chat: true or false, with `top_logprobs` alternatives; completions: the alternatives
    logprobs: bool | int | None = None
    logit_bias: dict[str, float] | None = None  # token id -> added to its logit
    response_format: dict[str, Any] | None = None

    def want_logprobs(self) -> int | None:
        """`SamplingParams.logprobs`: None, or the alternatives wanted beside each token."""
        return None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not (key.isascii() and key.isdigit() and len(key) <= 9):
                raise ValueError(f"keys must be token ids (whole numbers), got {key[:20]!r}")
        return value

    @field_validator("response_format")
    @classmethod
    def _known_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        kind = (value or {}).get("type", "text")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError('type must be "text", "json_object" or "json_schema"')
        if kind == "json_schema":
            spec = value.get("json_schema") if value else None
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ValueError('json_schema needs {"name": ..., "schema": {...}}')
        return value

    def json_schema(self) -> str | None:
        """`SamplingParams.json_schema`: the schema the reply is held to (JSON mode: any
        object), or None."""
        kind = (self.response_format or {}).get("type", "text")
        if kind == "json_object":
            return ANY_OBJECT
        if kind == "json_schema":
            return json.dumps(self.response_format["json_schema"]["schema"])  # type: ignore[index]
        return None

    @field_validator("n")
    @classmethod
    def _few_choices(cls, n: int) -> int:
        if not 1 <= n <= MAX_CHOICES:
            raise ValueError(f"ask for 1 to {MAX_CHOICES} choices")
        return n

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return stop

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling(self, max_tokens: int, context_length: int) -> SamplingParams:
        if max_tokens > context_length:
            raise ApiError(
                400,
                f"max_tokens is {max_tokens} but the model's context holds {context_length} "
                "tokens; ask for fewer",
                param="max_tokens",
                code="context_length_exceeded",
            )
        base = SamplingParams()
        params = SamplingParams(
            temperature=base.temperature if self.temperature is None else self.temperature,
            top_k=base.top_k if self.top_k is None else self.top_k,
            top_p=base.top_p if self.top_p is None else self.top_p,
            min_p=base.min_p if self.min_p is None else self.min_p,
            repeat_penalty=base.repeat_penalty
            if self.repeat_penalty is None
            else self.repeat_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logprobs=self.want_logprobs(),
            json_schema=self.json_schema(),
            logit_bias=tuple((int(k), v) for k, v in (self.logit_bias or {}).items()),
            seed=self.seed,
            max_tokens=max_tokens,
            stop=self.stops(),
        )
        problems = sampling_problems(params)
        if problems:  # the engine would refuse them too; this keeps them out of the queue
            name, why = problems[0]
            raise ApiError(400, f"{name} {why}", param=name)
        return params

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionIn(_Sampling):
    """`continue_final_message` and `add_generation_prompt` are vLLM's extensions: with the
    first true (and the second false or absent) the reply extends the final assistant message,
    as llama-server does with a final assistant message."""

    messages: list[MessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[ToolIn] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def want_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ApiError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
            return None
        return self.top_logprobs or 0


class CompletionIn(_Sampling):
    prompt: str | list[str]
    echo: bool = False

    def want_logprobs(self) -> int | None:
        if self.logprobs is None or self.logprobs is False:
            return None
        return 0 if self.logprobs is True else int(self.logprobs)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str]) -> str | list[str]:
        if isinstance(prompt, list) and len(prompt) != 1:
            raise ValueError("give one prompt (a string, or a list of one string)")
        return prompt

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


def _error_param(error: Any) -> str:
    return ".".join(str(p) for p in error.get("loc", ())) or "body"


def parse(model: type[_Sampling], body: Any) -> Any:
    """Validate a decoded JSON body; the first problem becomes a 400 naming its field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _error_param(first)
        message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        raise ApiError(400, f"{param}: {message}", param=param) from None


@dataclass(frozen=True)
class Prepared:
    """A validated request ready for the engine, with what the response needs to echo."""

    request: ChatRequest
    stream: bool
    include_usage: bool
    tools: frozenset[str]
    """Names of the tools offered (empty: no tool calls are parsed)."""
    reply_prefix: str = ""
    """What the reply was forced to start with (read back with the model's text)."""
    choices: int = 1
    """`n`: replies to the same request, answered together (whole, not streamed)."""

    def named(self, conversation_id: str) -> Prepared:
        return replace(self, request=replace(self.request, conversation_id=conversation_id))

    def choice(self, index: int) -> ChatRequest:
        """The request of choice `index`: a conversation of its own (each runs in its own KV
        slot, batched with the others) and, given a seed, the seed plus the index, so that the
        choices differ and a request repeated with its seed gets the same ones."""
        r = self.request
        if index == 0:
            return r
        seed = r.sampling.seed
        sampling = replace(r.sampling, seed=None if seed is None else (seed + index) % 2**64)
        return replace(r, conversation_id=f"{r.conversation_id}#{index}", sampling=sampling)


_TURN_ROLES: dict[str, Role] = {"user": "user", "assistant": "assistant", "tool": "tool"}


def _tool_call(call: ToolCallIn) -> ToolCall:
    args = call.function.arguments
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(call.function.name, text, call.id)


def _messages(body: ChatCompletionIn) -> tuple[str, tuple[ChatMessage, ...]]:
    """The leading system (or developer) messages become the system prompt; the rest stay
    turns. A system message after the first turn is refused: the engine keeps one system
    prompt per conversation."""
    system: list[str] = []
    turns: list[ChatMessage] = []
    for i, m in enumerate(body.messages):
        if m.role in ("system", "developer"):
            if turns:
                raise ApiError(
                    400,
                    f"messages.{i}: system messages must come before the conversation's turns",
                    param=f"messages.{i}.role",
                )
            system.append(m.text())
            continue
        role = _TURN_ROLES[m.role]
        calls = tuple(_tool_call(c) for c in m.tool_calls or ())
        turns.append(ChatMessage(role, m.text(), calls, m.tool_call_id or ""))
    if not turns:
        raise ApiError(400, "messages: give at least one user message", param="messages")
    return "\n\n".join(system), tuple(turns)


def _tools(body: ChatCompletionIn) -> tuple[tuple[ToolSpec, ...], str]:
    """The tools offered, and the text the reply is forced to start with (`tool_choice`
    "required" or a named function: the opening of a `<tool_call>` block, `tools` module)."""
    choice = body.tool_choice
    if not body.tools or choice == "none":
        if choice == "required" or isinstance(choice, NamedToolChoice):
            raise ApiError(400, "tool_choice: the request offers no tools", param="tool_choice")
        return (), ""
    tools = tuple(
        ToolSpec(
            t.function.name,
            t.function.description,
            json.dumps(t.function.parameters, ensure_ascii=False),
        )
        for t in body.tools
    )
    if choice == "required":
        return tools, forced_call_prefix(None)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.get("name", "")
        if name not in {t.name for t in tools}:
            raise ApiError(
                400,
                f"tool_choice: {name!r} is not one of the request's tools",
                param="tool_choice.function.name",
            )
        return tools, forced_call_prefix(name)
    return tools, ""


def _continues(body: ChatCompletionIn, turns: tuple[ChatMessage, ...], forced: str) -> bool:
    """Whether the reply extends the final assistant message (`continue_final_message`)."""
    if not body.continue_final_message:
        if body.add_generation_prompt is False:
            raise ApiError(
                400,
                "add_generation_prompt: false is supported only with continue_final_message: true",
                param="add_generation_prompt",
            )
        return False
    if body.add_generation_prompt:
        raise ApiError(
            400,
            "add_generation_prompt: give false (or leave it out) with continue_final_message:"
            " the reply continues the final message instead of starting a new one",
            param="add_generation_prompt",
        )
    last = turns[-1]
    if last.role != "assistant" or last.tool_calls:
        raise ApiError(
            400,
            "continue_final_message: the final message must be an assistant message with text"
            " (no tool calls) to continue",
            param=f"messages.{len(body.messages) - 1}",
        )
    if forced:
        raise ApiError(
            400,
            "tool_choice: a forced tool call cannot continue a message; use auto or none",
            param="tool_choice",
        )
    return True


def prepare_chat(body: ChatCompletionIn, context_length: int) -> Prepared:
    system, turns = _messages(body)
    tools, forced = _tools(body)
    continue_reply = _continues(body, turns, forced)
    given = (body.max_completion_tokens, body.max_tokens)
    max_tokens = next((n for n in given if n is not None), context_length)
    sampling = body.sampling(max_tokens, context_length)
    if isinstance(body.tool_choice, NamedToolChoice):  # one call: it ends with its block
        sampling = replace(sampling, stop=(*sampling.stop, CLOSE))
    request = ChatRequest(
        conversation_id="",
        system_prompt=system,
        messages=turns,
        sampling=sampling,
        priority=body.priority,
        tools=tools,
        continue_reply=continue_reply,
        reply_prefix=forced,
    )
    names = frozenset(t.name for t in tools)
    return _choices(Prepared(request, body.stream, body.include_usage, names, forced), body)


def _choices(prepared: Prepared, body: _Sampling) -> Prepared:
    if body.n > 1 and body.stream:
        raise ApiError(
            400, "n: more than one choice is answered whole; leave out stream", param="n"
        )
    return replace(prepared, choices=body.n)


def prepare_completion(body: CompletionIn, context_length: int) -> Prepared:
    if body.echo:
        raise ApiError(400, "echo: not supported", param="echo")
    max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default
    request = ChatRequest(
        conversation_id="",
        system_prompt="",
        messages=(),
        sampling=body.sampling(max_tokens, context_length),
        priority=body.priority,
        raw_prompt=body.text(),
    )
    return _choices(Prepared(request, body.stream, body.include_usage, frozenset()), body)
