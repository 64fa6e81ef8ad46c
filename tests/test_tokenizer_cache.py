"""The built tokenizer kept on disk (`engine.tokenizer_cache`): a start that reads it gives
llama.cpp's ids as a build does, and a damaged file is never used."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from synthetic_vocab import CORPUS
from tokenizer_checks import reference_mismatches

from npuchat.engine import tokenizer_cache
from npuchat.engine.gguf_reader import GGUFFile
from npuchat.engine.tokenizer import Tokenizer, cache_path

SHA = "ab" * 32


def _open(gguf: Path, kept: Path | None) -> Tokenizer:
    with GGUFFile(gguf) as g:
        return Tokenizer.from_gguf(g, kept)


@pytest.mark.realmodel
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "gemma3-270m"])
def test_a_kept_tokenizer_gives_llama_cpp_s_ids(
    name: str, real_gguf: Callable[[str], Path], tmp_path: Path, tokenizer_builds: list[str]
) -> None:
    """Byte-level BPE and SentencePiece: the second start builds nothing, and its tokenizer
    gives every reference case's ids, special tokens parsed and not (the added tokens and
    their flags survive the file)."""
    kept = cache_path(tmp_path, SHA)
    _open(real_gguf(name), kept)
    assert len(tokenizer_builds) == 1 and kept.is_file()
    tok = _open(real_gguf(name), kept)
    assert len(tokenizer_builds) == 1
    assert reference_mismatches(tok, name) == []


def _damage(kept: Path, how: str) -> None:
    raw = kept.read_bytes()
    head, _, body = raw.partition(b"\n")
    if how == "two ids swapped":  # still a valid tokenizer, giving wrong ids
        spec = json.loads(body)
        vocab = spec["model"]["vocab"]
        vocab["a"], vocab["e"] = vocab["e"], vocab["a"]
        kept.write_bytes(head + b"\n" + json.dumps(spec, ensure_ascii=False).encode())
    elif how == "truncated":
        kept.write_bytes(raw[: len(raw) // 2])
    elif how == "no header":
        kept.write_bytes(body)
    elif how == "a smaller vocabulary, digest right":
        spec = json.loads(body)
        vocab = spec["model"]["vocab"]
        last = max(vocab, key=vocab.get)
        del vocab[last]
        spec["model"]["merges"] = [m for m in spec["model"]["merges"] if "".join(m) != last]
        other = json.dumps(spec).encode()
        digest = hashlib.sha256(other).hexdigest().encode()
        kept.write_bytes(tokenizer_cache.HEADER + digest + b"\n" + other)
    elif how == "empty":
        kept.write_bytes(b"")


@pytest.mark.parametrize(
    "how",
    ["two ids swapped", "truncated", "no header", "a smaller vocabulary, digest right", "empty"],
)
@pytest.mark.parametrize("arch", ["qwen2", "phi3"])
def test_a_damaged_file_is_built_again_and_replaced(
    arch: str,
    how: str,
    synthetic_gguf: Callable[..., Path],
    tmp_path: Path,
    tokenizer_builds: list[str],
) -> None:
    gguf = synthetic_gguf(arch)
    fresh = _open(gguf, None)
    kept = cache_path(tmp_path, SHA)
    _open(gguf, kept)
    _damage(kept, how)
    tok = _open(gguf, kept)
    assert len(tokenizer_builds) == 3  # fresh, the first keep, and the damaged file's rebuild
    special = "<|end|>" if arch == "phi3" else "<|im_end|>"
    for line in [*CORPUS.splitlines(), f"a{special}b"]:
        assert tok.encode(line) == fresh.encode(line)
        assert tok.encode(line, parse_special=True) == fresh.encode(line, parse_special=True)
    _open(gguf, kept)
    assert len(tokenizer_builds) == 3  # the rewritten file is read as it is


def test_new_code_gives_a_new_file_and_the_old_one_goes(
    synthetic_gguf: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = synthetic_gguf("qwen2")
    old = cache_path(tmp_path, SHA)
    _open(gguf, old)
    other_model = cache_path(tmp_path, "cd" * 32)
    _open(gguf, other_model)
    changed = tmp_path / "changed_module.py"
    changed.write_text("# a change to the code that builds tokenizers\n")
    module = SimpleNamespace(__file__=str(changed))
    monkeypatch.setattr(tokenizer_cache, "_SOURCES", (*tokenizer_cache._SOURCES, module))
    new = cache_path(tmp_path, SHA)
    assert new != old
    _open(gguf, new)
    assert new.is_file() and not old.exists() and other_model.is_file()


def test_a_cache_that_cannot_be_written_only_costs_the_build(
    synthetic_gguf: Callable[..., Path], tmp_path: Path, tokenizer_builds: list[str]
) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    tok = _open(synthetic_gguf("llama"), cache_path(blocker, SHA))
    assert tok.decode(tok.encode("hello world")) == "hello world" and len(tokenizer_builds) == 1
