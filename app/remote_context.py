"""Fitting a conversation to a remote server's context (`npuchat --server URL`).

A local engine drops a long conversation's oldest turns itself; a server answers one that does
not fit with its API's context error instead (OpenAI's and npuchat serve's
`context_length_exceeded`, vLLM's "maximum context length" message, llama-server's
`exceed_context_size_error`), since an API client decides what to cut. The app's choice is the
same over HTTP as at home: drop the oldest turns and ask again, so a chat does not stop working
when its history outgrows the server. Where the error says the two counts, enough turns go at
once to leave a quarter of the context for the reply, as the local engine leaves (characters
standing in for tokens); where it does not, one turn a try.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from npuchat.engine.events import ChatMessage, ChatRequest, Notice
from npuchat.engine.prompts import without_oldest_turn

__all__ = ["context_counts", "dropped_notice", "is_context_error", "shortened"]

PROMPT_SHARE = 0.75  # of the context, for the prompt after trimming (the engine's reserve)
_COUNTS = re.compile(  # OpenAI's and npuchat's message, and vLLM's two
    r"maximum context length is (\d+) tokens.*?"
    r"(?:resulted in (\d+) tokens|\((\d+) in the messages|request has (\d+) input tokens)",
    re.S,
)


def is_context_error(error: dict[str, Any]) -> bool:
    """Whether a server's error object says the prompt does not fit its context."""
    return (
        error.get("code") == "context_length_exceeded"
        or error.get("type") == "exceed_context_size_error"
        or "maximum context length" in str(error.get("message", ""))
    )


def context_counts(error: dict[str, Any]) -> tuple[int, int] | None:
    """(the prompt's tokens, the context's) where the error says them."""
    prompt, context = error.get("n_prompt_tokens"), error.get("n_ctx")  # llama-server's fields
    if isinstance(prompt, int) and isinstance(context, int):
        return (prompt, context) if prompt > 0 and context > 0 else None
    found = _COUNTS.search(str(error.get("message", "")))
    if found is None:
        return None
    context = int(found.group(1))
    prompt = int(found.group(2) or found.group(3) or found.group(4))
    return (prompt, context) if prompt > 0 and context > 0 else None


def _chars(messages: list[ChatMessage]) -> int:
    return sum(len(m.content) + sum(len(c.arguments) for c in m.tool_calls) for m in messages)


def shortened(request: ChatRequest, counts: tuple[int, int] | None) -> ChatRequest | None:
    """The request with its oldest turns dropped (at least one), or None when none can be:
    only the last user message is left, or the request may not drop turns."""
    if not request.drop_turns or request.raw_prompt is not None:
        return None
    messages = without_oldest_turn(request.messages)
    if messages is None:
        return None
    if counts is not None:
        prompt, context = counts
        target = _chars(list(request.messages)) * PROMPT_SHARE * context / prompt
        while _chars(messages) > target and (shorter := without_oldest_turn(messages)):
            messages = shorter
    return replace(request, messages=tuple(messages))


def dropped_notice(request: ChatRequest, asked: ChatRequest) -> Notice:
    """The local engine's notice, for the turns `asked` leaves out of `request`."""
    gone = request.messages[: len(request.messages) - len(asked.messages)]
    n = sum(m.role == "user" for m in gone)
    return Notice(f"dropped {n} oldest turn{'s' * (n != 1)} to fit the server's context", "warning")
