"""What Claude Code sends to `/v1/messages` beside the API's documented fields, read as it
means (request shapes taken from Claude Code 2.1.332's own requests to a capturing server):
the billing line at the head of `system`, which changes with every request and would leave
nothing of the prompt reusable; `system` messages among the turns (its environment notes);
tools marked `defer_loading`, shown to the model only once a tool search has loaded them
(`tool_reference` blocks in a tool result); `thinking: adaptive`, `context_management`,
`output_config.effort` and `metadata`, which have nothing to act on here."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
from scripted_engine import ScriptedEngine, ScriptedReply
from serve_helpers import serving

from npuchat.engine.events import ChatMessage

BILLING = "x-anthropic-billing-header: cc_version=2.1.332.{}; cc_entrypoint=sdk-cli;"
ENVIRONMENT = "# Environment\nPrimary working directory: /tmp/work"
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
READ = {"name": "Read", "description": "Read a file", "input_schema": SCHEMA}
FETCH = {"name": "WebFetch", "description": "Fetch a URL", "input_schema": SCHEMA}
DEFERRED = {**FETCH, "defer_loading": True}
SEARCH = {
    "name": "ToolSearch",
    "description": "Load deferred tools",
    "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}},
}


def _request(nonce: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "model": "scripted-1b",
        "max_tokens": 32000,
        "system": [
            {"type": "text", "text": BILLING.format(nonce)},
            {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": messages,
        "tools": [READ, SEARCH, DEFERRED],
        "metadata": {"user_id": '{"session_id": "s"}'},
        "extra_body": {  # fields of Claude Code's betas, beyond the SDK's arguments
            "thinking": {"type": "adaptive", "display": "omitted"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"},
        },
    }


def _ask(client: anthropic.Anthropic, body: dict[str, Any]) -> str:
    with client.messages.stream(**body) as stream:  # type: ignore[arg-type]
        return stream.get_final_message().content[0].text  # type: ignore[union-attr]


def test_claude_code_s_requests_are_read_as_they_mean() -> None:
    engine = ScriptedEngine([ScriptedReply(["4"]), ScriptedReply(["4"]), ScriptedReply(["ok"])])
    question = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "<system-reminder>be careful</system-reminder>"},
                {"type": "text", "text": "What is 2+2?"},
            ],
        },
        {"role": "system", "content": [{"type": "text", "text": ENVIRONMENT}]},
    ]
    searched = [
        *question,
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "ToolSearch",
                    "input": {"query": "select:WebFetch"},
                }
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "tool_reference", "tool_name": "WebFetch"}],
                }
            ],
        },
    ]
    with (
        serving(engine) as (server, _),
        anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0) as client,
    ):
        answers = [_ask(client, _request(n, question)) for n in ("448", "bf1")]
        after_search = _ask(client, _request("c07", searched))
    first, second, third = engine.requests
    assert answers == ["4", "4"] and after_search == "ok"
    # the billing line left out: two requests of one conversation share their whole prompt
    assert first.system_prompt == second.system_prompt == "You are an agent."
    assert first.messages == second.messages
    assert first.messages == (
        ChatMessage("user", "<system-reminder>be careful</system-reminder>\n\nWhat is 2+2?"),
        ChatMessage("system", ENVIRONMENT),
    )
    # a deferred tool is offered once a tool search has loaded it, not before
    assert [t.name for t in first.tools] == ["Read", "ToolSearch"]
    assert [t.name for t in third.tools] == ["Read", "ToolSearch", "WebFetch"]
    assert third.messages[-1] == ChatMessage("tool", "Tool loaded: WebFetch", (), "toolu_1")


def test_a_system_message_among_the_turns_holds_text_only() -> None:
    call = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "a"}}
    turns = [{"role": "user", "content": "hi"}, {"role": "system", "content": [call]}]
    engine = ScriptedEngine()
    with serving(engine) as (server, _):
        body = {"model": "scripted-1b", "max_tokens": 8, "messages": turns, "tools": [READ]}
        r = httpx.post(server.url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 400 and engine.requests == []
    assert r.json()["error"]["message"] == (
        "messages.1.content.0.type: tool_use is not read in a system turn here; give text blocks"
    )
