"""Any JSON body a client can send gets an answer, never a 500: random bodies built from each
endpoint's own field names and values of every JSON type, nested, through the real app (the
schema, the request conversions and the routes) over the scripted engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_helpers import serving
from synthetic_vocab import QWEN25_TOOL_TEMPLATE
from viewing_engine import viewing

from npuchat.app.serve.server import Server

FIELDS = {
    "/v1/responses": [
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "text",
        "previous_response_id",
        "store",
        "conversation",
        "background",
        "type",
        "role",
        "content",
        "call_id",
        "name",
        "arguments",
        "output",
        "format",
        "schema",
        "parameters",
        "text",
    ],
    "/v1/chat/completions": [
        "model",
        "messages",
        "role",
        "content",
        "tools",
        "tool_choice",
        "function",
        "name",
        "parameters",
        "response_format",
        "type",
        "json_schema",
        "schema",
        "n",
        "logprobs",
        "top_logprobs",
        "max_tokens",
        "stop",
        "logit_bias",
        "seed",
        "stream",
    ],
    "/tokenize": [
        "content",
        "prompt",
        "messages",
        "role",
        "add_special",
        "add_special_tokens",
        "parse_special",
        "with_pieces",
        "model",
        "tools",
    ],
    "/detokenize": ["tokens", "model"],
    "/v1/messages": [
        "model",
        "max_tokens",
        "messages",
        "role",
        "content",
        "type",
        "text",
        "system",
        "tools",
        "name",
        "input_schema",
        "input",
        "id",
        "tool_use_id",
        "is_error",
        "tool_choice",
        "disable_parallel_tool_use",
        "stop_sequences",
        "stream",
        "thinking",
        "output_config",
        "format",
        "schema",
    ],
    "/v1/messages/count_tokens": ["model", "messages", "role", "content", "system", "tools"],
}

MAIN = {
    "/v1/responses": "input",
    "/v1/chat/completions": "messages",
    "/tokenize": "messages",
    "/detokenize": "tokens",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "messages",
}

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(
        [
            *("user", "assistant", "function", "message", "function_call", "auto", "x"),
            *("text", "tool_use", "tool_result", "any", "tool", "json_schema", "thinking"),
        ]
    ),
)


def _bodies(path: str) -> st.SearchStrategy[Any]:
    """Objects holding the endpoint's main field alone or a few of its fields (a refusal of
    one field hides what the others would do), or any of them, the values scalars, lists and
    objects of those fields, nested; now and then no object at all."""
    keys = st.sampled_from(FIELDS[path])
    values = st.recursive(
        SCALARS,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=5)
        ),
        max_leaves=12,
    )
    main = st.fixed_dictionaries({MAIN[path]: values})  # the field the endpoint reads most
    few = st.dictionaries(keys, values, max_size=3)
    many = st.fixed_dictionaries({}, optional={key: values for key in FIELDS[path]})
    return st.one_of(main, main, few, few, many, values)


@pytest.fixture(scope="module")
def server(synthetic_gguf: Callable[..., Path]) -> Iterator[Server]:
    """A real tokenizer and chat template (the token endpoints and chat requests use them),
    scripted replies."""
    engine = viewing(synthetic_gguf("qwen2", chat_template=QWEN25_TOOL_TEMPLATE), "syn")
    with serving(engine) as (running, _):
        yield running


@pytest.mark.parametrize("path", sorted(FIELDS))
def test_no_body_gets_a_500(path: str, server: Server) -> None:
    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=_bodies(path))
    def check(body: Any) -> None:
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code < 500, (body, r.text)
        if r.status_code >= 400:
            error = r.json()["error"]  # OpenAI's object, or Anthropic's on its paths
            message = error["message"]
            assert ("param" in error) != path.startswith("/v1/messages"), error
            assert message and "\n" not in message and "Traceback" not in message

    check()
