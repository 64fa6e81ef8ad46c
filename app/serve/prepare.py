"""A validated OpenAI request turned into what the engine runs: the system prompt and turns, the
tools and a forced call's opening, several choices, and the sampling the schema checked.

Apart from `schema` (what a request may hold) because this is the part that knows the engine's
request: the message roles it keeps, how a tool call is written back, when a reply continues.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from npuchat.engine.events import ChatMessage, ChatRequest, Role, ToolCall, ToolSpec

from .call_splitter import CallReading
from .schema import (
    ApiError,
    ChatCompletionIn,
    CompletionIn,
    NamedToolChoice,
    SamplingIn,
    ToolCallIn,
)
from .tools import (
    BARE_OPENING,
    CLOSE,
    FENCED_OPENING,
    OPEN,
    bare_call_grammar,
    call_grammar,
    forced_call_prefix,
)


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
    """`n`: replies to the same request, run side by side."""
    echo: str = ""
    """A completion's prompt, given back before its text (`echo`)."""
    one_call: bool = False
    """At most one tool call (`parallel_tool_calls` false, or a named function)."""

    @property
    def stream_calls(self) -> bool:
        """Whether a grammar holds the reply's call blocks, so a call may stream as it is
        written (`call_splitter`)."""
        s = self.request.sampling
        held = s.grammar is not None or s.grammar_after is not None or s.grammar_if_starts
        return bool(self.tools) and bool(held)

    @property
    def calls(self) -> CallReading:
        """How the replies are read for tool calls."""
        return CallReading(self.tools, self.reply_prefix, self.one_call, self.stream_calls)

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
    turns, a system message among them too (agents add one as the work goes on: the template
    renders it in place, or the engine folds it into a user turn where the template cannot)."""
    system: list[str] = []
    turns: list[ChatMessage] = []
    for m in body.messages:
        if m.role in ("system", "developer"):
            if turns:
                turns.append(ChatMessage("system", m.text()))
            else:
                system.append(m.text())
            continue
        role = _TURN_ROLES[m.role]
        calls = tuple(_tool_call(c) for c in m.tool_calls or ())
        turns.append(ChatMessage(role, m.text(), calls, m.tool_call_id or ""))
    if not turns:
        raise ApiError(400, "messages: give at least one user message", param="messages")
    return "\n\n".join(system), tuple(turns)


def _tools(body: ChatCompletionIn) -> tuple[tuple[ToolSpec, ...], str, str | None]:
    """The tools offered, the text the reply is forced to start with (`tool_choice`
    "required" or a named function: the opening of a `<tool_call>` block) and the grammar
    the rest is held to (None: the model writes it; `tools` module)."""
    choice = body.tool_choice
    if not body.tools or choice == "none":
        if choice == "required" or isinstance(choice, NamedToolChoice):
            raise ApiError(400, "tool_choice: the request offers no tools", param="tool_choice")
        return (), "", None
    tools = tuple(
        ToolSpec(
            t.function.name,
            t.function.description,
            json.dumps(t.function.parameters, ensure_ascii=False),
        )
        for t in body.tools
    )
    if choice != "required" and not isinstance(choice, NamedToolChoice):
        return tools, "", None
    name = choice.function.get("name", "") if isinstance(choice, NamedToolChoice) else None
    if name is not None and name not in {t.name for t in tools}:
        raise ApiError(
            400,
            f"tool_choice: {name!r} is not one of the request's tools",
            param="tool_choice.function.name",
        )
    grammar = call_grammar(tools, name, several=name is None and body.parallel_tool_calls)
    if grammar is None:
        return tools, forced_call_prefix(name), None
    return tools, OPEN + "\n", grammar


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


def prepare_chat(body: ChatCompletionIn, context_length: int, drop_turns: bool = False) -> Prepared:
    """The request as the engine's. A conversation that does not fit fails with the APIs'
    context error unless `drop_turns` (the Responses API's `truncation: "auto"`)."""
    system, turns = _messages(body)
    tools, forced, grammar = _tools(body)
    continue_reply = _continues(body, turns, forced)
    given = (body.max_completion_tokens, body.max_tokens)
    max_tokens = next((n for n in given if n is not None), context_length)
    sampling = body.sampling(max_tokens, context_length)
    if grammar is not None:  # a forced call is no reply `response_format` speaks of
        sampling = replace(sampling, grammar=grammar, json_schema=None)
    one_call = isinstance(body.tool_choice, NamedToolChoice) or not body.parallel_tool_calls
    if tools and not forced and sampling.json_schema is None:
        # `auto`: free text, but a call the model opens is held to the tools' schemas
        after = call_grammar(tools, None, several=not one_call, lead="\n")
        if after is not None:
            sampling = replace(sampling, grammar_after=(OPEN, after))
        bare = bare_call_grammar(tools, several=not one_call)  # as small models write them
        fenced = bare_call_grammar(tools, several=not one_call, fenced=True)
        openings = ((BARE_OPENING, bare), (FENCED_OPENING, fenced))
        sampling = replace(
            sampling, grammar_if_starts=tuple((o, g) for o, g in openings if g is not None)
        )
    if tools and one_call:  # one call: the reply ends with its block
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
        drop_turns=drop_turns,
    )
    names = frozenset(t.name for t in tools)
    prepared = Prepared(request, body.stream, body.include_usage, names, forced, one_call=one_call)
    return _choices(prepared, body)


def _choices(prepared: Prepared, body: SamplingIn) -> Prepared:
    return replace(prepared, choices=body.n)


def prepare_completion(body: CompletionIn, context_length: int) -> Prepared:
    if body.echo and body.want_logprobs() is not None:
        raise ApiError(400, "echo: not with logprobs (the prompt's are not computed)", param="echo")
    max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default
    request = ChatRequest(
        conversation_id="",
        system_prompt="",
        messages=(),
        sampling=body.sampling(max_tokens, context_length),
        priority=body.priority,
        raw_prompt=body.text(),
    )
    echo = body.text() if body.echo else ""
    prepared = Prepared(request, body.stream, body.include_usage, frozenset(), echo=echo)
    return _choices(prepared, body)
