"""`npuchat tokenize`: the ids a session's tokenizer gives, from the kept tokenizer after the
first run."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from npuchat.app.cli import main
from npuchat.engine import tokenizer as tokenizer_mod
from npuchat.engine.gguf_reader import GGUFFile
from npuchat.engine.tokenizer import Tokenizer


def test_tokenize_prints_the_ids_and_keeps_the_tokenizer(
    syn: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with GGUFFile(syn) as g:
        fresh = Tokenizer.from_gguf(g)
    builds: list[str] = []
    for name in ("byte_level_bpe", "sentencepiece_bpe"):
        real = getattr(tokenizer_mod, name)

        def counted(*a: Any, _real: Any = real, **kw: Any) -> Any:
            builds.append("build")
            return _real(*a, **kw)

        monkeypatch.setattr(tokenizer_mod, name, counted)
    text = "hello world <|im_end|>"
    assert main(["tokenize", "--model", "syn", text]) == 0
    assert json.loads(capsys.readouterr().out) == fresh.encode(text)
    assert main(["tokenize", "--model", "syn", "--special", text]) == 0
    assert json.loads(capsys.readouterr().out) == fresh.encode(text, parse_special=True)
    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin"))
    assert main(["tokenize", "--model", "syn", "-"]) == 0
    assert json.loads(capsys.readouterr().out) == fresh.encode("from stdin")
    assert builds == ["build"]  # the first run built it, the others read it back
