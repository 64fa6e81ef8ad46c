"""`npuchat tokenize`: the ids a session's tokenizer gives, from the kept tokenizer after the
first run."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from npuchat.app.cli import main
from npuchat.engine.gguf_reader import GGUFFile
from npuchat.engine.tokenizer import Tokenizer


def test_tokenize_prints_the_ids_and_keeps_the_tokenizer(
    syn: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tokenizer_builds: list[str],
) -> None:
    with GGUFFile(syn) as g:
        fresh = Tokenizer.from_gguf(g)
    text = "hello world <|im_end|>"
    assert main(["tokenize", "--model", "syn", text]) == 0
    assert json.loads(capsys.readouterr().out) == fresh.encode(text)
    assert main(["tokenize", "--model", "syn", "--special", text]) == 0
    assert json.loads(capsys.readouterr().out) == fresh.encode(text, parse_special=True)
    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin"))
    assert main(["tokenize", "--model", "syn", "-"]) == 0
    assert json.loads(capsys.readouterr().out) == fresh.encode("from stdin")
    assert len(tokenizer_builds) == 2  # `fresh` and the first run; the others read it back
