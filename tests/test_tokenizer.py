"""Tokenizer tests.

Real vocabularies are checked against the ids llama.cpp's llama-server produced (every case in
`tests/data/tokenizer-*.json`). The SentencePiece path is checked on a hand-made vocabulary
whose expected ids were worked out by hand from llama.cpp's `llm_tokenizer_spm` rule (repeatedly
merge the adjacent pair that forms the highest-scoring piece; leftmost on ties), and, where the
`sentencepiece` package is installed, against SentencePiece itself on a trained BPE model.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from real_models import REFERENCE_DIR
from synthetic import CORPUS

from npuchat.engine.errors import NpuchatError
from npuchat.engine.gguf_reader import GGUFFile
from npuchat.engine.tokenizer import StreamDecoder, Tokenizer, TokenType

REAL_MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")


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


def _reference_cases(name: str) -> list[dict[str, Any]]:
    return json.loads((REFERENCE_DIR / f"tokenizer-{name}.json").read_text())["cases"]


@pytest.mark.realmodel
@pytest.mark.parametrize("name", REAL_MODELS)
def test_matches_llama_cpp_on_every_reference_case(
    name: str, real_tokenizer: Callable[[str], Tokenizer]
) -> None:
    tok = real_tokenizer(name)
    cases = _reference_cases(name)
    assert len(cases) >= 20
    wrong = [
        c["text"]
        for c in cases
        if tok.encode(c["text"]) != c["ids"]
        or tok.encode(c["text"], parse_special=True) != c["ids_parse_special"]
    ]
    assert wrong == []


@pytest.mark.realmodel
@pytest.mark.parametrize("name", REAL_MODELS)
def test_decode_inverts_encode_on_reference_texts(
    name: str, real_tokenizer: Callable[[str], Tokenizer]
) -> None:
    tok = real_tokenizer(name)
    for case in _reference_cases(name):
        assert tok.decode(case["ids"]) == case["text"]
        # Parsed control tokens are invisible by default and shown verbatim on request.
        assert tok.decode(case["ids_parse_special"], special=True) == case["text"]


@pytest.mark.realmodel
@pytest.mark.parametrize("name", REAL_MODELS)
def test_streaming_never_shows_half_a_character(
    name: str, real_tokenizer: Callable[[str], Tokenizer]
) -> None:
    tok = real_tokenizer(name)
    text = "emoji: 😀🚀🔥 family 👨‍👩‍👧 你好，世界！日本語のテキスト Ångström ≥ 0 …"
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


# --------------------------------------------------------------------------- SentencePiece, by hand

_BYTE0 = 3  # id of <0x00>
_HAND_PIECES: list[tuple[str, float, TokenType]] = [
    ("<unk>", 0.0, TokenType.UNKNOWN),
    ("<s>", 0.0, TokenType.CONTROL),
    ("</s>", 0.0, TokenType.CONTROL),
    *[(f"<0x{b:02X}>", 0.0, TokenType.BYTE) for b in range(256)],
    ("▁", -100.0, TokenType.NORMAL),
    ("h", -101.0, TokenType.NORMAL),
    ("e", -102.0, TokenType.NORMAL),
    ("l", -103.0, TokenType.NORMAL),
    ("o", -104.0, TokenType.NORMAL),
    ("w", -105.0, TokenType.NORMAL),
    ("r", -106.0, TokenType.NORMAL),
    ("d", -107.0, TokenType.NORMAL),
    ("ll", -1.0, TokenType.NORMAL),
    ("he", -2.0, TokenType.NORMAL),
    ("▁he", -3.0, TokenType.NORMAL),
    ("hell", -3.5, TokenType.NORMAL),
    ("llo", -4.0, TokenType.NORMAL),
    ("▁hello", -5.0, TokenType.NORMAL),
    ("▁w", -6.0, TokenType.NORMAL),
    ("or", -7.0, TokenType.NORMAL),
    ("▁wor", -8.0, TokenType.NORMAL),
    ("ld", -9.0, TokenType.NORMAL),
    ("▁world", -10.0, TokenType.NORMAL),
    ("<|user|>", 0.0, TokenType.CONTROL),
    ("<|tool|>", 0.0, TokenType.USER_DEFINED),
]
_HAND_IDS = {p: i for i, (p, _, _) in enumerate(_HAND_PIECES)}


def _hand_metadata(**extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "general.name": "hand-made spm",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [p for p, _, _ in _HAND_PIECES],
        "tokenizer.ggml.scores": np.array([s for _, s, _ in _HAND_PIECES], dtype=np.float32),
        "tokenizer.ggml.token_type": np.array([int(t) for _, _, t in _HAND_PIECES], np.int32),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    meta.update(extra)
    return meta


def ids(*pieces: str) -> list[int]:
    return [_HAND_IDS[p] for p in pieces]


def byte(b: int) -> int:
    return _BYTE0 + b


@pytest.fixture(scope="module")
def hand() -> Tokenizer:
    return Tokenizer.from_metadata(_hand_metadata())


def test_spm_merges_highest_score_pair_first(hand: Tokenizer) -> None:
    # ▁ h e l l o ▁ w o r l d: ll(-1), he(-2), ▁he(-3), llo(-4), ▁hello(-5), ▁w, or, ▁wor, ld,
    # ▁world, in that order.
    assert hand.encode("hello world") == ids("▁hello", "▁world")
    # ▁ h e l l: after ll and he, "▁he" (-3) beats "hell" (-3.5), and "▁hell" is no piece;
    # a longest-match tokenizer would say ▁ + hell instead.
    assert hand.encode("hell") == ids("▁he", "ll")
    # Two spaces: the first "▁" has no partner, the second joins "w".
    assert hand.encode("hello  world") == ids("▁hello", "▁", "▁world")


def test_spm_space_prefix_and_byte_fallback(hand: Tokenizer) -> None:
    assert hand.add_space_prefix and hand.add_bos
    assert hand.encode("hé") == [*ids("▁", "h"), byte(0xC3), byte(0xA9)]
    assert hand.encode("hello", add_bos=True) == [1, *ids("▁hello")]
    assert hand.encode("") == []
    no_prefix = Tokenizer.from_metadata(
        _hand_metadata(**{"tokenizer.ggml.add_space_prefix": False})
    )
    # w o r l d: or(-7), then ld(-9); "wor" and "orld" are no pieces.
    assert no_prefix.encode("world") == ids("w", "or", "ld")


def test_spm_special_tokens(hand: Tokenizer) -> None:
    # Parsed: the text after a special token gets its own space prefix, as in llama.cpp.
    assert hand.encode("<|user|>hello", parse_special=True) == ids("<|user|>", "▁hello")
    # Not parsed: "<|user|>" is plain text; "<", "|", "u", "s", ">" have no piece.
    assert hand.encode("<|user|>hello") == [
        *ids("▁"),
        byte(ord("<")),
        byte(ord("|")),
        byte(ord("u")),
        byte(ord("s")),
        *ids("e", "r"),
        byte(ord("|")),
        byte(ord(">")),
        *ids("hell", "o"),  # h e l l o: ll, he, then hell (-3.5) before llo (-4)
    ]
    # USER_DEFINED tokens are matched whether or not special tokens are parsed.
    for parse in (False, True):
        assert hand.encode("he<|tool|>he", parse_special=parse) == ids("▁he", "<|tool|>", "▁he")
    # Whitespace after a special token stays text, except for Phi-3 (llama.cpp's rstrip rule).
    assert hand.encode("<|user|>\nhello", parse_special=True) == [
        *ids("<|user|>", "▁"),
        byte(0x0A),
        *ids("hell", "o"),
    ]
    phi3 = Tokenizer.from_metadata(_hand_metadata(**{"general.name": "Phi3 Mini 4k"}))
    assert phi3.encode("<|user|>\nhello", parse_special=True) == ids("<|user|>", "▁hello")


def test_spm_decode(hand: Tokenizer) -> None:
    assert hand.decode(ids("▁hello", "▁world")) == "hello world"
    assert hand.decode([1, *ids("▁hello")]) == "hello"
    assert hand.decode([1, *ids("▁hello")], special=True) == "<s> hello"
    assert hand.decode([byte(0xC3), byte(0xA9)]) == "é"
    stream = hand.detokenizer()
    assert stream.push(byte(0xC3)) == ""
    assert stream.pending
    assert stream.push(byte(0xA9)) == "é"
    assert hand.id_to_piece(_HAND_IDS["▁world"]) == " world"
    assert hand.eot_ids == {2}


# "▁" is SentencePiece's space and decodes as " "; U+FFFD would look like a decoding failure.
_NO_METASPACE = st.characters(codec="utf-8", exclude_characters="\u2581\ufffd")


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=_NO_METASPACE, max_size=40))
def test_spm_round_trip_and_streaming_on_any_text(text: str) -> None:
    tok = Tokenizer.from_metadata(_hand_metadata())
    token_ids = tok.encode(text)
    assert tok.decode(token_ids) == text
    stream = tok.detokenizer()
    chunks = [stream.push(i) for i in token_ids]
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) + stream.flush() == text


def test_lone_surrogates_are_replaced_not_fatal(hand: Tokenizer) -> None:
    assert hand.encode("h\ud800h") == hand.encode("h\ufffdh")
    assert hand.decode(hand.encode("h\udcffh")) == "h\ufffdh"


def test_stream_decoder_does_not_hold_invalid_bytes(hand: Tokenizer) -> None:
    stream = StreamDecoder(hand)
    assert stream.push(byte(0xE2)) == ""  # could start a 3-byte character
    assert stream.push(_HAND_IDS["h"]) == "\ufffdh"  # it cannot any more
    assert stream.push(byte(0xFF)) == "\ufffd"  # never valid in UTF-8
    assert stream.push(byte(0xF0)) == ""
    assert stream.flush() == "\ufffd"


def test_spm_matches_sentencepiece_bpe() -> None:
    """Independent reference: SentencePiece's own BPE encoder on a model trained here."""
    spm = pytest.importorskip("sentencepiece")
    import io
    import random

    rng = random.Random(0)
    words = [
        *("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world"),
        *("tokenizer", "merges", "score", "piece", "byte", "fallback", "café", "naïve"),
        *("東京", "привет"),
    ]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(3000)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buf,
        model_type="bpe",
        vocab_size=420,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        character_coverage=1.0,
        minloglevel=2,
        num_threads=1,
    )
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    n = sp.get_piece_size()
    types = [
        TokenType.UNKNOWN
        if sp.is_unknown(i)
        else TokenType.CONTROL
        if sp.is_control(i)
        else TokenType.BYTE
        if sp.is_byte(i)
        else TokenType.NORMAL
        for i in range(n)
    ]
    tok = Tokenizer.from_metadata(
        {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
            "tokenizer.ggml.scores": np.array([sp.get_score(i) for i in range(n)], np.float32),
            "tokenizer.ggml.token_type": np.array([int(t) for t in types], np.int32),
        }
    )
    texts = [*lines[:100], "", " ", "  lazy  dog ", "héllo wörld ✓ 🙂", "a\nb\tc", "東京東京 xy"]
    texts += [
        "".join(rng.choice([*words, " ", "  ", "\n", "é", "🙂", "x"]) for _ in range(8))
        for _ in range(200)
    ]
    assert [t for t in texts if tok.encode(t) != sp.encode(t)] == []


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


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokenizer.ggml.model": "bert"}, "'bert' is not supported"),
        ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "nonsense"}, "'nonsense'"),
        ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2"}, "merges"),
        ({"tokenizer.ggml.tokens": []}, "no tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.scores": None}, "scores"),
        ({"tokenizer.ggml.token_type": np.ones(3, np.int32)}, "token_type"),
    ],
)
def test_bad_metadata_is_a_clear_error(change: dict[str, Any], message: str) -> None:
    meta = _hand_metadata()
    meta.update(change)
    if meta["tokenizer.ggml.scores"] is None:
        del meta["tokenizer.ggml.scores"]
    with pytest.raises(NpuchatError, match=message) as info:
        Tokenizer.from_metadata(meta)
    assert "\n" not in str(info.value)


def _is_complete_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
