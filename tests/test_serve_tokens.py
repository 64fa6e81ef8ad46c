"""`POST /tokenize` and `/detokenize`: the ids llama-server gives (its own outputs, stored in
tests/data, are the reference), a chat counted as the server charges for it, and one-line 400s."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from scripted_engine import ScriptedEngine, ScriptedReply
from serve_helpers import serving
from synthetic_vocab import QWEN25_TOOL_TEMPLATE
from tokenizer_checks import reference_cases
from viewing_engine import viewing

from npuchat.engine.concurrent_engine import ConcurrentEngine
from npuchat.engine.events import Tokenizes
from npuchat.engine.session import ChatSession


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30)


@pytest.mark.realmodel
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "gemma3-270m"])
def test_tokenize_gives_llama_server_s_ids(name: str, real_gguf: Callable[[str], Path]) -> None:
    """Every reference case, special tokens parsed and not, as llama-server's /tokenize gave
    them (add_special false); pieces put together are the text's bytes; /detokenize of the
    ids gives the text back."""
    engine = viewing(real_gguf(name), name)
    assert isinstance(engine, Tokenizes)
    cases = reference_cases(name)
    wrong: list[str] = []
    with serving(engine) as (server, _):
        for c in cases:
            plain = _post(server.url, "/tokenize", {"content": c["text"], "parse_special": False})
            special = _post(server.url, "/tokenize", {"content": c["text"]})
            pieces = _post(server.url, "/tokenize", {"content": c["text"], "with_pieces": True})
            back = _post(server.url, "/detokenize", {"tokens": plain.json()["tokens"]})
            joined = b"".join(
                p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
                for p in pieces.json()["tokens"]
            )
            if (
                plain.json()["tokens"] != c["ids"]
                or special.json()["tokens"] != c["ids_parse_special"]
                or [p["id"] for p in pieces.json()["tokens"]] != c["ids_parse_special"]
                or back.json()["content"] != c["text"]
                or (joined != c["text"].encode() and "<" not in c["text"])
            ):
                wrong.append(c["text"])
    assert wrong == []


@pytest.mark.realmodel
def test_a_split_character_s_pieces_are_bytes_and_bos_follows_each_server_s_rule(
    real_gguf: Callable[[str], Path],
) -> None:
    engine = viewing(real_gguf("gemma3-270m"), "gemma3-270m")
    bos = 2  # gemma's <bos>
    with serving(engine) as (server, _):
        llama = _post(server.url, "/tokenize", {"content": "hi"}).json()["tokens"]
        vllm = _post(server.url, "/tokenize", {"prompt": "hi"}).json()["tokens"]
        asked = _post(server.url, "/tokenize", {"content": "hi", "add_special": True}).json()
        unasked = _post(server.url, "/tokenize", {"prompt": "hi", "add_special_tokens": False})
        rare = _post(server.url, "/tokenize", {"content": "\U00020bb7", "with_pieces": True})
    assert llama[0] != bos and vllm == [bos, *llama] and asked["tokens"] == [bos, *llama]
    assert unasked.json()["tokens"] == llama
    pieces = [p["piece"] for p in rare.json()["tokens"]]
    assert len(pieces) > 1 and all(isinstance(p, list) for p in pieces)  # byte fallback
    assert bytes(b for p in pieces for b in p) == "\U00020bb7".encode()


NAME = "synthetic-tokens"


@pytest.fixture(scope="module")
def path(synthetic_gguf: Callable[..., Path]) -> Path:
    return synthetic_gguf("qwen2", seed=5, chat_template=QWEN25_TOOL_TEMPLATE)


def _engine(path: Path, cache: Path) -> ConcurrentEngine:
    session = ChatSession.open(
        path, name=NAME, cache_dir=cache, capacities=[512], prefill_chunk=16, accuracy_level=0
    )
    return ConcurrentEngine(session, max_queue=4)


def test_a_chat_counts_what_a_reply_to_it_is_charged(path: Path, tmp_path: Path) -> None:
    """The concurrent engine: /tokenize of `messages` (with a tool offered) counts the prompt
    tokens the chat completion's usage reports for the same messages."""
    engine = _engine(path, tmp_path)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": "the quick fox"},
        {"role": "user", "content": "<|im_end|> again"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    try:
        with serving(engine, context_length=512, slots=None) as (server, client):
            counted = _post(server.url, "/tokenize", {"messages": messages, "tools": tools})
            reply = client.chat.completions.create(
                model=NAME,
                messages=messages,
                tools=tools,
                max_tokens=2,
                temperature=0,  # type: ignore[arg-type]
            )
            root = _post(server.url, "/tokenize", {"model": NAME, "content": "<|im_end|>"})
    finally:
        engine.close()
    assert counted.status_code == 200 and reply.usage is not None
    assert counted.json()["count"] == reply.usage.prompt_tokens == len(counted.json()["tokens"])
    assert counted.json()["max_model_len"] == 512
    end = engine.tokenizer.token_to_id("<|im_end|>")
    assert root.json()["tokens"] == [end]  # parse_special defaults to true, as llama-server's
    # the user's "<|im_end|>" stays text in a chat: one end token per finished turn, no more
    assert counted.json()["tokens"].count(end) == 4


@pytest.mark.parametrize(
    ("path_", "body", "says"),
    [
        ("/tokenize", {}, "give the text as `content` or `prompt`"),
        ("/tokenize", {"content": "a", "prompt": "b"}, "give the text as `content` or `prompt`"),
        ("/tokenize", {"content": 5}, "content"),
        ("/tokenize", {"messages": []}, "messages"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "a"}], "with_pieces": "maybe"},
            "with_pieces",
        ),
        ("/detokenize", {"tokens": [1, 10**9]}, "token id 1000000000 is not in the vocabulary"),
        ("/detokenize", {"tokens": [-1]}, "token id -1 is not in the vocabulary"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/tokenize", {"model": "other", "content": "a"}, "other"),
    ],
)
def test_bad_token_requests_are_one_line_400s(
    path_: str, body: dict[str, Any], says: str, real_tokens_engine: str
) -> None:
    response = _post(real_tokens_engine, path_, body)
    message = response.json()["error"]["message"]
    assert response.status_code in (400, 404) and says in message and "\n" not in message


@pytest.fixture(scope="module")
def real_tokens_engine(path: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    engine = _engine(path, tmp_path_factory.mktemp("tokens"))
    try:
        with serving(engine, context_length=512, slots=None) as (server, _):
            yield server.url
    finally:
        engine.close()


def test_an_engine_that_does_not_tokenize_says_so_and_the_key_guards_both() -> None:
    with serving(ScriptedEngine([ScriptedReply(["x"])]), api_keys=("k",)) as (server, _):
        assert _post(server.url, "/tokenize", {"content": "a"}).status_code == 401
        auth = {"Authorization": "Bearer k"}
        r = httpx.post(server.url + "/tokenize", json={"content": "a"}, headers=auth)
        assert r.status_code == 501 and "does not show its tokens" in r.json()["error"]["message"]
