"""Tokenizer tests.

Real vocabularies are checked against the ids llama.cpp's llama-server produced (every case in
`tests/data/tokenizer-*.json`); byte-level pre-tokenizers against splits worked out by hand from
llama.cpp's regexes. The SentencePiece path is in `test_tokenizer_spm.py`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from synthetic_vocab import CORPUS
from tokenizer_checks import reference_cases, reference_mismatches

from npuchat.engine.gguf_reader import GGUFFile
from npuchat.engine.tokenizer import Tokenizer, TokenType

REAL_MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m")


# --------------------------------------------------------------------------- real vocabularies


@pytest.fixture(scope="module")
def real_tokenizer(real_gguf: Callable[[str], Path]) -> Callable[[str], Tokenizer]:
    built: dict[str, Tokenizer] = {}

    def get(name: str) -> Tokenizer:
        if name not in built:
            with GGUFFile(real_gguf(name)) as g:
                built[name] = Tokenizer.from_gguf(g)
        return built[name]

    return get


@pytest.mark.realmodel
@pytest.mark.parametrize("name", REAL_MODELS)
def test_matches_llama_cpp_on_every_reference_case(
    name: str, real_tokenizer: Callable[[str], Tokenizer]
) -> None:
    tok = real_tokenizer(name)
    assert len(reference_cases(name)) >= 20
    assert reference_mismatches(tok, name) == []


@pytest.mark.realmodel
@pytest.mark.parametrize("name", REAL_MODELS)
def test_decode_inverts_encode_on_reference_texts(
    name: str, real_tokenizer: Callable[[str], Tokenizer]
) -> None:
    tok = real_tokenizer(name)
    for case in reference_cases(name):
        assert tok.decode(case["ids"]) == case["text"]
        # Parsed control tokens are invisible by default and shown verbatim on request.
        assert tok.decode(case["ids_parse_special"], special=True) == case["text"]


@pytest.mark.realmodel
@pytest.mark.parametrize("name", REAL_MODELS)
def test_streaming_never_shows_half_a_character(
    name: str, real_tokenizer: Callable[[str], Tokenizer]
) -> None:
    tok = real_tokenizer(name)
    # The rare ideographs have no piece in Gemma's 262k vocabulary: byte fallback.
    text = "emoji: 😀🚀🔥 family 👨‍👩‍👧 你好，世界！日本語のテキスト Ångström ≥ 0 … 𠜎𠜱ꙮ"
    ids = tok.encode(text)
    # The test only means something if some token really carries part of a character.
    partial = [i for i in ids if not _is_complete_utf8(tok.piece_bytes(i))]
    assert partial, "expected byte-level tokens that split a character"
    stream = tok.detokenizer()
    chunks = [stream.push(i) for i in ids]
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) + stream.flush() == text


@pytest.mark.realmodel
@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.characters(codec="utf-8"), max_size=60), parse=st.booleans())
def test_byte_level_round_trip_on_any_text(
    text: str, parse: bool, real_tokenizer: Callable[[str], Tokenizer]
) -> None:
    # Qwen's vocabulary has all 256 byte tokens, so any text survives (SmolLM2's lacks a few,
    # e.g. 0xF1; llama.cpp drops such bytes too).
    tok = real_tokenizer("qwen2.5-coder-0.5b")
    token_ids = tok.encode(text, parse_special=parse)
    assert tok.decode(token_ids, special=True) == text
    stream = tok.detokenizer(special=True)
    chunks = [stream.push(i) for i in token_ids]
    assert "".join(chunks) + stream.flush() == text
    if "\ufffd" not in text:
        assert all("\ufffd" not in c for c in chunks)


@pytest.mark.realmodel
def test_special_ids_and_end_of_turn_tokens(real_tokenizer: Callable[[str], Tokenizer]) -> None:
    smol = real_tokenizer("smollm2-135m")
    assert (smol.bos_id, smol.eos_id, smol.add_bos) == (1, 2, False)
    assert smol.token_text(2) == "<|im_end|>"
    assert {0, 2} <= smol.eot_ids  # <|endoftext|>, <|im_end|>
    qwen = real_tokenizer("qwen2.5-coder-0.5b")
    assert qwen.vocab_size == 151936
    assert (qwen.bos_id, qwen.eos_id, qwen.add_bos) == (151643, 151645, False)
    im_end = qwen.token_to_id("<|im_end|>")
    assert im_end == 151645
    assert {151643, 151645} <= qwen.eot_ids
    assert qwen.token_to_id("<|im_start|>") not in qwen.eot_ids
    # <tool_call> is USER_DEFINED: llama.cpp matches it even without parse_special.
    tool_call = qwen.token_to_id("<tool_call>")
    assert tool_call is not None and qwen.token_type(tool_call) == TokenType.USER_DEFINED
    assert tool_call in qwen.encode("x<tool_call>y")
    assert qwen.encode("<|im_start|>") != [qwen.token_to_id("<|im_start|>")]
    assert qwen.encode("<|im_start|>", parse_special=True) == [qwen.token_to_id("<|im_start|>")]
    assert qwen.encode("hi", add_bos=True)[0] == qwen.bos_id


@pytest.mark.realmodel
def test_large_vocabulary_builds_fast(real_gguf: Callable[[str], Path]) -> None:
    with GGUFFile(real_gguf("qwen2.5-coder-0.5b")) as g:
        start = time.process_time()  # CPU time: other processes on a busy machine do not count
        Tokenizer.from_gguf(g)
        elapsed = time.process_time() - start
    # ~1 s on this 2-core machine; the bound catches per-token Python work creeping in.
    assert elapsed < 3.0


# ------------------------------------------------------------------ byte-level BPE, by hand


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order (written out independently)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in keep]
    table = {b: chr(b) for b in keep} | {b: chr(0x100 + k) for k, b in enumerate(others)}
    return [table[b] for b in range(256)]


def _bpe_metadata(pre: str, **extra: Any) -> dict[str, Any]:
    tokens = [*_byte_chars(), "ab", "abc", "bc", "<|end|>"]
    types = [TokenType.NORMAL] * (len(tokens) - 1) + [TokenType.CONTROL]
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array([int(t) for t in types], np.int32),
        "tokenizer.ggml.merges": ["b c"],
    }
    meta.update(extra)
    return meta


_WORDS_TEXT = "abc 2024 x's  é\n\n y"
# Splits worked out by hand from llama.cpp's regexes for each pre type (applied in sequence).
_EXPECTED_WORDS = {
    "smollm": ["abc", " ", "2", "0", "2", "4", " x", "'s", " ", " é", "\n\n", " y"],
    "qwen2": ["abc", " ", "2", "0", "2", "4", " x", "'s", " ", " é", "\n\n", " y"],
    "llama-bpe": ["abc", " ", "202", "4", " x", "'s", " ", " é", "\n\n", " y"],
    "gpt-2": ["abc", " 2024", " x", "'s", " ", " é", "\n\n", " y"],
    "default": ["abc", " ", "202", "4", " x", "'", "s", " ", " é", "\n\n", " y"],
}


@pytest.mark.parametrize("pre", sorted(_EXPECTED_WORDS))
def test_pre_tokenizer_regexes_per_pre_type(pre: str) -> None:
    tok = Tokenizer.from_metadata(_bpe_metadata(pre))
    assert tok.words(_WORDS_TEXT) == _EXPECTED_WORDS[pre]
    assert tok.decode(tok.encode(_WORDS_TEXT)) == _WORDS_TEXT


def test_llama3_family_ignores_merges_for_whole_words() -> None:
    # Only the merge "b c" exists. "abc" is a vocabulary entry that no merge builds: llama.cpp's
    # llama3 family (ignore_merges) takes the whole word, the others merge what they can.
    chars = _byte_chars()
    llama3 = Tokenizer.from_metadata(_bpe_metadata("llama-bpe"))
    assert llama3.encode("abc") == [257]
    assert llama3.add_bos  # the llama3 family adds BOS unless the metadata says otherwise
    gpt2 = Tokenizer.from_metadata(_bpe_metadata("gpt-2"))
    assert gpt2.encode("abc") == [chars.index("a"), 258]
    assert not gpt2.add_bos
    assert gpt2.encode("x<|end|>") == [chars.index("x"), *[chars.index(c) for c in "<|end|>"]]
    assert gpt2.encode("x<|end|>", parse_special=True) == [chars.index("x"), 259]
    assert gpt2.eot_ids == {259}  # <|end|> ends a turn even without an eos id in the metadata


# --------------------------------------------------------------------------- synthetic GGUFs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_synthetic_gguf_vocabularies(arch: str, synthetic_gguf: Callable[..., Path]) -> None:
    with GGUFFile(synthetic_gguf(arch)) as g:
        tok = Tokenizer.from_gguf(g)
        n_vocab = len(g.metadata["tokenizer.ggml.tokens"])
    assert tok.vocab_size == n_vocab
    for line in CORPUS.splitlines():
        token_ids = tok.encode(line)
        assert tok.decode(token_ids) == line
        if line.strip():
            assert len(token_ids) < len(line.encode())  # the merges really merge
    end = "<|end|>" if arch == "phi3" else "<|im_end|>"
    end_id = tok.token_to_id(end)
    assert end_id is not None and end_id in tok.eot_ids
    prompt = f"<|user|>\nHi{end}" if arch == "phi3" else f"<|im_start|>user\nHi{end}"
    assert tok.encode(prompt, parse_special=True).count(end_id) == 1
    assert end_id not in tok.encode(prompt)
    assert tok.add_bos == (arch == "phi3")


def _is_complete_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
