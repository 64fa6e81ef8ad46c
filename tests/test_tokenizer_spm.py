"""SentencePiece (`llama`) vocabularies: a hand-made vocabulary whose expected ids were worked out
by hand from llama.cpp's `llm_tokenizer_spm` rule (repeatedly merge the adjacent pair that forms
the highest-scoring piece; leftmost on ties), and, where the `sentencepiece` package is
installed, SentencePiece itself on a trained BPE model.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npuchat.engine.errors import NpuchatError
from npuchat.engine.tokenizer import StreamDecoder, Tokenizer, TokenType

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
