"""`remote_context`: reading servers' context errors and trimming a conversation to fit, as the
app does over `npuchat --server URL`. The error objects are the shapes the servers send (OpenAI's
and npuchat serve's, vLLM's two wordings, llama-server's fields)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from npuchat.app.remote_context import context_counts, is_context_error, shortened
from npuchat.app.serve.routes import too_long_error
from npuchat.engine.events import ChatMessage, ChatRequest, ToolCall

VLLM_OLD = {
    "message": "This model's maximum context length is 2048 tokens. However, you requested 2058 "
    "tokens (2048 in the messages, 10 in the completion). Please reduce the length of the "
    "messages or completion.",
    "type": "BadRequestError",
    "param": None,
    "code": 400,
}
VLLM_NEW = {
    "message": "This model's maximum context length is 1536 tokens. However, your request has "
    "4176 input tokens. Please reduce the length of the input messages.",
    "type": "BadRequestError",
    "param": None,
    "code": 400,
}
LLAMA_SERVER = {
    "code": 400,
    "message": "request (4476 tokens) exceeds the available context size (4096 tokens)",
    "type": "exceed_context_size_error",
    "n_prompt_tokens": 4476,
    "n_ctx": 4096,
}


@pytest.mark.parametrize(
    ("error", "counts"),
    [
        (too_long_error(300, 256).body()["error"], (300, 256)),
        (VLLM_OLD, (2048, 2048)),
        (VLLM_NEW, (4176, 1536)),
        (LLAMA_SERVER, (4476, 4096)),
        ({"code": "context_length_exceeded", "message": "too long"}, None),
        (LLAMA_SERVER | {"n_ctx": 0}, None),
    ],
)
def test_context_errors_and_their_counts(error: dict[str, Any], counts: object) -> None:
    assert is_context_error(error)
    assert context_counts(error) == counts


@pytest.mark.parametrize(
    "error",
    [
        {"message": "max_tokens must be at least 1", "code": None},
        {"message": ["not", "a", "string"], "type": "invalid_request_error"},
        {"message": "maximum context len", "code": 400},
    ],
)
def test_other_errors_are_not_context_errors(error: dict[str, Any]) -> None:
    assert not is_context_error(error)
    assert context_counts(error) is None


def _conversation(turns: int) -> ChatRequest:
    messages: list[ChatMessage] = []
    for i in range(turns):
        call = ToolCall("lookup", '{"word": "fox"}', f"c{i}")
        messages += [
            ChatMessage("user", f"question {i} " * 10),
            ChatMessage("assistant", "", (call,)),
            ChatMessage("tool", "a result", tool_call_id=f"c{i}"),
            ChatMessage("assistant", f"answer {i} " * 10),
        ]
    return ChatRequest("c", "be brief", (*messages, ChatMessage("user", "the last question")))


def _chars(request: ChatRequest) -> int:
    return sum(
        len(m.content) + sum(len(c.arguments) for c in m.tool_calls) for m in request.messages
    )


def test_without_counts_one_turn_goes_a_try() -> None:
    request = _conversation(5)
    fitted = shortened(request, None)
    assert fitted is not None
    assert fitted.messages == request.messages[4:]  # the oldest user message and its replies
    assert fitted.system_prompt == request.system_prompt


def test_with_counts_enough_turns_go_at_once_to_leave_a_quarter_for_the_reply() -> None:
    request = _conversation(20)
    fitted = shortened(request, (1000, 500))
    assert fitted is not None and fitted.messages[0].role == "user"
    target = 0.75 * 500 / 1000 * _chars(request)
    assert _chars(fitted) <= target
    kept = len(fitted.messages)
    one_more = replace(request, messages=request.messages[-kept - 4 :])  # a turn is 4 here
    assert _chars(one_more) > target  # no more went than needed


def test_the_last_question_always_stays() -> None:
    request = _conversation(3)
    fitted = shortened(request, (10**9, 10))
    assert fitted is not None and fitted.messages == (ChatMessage("user", "the last question"),)
    assert shortened(fitted, None) is None
    assert shortened(fitted, (10**9, 10)) is None


def test_requests_that_may_not_drop_turns_are_left_alone() -> None:
    request = _conversation(3)
    assert shortened(replace(request, drop_turns=False), (1000, 500)) is None
    raw = ChatRequest("c", "", (), raw_prompt="once upon a time")
    assert shortened(raw, (1000, 500)) is None
