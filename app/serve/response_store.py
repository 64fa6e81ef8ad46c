"""Responses kept for `previous_response_id` and `GET /v1/responses/{id}`.

OpenAI keeps a response (`store`, true by default) so that the next request can name it instead
of sending the conversation again. Kept here in memory, for as long as the server runs, and
bounded (the newest first, at most `MAX_KEPT` responses and `MAX_BYTES` of them in all, the
oldest dropped beyond that): a server that keeps every conversation it ever answered would
grow without end. Each entry is the response object and the conversation it ends, as chat
messages (the input items read, then the reply as the assistant's message), which is what a
request continuing it puts before its own input. The ids are 96 random bits (`resp_...`): only
a client that was given one can name it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_KEPT = 1024
MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class Kept:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages, the reply last
    size: int


def reply_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output items as the assistant's chat message."""
    text = "".join(
        part["text"]
        for item in output
        if item["type"] == "message"
        for part in item["content"]
        if part.get("type") == "output_text"
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in output
        if item["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return message


class ResponseStore:
    """The kept responses, newest last (module doc)."""

    def __init__(self, max_kept: int = MAX_KEPT, max_bytes: int = MAX_BYTES) -> None:
        self.max_kept, self.max_bytes = max_kept, max_bytes
        self._kept: OrderedDict[str, Kept] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # streams end on the event loop, requests read anywhere

    def put(self, response: dict[str, Any], history: list[dict[str, Any]]) -> None:
        """Keep `response`, which answered `history` (chat messages, no system prompt)."""
        conversation = [*history, reply_message(response["output"])]
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        if size > self.max_bytes:
            return  # could only be kept by dropping everything else
        with self._lock:
            self._drop(response["id"])
            self._kept[response["id"]] = Kept(response, conversation, size)
            self._bytes += size
            while len(self._kept) > self.max_kept or self._bytes > self.max_bytes:
                self._drop(next(iter(self._kept)))

    def get(self, response_id: str) -> Kept | None:
        with self._lock:
            return self._kept.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        kept = self._kept.pop(response_id, None)
        if kept is not None:
            self._bytes -= kept.size
        return kept is not None
