"""Tokenizer checks shared by the tests: llama-server's ids for the real models (tests/data),
and a fixture that counts the costly subword builds (what the kept tokenizer saves)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from real_models import REFERENCE_DIR

from npuchat.engine import tokenizer as tokenizer_mod
from npuchat.engine.tokenizer import Tokenizer

__all__ = ["reference_cases", "reference_mismatches", "tokenizer_builds"]


def reference_cases(name: str) -> list[dict[str, Any]]:
    """The model's stored cases: text, its ids, and its ids with special tokens parsed."""
    return list(json.loads((REFERENCE_DIR / f"tokenizer-{name}.json").read_text())["cases"])


def reference_mismatches(tok: Tokenizer, name: str) -> list[str]:
    """The texts of the model's cases whose ids `tok` does not give, parsed or not."""
    return [
        c["text"]
        for c in reference_cases(name)
        if tok.encode(c["text"]) != c["ids"]
        or tok.encode(c["text"], parse_special=True) != c["ids_parse_special"]
    ]


@pytest.fixture
def tokenizer_builds(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The subword builds made while the test runs, by builder name."""
    seen: list[str] = []
    for name in ("byte_level_bpe", "sentencepiece_bpe"):
        real = getattr(tokenizer_mod, name)

        def counted(*a: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            seen.append(_name)
            return _real(*a, **kw)

        monkeypatch.setattr(tokenizer_mod, name, counted)
    yield seen
