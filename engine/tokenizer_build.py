"""GGUF vocabulary -> a `tokenizers.Tokenizer` that gives llama.cpp's token ids.

The subword algorithm is the `tokenizers` library's BPE, and special tokens are its added tokens;
this module only configures them the way llama.cpp's `llama-vocab.cpp` behaves:

- `gpt2` vocabularies (SmolLM2, Qwen2.5): byte-level BPE over the GGUF merges, after llama.cpp's
  pre-tokenizer regexes for the `tokenizer.ggml.pre` type (applied in sequence, each match and
  each gap becoming its own word), with `ignore_merges` where llama.cpp sets it (llama3 family).
- `llama` vocabularies (SentencePiece, Phi-3): llama.cpp's `llm_tokenizer_spm` repeatedly merges
  the adjacent pair whose concatenation is the highest-scoring piece. A BPE whose merge list holds
  every (left, right) split of every piece, ranked by the piece's score, performs the same merges
  (the construction `transformers` uses for Llama). Spaces become "▁", a "▁" is prepended to each
  text fragment when `add_space_prefix` is set, and characters without a piece fall back to
  `<0xNN>` byte tokens.
- Special tokens (`add_special_tokens`) are matched in the raw text before BPE, as llama.cpp's
  `tokenizer_st_partition` does: CONTROL and UNKNOWN tokens are the library's *special* added
  tokens, matched only when `encode_special_tokens` is off (llama.cpp's `parse_special`);
  USER_DEFINED tokens are plain added tokens, always matched. The library normalizes each text
  fragment between them on its own, which gives SentencePiece its space prefix after each
  special token, as llama.cpp does. (llama.cpp matches the longest token first over the whole
  text, the library leftmost-longest; they differ only where special texts overlap, and the
  llama.cpp reference ids in the tests match.)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from .detokenizer import SPACE
from .vocab_tables import SPECIAL_TYPES, TokenType


def _vocab_dict(tokens: list[str]) -> dict[str, int]:
    """Piece -> id; a duplicated piece keeps its first id (llama.cpp refuses such vocabularies)."""
    vocab = dict(zip(tokens, range(len(tokens)), strict=True))
    if len(vocab) != len(tokens):
        vocab = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)
    return vocab


def _bpe_model(vocab: dict[str, int], merges: list[Any], **options: Any) -> dict[str, Any]:
    return {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": False,
        "vocab": vocab,
        "merges": merges,
        **options,
    }


def _spec(
    model: dict[str, Any], *, normalizer: dict[str, Any] | None, pre_tokenizer: Any
) -> dict[str, Any]:
    """A tokenizer.json document around one model: no added tokens, no post-processing."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": None,
        "decoder": None,
        "model": model,
    }


def byte_level_bpe(
    tokens: list[str], merges: Sequence[str], regexes: Sequence[str], ignore_merges: bool
) -> HFTokenizer:
    """Byte-level BPE with llama.cpp's pre-tokenizer regexes, built as tokenizer.json text.

    Going through JSON is several times faster than the Python constructors for a 150k vocab,
    and the merges go in as the GGUF's "left right" strings for the library to split. Only if
    the library refuses them (a merge naming a piece that is not in the vocabulary, or a piece
    containing a space) are they split and filtered here, the way llama.cpp reads them.
    """
    vocab = _vocab_dict(tokens)
    pre: list[dict[str, Any]] = [
        {"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False}
        for r in regexes
    ]
    pre.append(
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    )
    model = _bpe_model(vocab, list(merges), ignore_merges=ignore_merges)
    spec = _spec(model, normalizer=None, pre_tokenizer={"type": "Sequence", "pretokenizers": pre})
    try:
        return HFTokenizer.from_str(json.dumps(spec, ensure_ascii=False))
    except Exception:  # the library's error type is not exported; retry with checked merges
        pass
    pairs: list[list[str]] = []
    for m in merges:
        # llama.cpp splits at the first space after position 0 (a merge may start with " ").
        pos = m.find(" ", 1)
        if pos < 0:
            continue
        left, right = m[:pos], m[pos + 1 :]
        if left in vocab and right in vocab and left + right in vocab:
            pairs.append([left, right])
    model["merges"] = pairs
    return HFTokenizer.from_str(json.dumps(spec, ensure_ascii=False))


def sentencepiece_bpe(
    tokens: list[str], scores: np.ndarray, add_space_prefix: bool, unk_id: int | None
) -> HFTokenizer:
    """llama.cpp's SPM tokenizer as a `tokenizers` BPE.

    llm_tokenizer_spm merges, at every step, the adjacent pair whose concatenation is the
    vocabulary piece with the highest score. Listing every split (left, right) of every piece as
    a merge, ranked by that piece's score, makes the BPE pick the same pair at every step.
    Where two different pieces have exactly the same score, llama.cpp takes the leftmost pair and
    this BPE the lower id; SentencePiece models give their pieces distinct scores, so that case
    does not arise in practice (the tests compare with SentencePiece itself).
    """
    vocab = _vocab_dict(tokens)
    order = sorted(range(len(tokens)), key=lambda i: (-float(scores[i]), i))
    pairs: list[list[str]] = []
    for i in order:
        piece = tokens[i]
        if vocab.get(piece) != i:
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                pairs.append([left, right])
    normalizers: list[dict[str, Any]] = []
    if add_space_prefix:
        normalizers.append({"type": "Prepend", "prepend": SPACE})
    normalizers.append({"type": "Replace", "pattern": {"String": " "}, "content": SPACE})
    unk = tokens[unk_id] if unk_id is not None else None
    model = _bpe_model(vocab, pairs, unk_token=unk, byte_fallback=True)
    normalizer = {"type": "Sequence", "normalizers": normalizers}
    spec = _spec(model, normalizer=normalizer, pre_tokenizer=None)
    return HFTokenizer.from_str(json.dumps(spec, ensure_ascii=False))


def add_special_tokens(
    hf: HFTokenizer, tokens: list[str], types: np.ndarray, rstrip_ids: frozenset[int]
) -> None:
    """Register the vocabulary's CONTROL, UNKNOWN and USER_DEFINED tokens as added tokens.

    They keep their vocabulary ids (the library reuses the id of a text the model knows), are
    matched in the raw text (`normalized=False`), and those in `rstrip_ids` swallow the
    whitespace after them (llama.cpp's LLAMA_TOKEN_ATTR_RSTRIP).
    """
    plain: list[AddedToken] = []
    special: list[AddedToken] = []
    for i in np.flatnonzero(np.isin(types, SPECIAL_TYPES)):
        user = int(types[i]) == TokenType.USER_DEFINED
        added = AddedToken(
            tokens[i], special=not user, normalized=False, rstrip=int(i) in rstrip_ids
        )
        (plain if user else special).append(added)
    hf.add_tokens(plain)
    hf.add_special_tokens(special)
