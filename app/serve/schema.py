"""The OpenAI request schema, validated with pydantic (`prepare` turns it into the engine's
`ChatRequest`).

Fields OpenAI defines and npuchat cannot honour (more than 4 choices, images, a completion's echo
with logprobs) are refused with a 400 that names the field, rather than silently ignored;
fields unknown to the schema are ignored, as OpenAI-compatible servers do, so newer clients keep
working. Sampling values outside the engine's domains (`engine.sampling_domain`: a negative
temperature, top_p outside (0, 1], ...) and max_tokens beyond the context are refused here,
before a request is queued, by the same rule the engine applies.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from npuchat.engine.events import (
    Priority,
    SamplingParams,
)
from npuchat.engine.grammar import ANY_OBJECT
from npuchat.engine.logprobs import MAX_TOP_LOGPROBS
from npuchat.engine.sampling_domain import sampling_problems

MAX_STOP_STRINGS = 4
MAX_CHOICES = 4  # `n`: one KV slot each on the CPU
MAX_TOOLS = 128  # OpenAI's own limit; a forced call compiles each tool's schema (ms each)


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
        anthropic_message: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.anthropic_message = anthropic_message  # where Anthropic words it differently

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        """The same error in Anthropic's shape (`/v1/messages`), its type named by status; it
        has no `param`, so a message that does not begin with the field's name is led by it."""
        kind = _ANTHROPIC_TYPES.get(self.status)
        if kind is None:
            kind = "invalid_request_error" if self.status < 500 else "api_error"
        if self.anthropic_message is not None:
            return {"type": "error", "error": {"type": kind, "message": self.anthropic_message}}
        message = self.message
        if self.param and not message.startswith(self.param.split(".")[0]):
            message = f"{self.param}: {message}"
        return {"type": "error", "error": {"type": kind, "message": message}}


_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


class RequestModel(BaseModel):
    """A request body's schema: fields it does not know are ignored (module doc)."""

    model_config = ConfigDict(extra="ignore")


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class FunctionCallIn(RequestModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(RequestModel):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallIn


class MessageIn(RequestModel):
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


class FunctionSpecIn(RequestModel):
    name: str = Field(min_length=1, max_length=64)
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=dict)


class ToolIn(RequestModel):
    type: Literal["function"]
    function: FunctionSpecIn


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: dict[str, str]


class StreamOptions(RequestModel):
    include_usage: bool = False


class SamplingIn(RequestModel):
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
            schema = self.response_format["json_schema"]["schema"]  # type: ignore[index]
            try:
                return json.dumps(schema)
            except RecursionError:
                raise ApiError(
                    400, "response_format: the schema is nested too deeply", param="response_format"
                ) from None
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


class ChatCompletionIn(SamplingIn):
    """`continue_final_message` and `add_generation_prompt` are vLLM's extensions: with the
    first true (and the second false or absent) the reply extends the final assistant message,
    as llama-server does with a final assistant message."""

    messages: list[MessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[ToolIn] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def want_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ApiError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
            return None
        return self.top_logprobs or 0


class CompletionIn(SamplingIn):
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


def parse(model: type[RequestModel], body: Any) -> Any:
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
