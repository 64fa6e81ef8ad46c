"""Tokenizer built from GGUF metadata, reproducing llama.cpp's token ids.

The model's own GGUF carries everything a tokenizer needs (pieces, merges or scores, token types,
special ids), so no `tokenizer.json` is downloaded. The subword algorithm itself is the
`tokenizers` library's BPE; this module only configures it the way llama.cpp's `llama-vocab.cpp`
behaves, so the ids we feed the model are the ids llama.cpp would feed it:

- `gpt2` vocabularies (SmolLM2, Qwen2.5): byte-level BPE over the GGUF merges, after llama.cpp's
  pre-tokenizer regexes for the `tokenizer.ggml.pre` type (applied in sequence, each match and
  each gap becoming its own word), with `ignore_merges` where llama.cpp sets it (llama3 family).
- `llama` vocabularies (SentencePiece, Phi-3): llama.cpp's `llm_tokenizer_spm` repeatedly merges
  the adjacent pair whose concatenation is the highest-scoring piece. A BPE whose merge list holds
  every (left, right) split of every piece, ranked by the piece's score, performs the same merges
  (the construction `transformers` uses for Llama). Spaces become "▁", a "▁" is prepended to each
  text fragment when `add_space_prefix` is set, and characters without a piece fall back to
  `<0xNN>` byte tokens.
- Special tokens are matched exactly as `tokenizer_st_partition` does: CONTROL and UNKNOWN tokens
  only with `parse_special=True`, USER_DEFINED tokens always, longest token text first. That
  partition is done here (a few string searches) so that every plain-text fragment is encoded on
  its own, which is what gives SentencePiece its space prefix after each special token.

Decoding concatenates each token's piece bytes (llama.cpp's `token_to_piece`), and
`StreamDecoder` holds back an incomplete UTF-8 sequence so that a character split across tokens
is never shown half-way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from .errors import NpuchatError

if TYPE_CHECKING:
    from .gguf_reader import GGUFFile


class TokenType(IntEnum):
    """`tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


class TokenizerError(NpuchatError):
    """The GGUF's tokenizer metadata is missing, malformed or of an unsupported kind."""


# --- llama.cpp pre-tokenizer regexes (llm_tokenizer_bpe), by family ------------------------------

_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_RE = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_PRE_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "llama3": (_LLAMA3_RE,),
    "qwen2": (_QWEN2_RE,),
    "starcoder": (r"\p{N}", _GPT2_RE),
    "gpt2": (_GPT2_RE,),
}

# tokenizer.ggml.pre -> (regex family, ignore_merges, default add_bos), as llama_vocab::load maps
# them. Names outside this table are refused rather than tokenized subtly wrong.
_PRE_TYPES: dict[str, tuple[str, bool, bool]] = {
    "default": ("default", False, False),
    **{
        name: ("llama3", True, True)
        for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral")
    },
    "dbrx": ("llama3", False, False),
    "smaug-bpe": ("llama3", False, False),
    **{
        name: ("qwen2", False, False)
        for name in ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez")
    },
    **{
        name: ("starcoder", False, False)
        for name in (
            "smollm",
            "starcoder",
            "refact",
            "command-r",
            "codeshell",
            "exaone",
            "minerva-7b",
        )
    },
    **{
        name: ("gpt2", False, False)
        for name in ("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion")
    },
}

# Token texts llama.cpp treats as end-of-generation (llama_vocab::load, special_eog_ids).
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
        "</s>",
    }
)
# Texts llama.cpp auto-detects as the EOT token when the metadata names none.
_EOT_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
)

_SPACE = "\u2581"  # SentencePiece's visible space "▁"
_SURROGATE = re.compile("[\ud800-\udfff]")
# Token types llama.cpp matches in text before BPE (its cache_special_tokens).
_SPECIAL_TYPES = (int(TokenType.CONTROL), int(TokenType.USER_DEFINED), int(TokenType.UNKNOWN))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_DECODER: dict[str, int] = {c: b for b, c in _bytes_to_unicode().items()}


def _c_isspace(ch: str) -> bool:
    """C `isspace` in the "C" locale, which llama.cpp's lstrip/rstrip of special tokens uses."""
    return ch in " \t\n\v\f\r"


@dataclass(frozen=True)
class _Fragment:
    """A piece of input: either plain text to run through BPE, or one already-matched token."""

    text: str = ""
    token: int = -1


class Tokenizer:
    """Token ids <-> text for one GGUF vocabulary, matching llama.cpp.

    Build with `from_gguf` / `from_metadata`; encoding runs the `tokenizers` BPE configured for
    the vocabulary's kind, decoding concatenates llama.cpp's token pieces.
    """

    def __init__(
        self,
        *,
        model: str,
        pre: str | None,
        tokens: list[str],
        types: np.ndarray,
        hf: HFTokenizer,
        bos_id: int | None,
        eos_id: int | None,
        eot_ids: frozenset[int],
        add_bos: bool,
        add_space_prefix: bool,
        rstrip_ids: frozenset[int],
    ) -> None:
        self.model = model
        self.pre = pre
        self._tokens = tokens
        self._types = types
        self._hf = hf
        self._bos_id = bos_id
        self._eos_id = eos_id
        self._eot_ids = eot_ids
        self._add_bos = add_bos
        self._add_space_prefix = add_space_prefix
        self._rstrip_ids = rstrip_ids
        self._piece_cache: dict[int, bytes] = {}
        special = [int(i) for i in np.flatnonzero(np.isin(types, _SPECIAL_TYPES))]
        # Longest first (llama.cpp sorts its special-token cache by byte length, descending).
        special.sort(key=lambda i: -len(tokens[i].encode("utf-8")))
        self._special_all = tuple((tokens[i], i) for i in special)
        self._special_user = tuple(
            (tokens[i], i) for i in special if types[i] == TokenType.USER_DEFINED
        )

    # --- construction ----------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> Tokenizer:
        """The tokenizer of an open GGUF file."""
        try:
            return cls.from_metadata(g.metadata)
        except TokenizerError as exc:
            raise TokenizerError(f"{g.path.name}: {exc}") from exc

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build from a GGUF metadata mapping (string arrays as lists, numeric as numpy)."""
        model = str(metadata.get("tokenizer.ggml.model", ""))
        if model not in ("gpt2", "llama"):
            raise TokenizerError(
                f"tokenizer model {model or '(none)'!r} is not supported; npuchat reads "
                "'gpt2' (byte-level BPE) and 'llama' (SentencePiece) vocabularies"
            )
        tokens_raw = metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens_raw, Sequence) or not tokens_raw:
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.tokens vocabulary")
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(map(str, tokens_raw))]
        n = len(tokens)
        types = np.asarray(
            metadata.get("tokenizer.ggml.token_type", np.full(n, TokenType.NORMAL)), dtype=np.int32
        )
        if types.shape != (n,):
            raise TokenizerError(
                f"tokenizer.ggml.token_type has {types.size} entries for {n} tokens"
            )
        types = types.copy()

        def opt_id(key: str, default: int | None) -> int | None:
            value = metadata.get(key)
            if value is not None and 0 <= int(value) < n:
                return int(value)
            return default if default is not None and 0 <= default < n else None

        name = str(metadata.get("general.name", "")).lower()
        pre: str | None = None
        if model == "gpt2":
            pre = str(metadata.get("tokenizer.ggml.pre", "default")) or "default"
            if pre not in _PRE_TYPES:
                known = ", ".join(sorted(_PRE_TYPES))
                raise TokenizerError(f"pre-tokenizer {pre!r} is not supported; known: {known}")
            family, ignore_merges, default_add_bos = _PRE_TYPES[pre]
            merges = metadata.get("tokenizer.ggml.merges")
            if not isinstance(merges, Sequence) or not merges:
                raise TokenizerError("a 'gpt2' vocabulary needs tokenizer.ggml.merges")
            hf = _byte_level_bpe(tokens, merges, _PRE_REGEXES[family], ignore_merges)
            add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", False))
            bos_default = eos_default = None
        else:
            scores = metadata.get("tokenizer.ggml.scores")
            if scores is None:
                raise TokenizerError("a 'llama' (SentencePiece) vocabulary needs scores")
            scores = np.asarray(scores, dtype=np.float32)
            if scores.shape != (n,):
                raise TokenizerError(f"tokenizer.ggml.scores has {scores.size} entries for {n}")
            add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
            unk = opt_id("tokenizer.ggml.unknown_token_id", 0)
            hf = _sentencepiece_bpe(tokens, scores, add_space_prefix, unk)
            default_add_bos = True
            bos_default, eos_default = 1, 2

        bos_id = opt_id("tokenizer.ggml.bos_token_id", bos_default)
        eos_id = opt_id("tokenizer.ggml.eos_token_id", eos_default)
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", default_add_bos))

        eot_ids: set[int] = {i for i, t in enumerate(tokens) if t in _EOG_TEXTS}
        for i in eot_ids:  # llama.cpp forces end-of-generation tokens to CONTROL
            if types[i] not in (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN):
                types[i] = TokenType.CONTROL
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            extra = opt_id(key, None)
            if extra is not None:
                eot_ids.add(extra)
        if eos_id is not None:
            eot_ids.add(eos_id)

        rstrip: set[int] = set()
        if "phi-3" in name or "phi3" in name:
            # llama.cpp strips whitespace after Phi-3's special tokens (LLAMA_TOKEN_ATTR_RSTRIP).
            rstrip = {int(i) for i in np.flatnonzero(np.isin(types, _SPECIAL_TYPES))}
            rstrip |= {i for i, t in enumerate(tokens) if t == "</s>"}
            rstrip -= {i for i, t in enumerate(tokens) if t in ("<unk>", "<s>", "<|endoftext|>")}

        return cls(
            model=model,
            pre=pre,
            tokens=tokens,
            types=types,
            hf=hf,
            bos_id=bos_id,
            eos_id=eos_id,
            eot_ids=frozenset(eot_ids),
            add_bos=add_bos,
            add_space_prefix=add_space_prefix,
            rstrip_ids=frozenset(rstrip),
        )

    # --- properties ------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def eot_ids(self) -> frozenset[int]:
        """Ids that end the assistant's turn: EOS, EOT/EOM from metadata, `<|im_end|>`-like."""
        return self._eot_ids

    @property
    def add_bos(self) -> bool:
        """Whether the model expects a BOS token in front of a prompt (llama.cpp's add_bos)."""
        return self._add_bos

    @property
    def add_space_prefix(self) -> bool:
        return self._add_space_prefix

    def token_type(self, token_id: int) -> TokenType:
        return TokenType(int(self._types[token_id]))

    def token_text(self, token_id: int) -> str:
        """The piece as the vocabulary stores it (e.g. "Ġworld", "▁world", "<0x0A>")."""
        return self._tokens[token_id]

    def token_to_id(self, text: str) -> int | None:
        """The id of a vocabulary entry given its stored text, if there is one."""
        return self._hf.token_to_id(text)

    def is_special(self, token_id: int) -> bool:
        """CONTROL / UNKNOWN tokens: invisible in decoded text unless asked for."""
        return int(self._types[token_id]) in (TokenType.CONTROL, TokenType.UNKNOWN)

    # --- encoding --------------------------------------------------------------------------

    def encode(self, text: str, *, parse_special: bool = False, add_bos: bool = False) -> list[int]:
        """Token ids of `text`, as llama.cpp's `llama_tokenize` gives them.

        `parse_special` lets control tokens written in the text (`<|im_start|>`) become their
        ids, as a rendered chat template needs; user text must not get them. `add_bos` puts
        the BOS id in front (pass `tokenizer.add_bos` to follow the model's convention).
        """
        out: list[int] = []
        if add_bos and self._bos_id is not None:
            out.append(self._bos_id)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            # Lone surrogates (e.g. undecodable bytes read with surrogateescape) are no text.
            text = _SURROGATE.sub("\ufffd", text)
        for frag in self._partition(text, parse_special):
            if frag.token >= 0:
                out.append(frag.token)
            else:
                out.extend(self._hf.encode(frag.text, add_special_tokens=False).ids)
        return out

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of a rendered chat prompt: special tokens parsed, BOS added if the model wants one.

        Chat templates that write `{{ bos_token }}` already yield the BOS id; no second one is
        added then (llama.cpp would warn about a double BOS).
        """
        out = self.encode(text, parse_special=True)
        if self._add_bos and self._bos_id is not None and (not out or out[0] != self._bos_id):
            out.insert(0, self._bos_id)
        return out

    def words(self, text: str) -> list[str]:
        """The pieces plain text is split into before BPE (the pre-tokenizer; a debugging aid).

        Byte-level vocabularies split with llama.cpp's regexes for their pre type;
        SentencePiece vocabularies do not split, so the whole text comes back.
        """
        pre = self._hf.pre_tokenizer
        if pre is None:
            return [text] if text else []
        return [text[a:b] for _, (a, b) in pre.pre_tokenize_str(text)]

    def _partition(self, text: str, parse_special: bool) -> list[_Fragment]:
        """Split text around special tokens the way llama.cpp's tokenizer_st_partition does."""
        frags = [_Fragment(text=text)] if text else []
        specials = self._special_all if parse_special else self._special_user
        for sp_text, sp_id in specials:
            if not any(f.token < 0 and sp_text in f.text for f in frags):
                continue
            rstrip = sp_id in self._rstrip_ids
            new: list[_Fragment] = []
            for f in frags:
                if f.token >= 0 or sp_text not in f.text:
                    new.append(f)
                    continue
                rest = f.text
                while True:
                    at = rest.find(sp_text)
                    if at < 0:
                        if rest:
                            new.append(_Fragment(text=rest))
                        break
                    if at > 0:
                        new.append(_Fragment(text=rest[:at]))
                    new.append(_Fragment(token=sp_id))
                    rest = rest[at + len(sp_text) :]
                    if rstrip:
                        k = 0
                        while k < len(rest) and _c_isspace(rest[k]):
                            k += 1
                        rest = rest[k:]
            frags = new
        return frags

    # --- decoding --------------------------------------------------------------------------

    def piece_bytes(self, token_id: int, *, special: bool = False) -> bytes:
        """The bytes llama.cpp's `token_to_piece` gives for one token.

        CONTROL and UNKNOWN tokens give b"" unless `special`; byte tokens give their byte;
        a byte-level piece may be part of a multi-byte character.
        """
        ttype = int(self._types[token_id])
        if ttype in (TokenType.CONTROL, TokenType.UNKNOWN):
            return self._tokens[token_id].encode("utf-8") if special else b""
        cached = self._piece_cache.get(token_id)
        if cached is not None:
            return cached
        text = self._tokens[token_id]
        if ttype == TokenType.USER_DEFINED:
            piece = text.encode("utf-8")
        elif ttype == TokenType.BYTE and text.startswith("<0x") and len(text) == 6:
            piece = bytes([int(text[3:5], 16)])
        elif ttype != TokenType.NORMAL:
            piece = b""  # unused / undefined: llama.cpp renders nothing
        elif self.model == "llama":
            piece = text.replace(_SPACE, " ").encode("utf-8")
        else:
            piece = b"".join(
                bytes((_BYTE_DECODER[c],)) if c in _BYTE_DECODER else c.encode("utf-8")
                for c in text
            )
        self._piece_cache[token_id] = piece
        return piece

    def id_to_piece(self, token_id: int, *, special: bool = True) -> str:
        """One token's text (special tokens shown by default; bytes of a split char as U+FFFD)."""
        return self.piece_bytes(token_id, special=special).decode("utf-8", errors="replace")

    def decode(self, ids: Iterable[int], *, special: bool = False) -> str:
        """Text of a token sequence; special tokens are dropped unless `special`.

        For SentencePiece vocabularies the space that `add_space_prefix` put in front of the
        text is removed again from the first token that produces text, so that
        `decode(encode(x)) == x`.
        """
        d = StreamDecoder(self, special=special)
        return "".join([d.push(i) for i in ids]) + d.flush()

    def detokenizer(self, *, special: bool = False) -> StreamDecoder:
        """A fresh streaming decoder for one generated reply."""
        return StreamDecoder(self, special=special)


class StreamDecoder:
    """Turns generated ids into text one id at a time, never emitting half a character.

    Byte-level BPE tokens and SentencePiece `<0xNN>` tokens can carry part of a UTF-8 sequence;
    those bytes wait here until the character is complete. Bytes that can never complete a
    character come out as U+FFFD. For SentencePiece vocabularies the leading "▁" of the first
    piece (the space prefix convention) is dropped.
    """

    def __init__(self, tokenizer: Tokenizer, *, special: bool = False) -> None:
        self._tok = tokenizer
        self._special = special
        self._pending = b""
        self._strip_space = tokenizer.add_space_prefix

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now complete ("" while a char is split)."""
        piece = self._tok.piece_bytes(token_id, special=self._special)
        if not piece:
            return ""
        if self._strip_space:
            self._strip_space = False
            if piece.startswith(b" "):
                piece = piece[1:]
        buf = self._pending + piece
        cut = _complete_prefix_len(buf)
        self._pending = buf[cut:]
        return buf[:cut].decode("utf-8", errors="replace")

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character becomes U+FFFD)."""
        out = self._pending.decode("utf-8", errors="replace")
        self._pending = b""
        return out

    @property
    def pending(self) -> bool:
        """Whether bytes of an unfinished character are held back."""
        return bool(self._pending)


def _complete_prefix_len(buf: bytes) -> int:
    """Length of `buf` without a trailing, still-completable UTF-8 sequence."""
    n = len(buf)
    # The last lead byte within the final 3 bytes decides whether the tail is unfinished.
    for back in range(1, min(3, n) + 1):
        b = buf[n - back]
        if b & 0xC0 == 0x80:  # continuation byte: keep looking for the lead byte
            continue
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        return n - back if need > back else n
    return n


# --- tokenizers-library models ------------------------------------------------------------------


def _vocab_dict(tokens: list[str]) -> dict[str, int]:
    """Piece -> id; a duplicated piece keeps its first id (llama.cpp refuses such vocabularies)."""
    vocab = dict(zip(tokens, range(len(tokens)), strict=True))
    if len(vocab) != len(tokens):
        vocab = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)
    return vocab


def _byte_level_bpe(
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
    model: dict[str, Any] = {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": ignore_merges,
        "vocab": vocab,
        "merges": list(merges),
    }
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


def _sentencepiece_bpe(
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
        normalizers.append({"type": "Prepend", "prepend": _SPACE})
    normalizers.append({"type": "Replace", "pattern": {"String": " "}, "content": _SPACE})
    model = {
        "type": "BPE",
        "dropout": None,
        "unk_token": tokens[unk_id] if unk_id is not None else None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": True,
        "ignore_merges": False,
        "vocab": vocab,
        "merges": pairs,
    }
    normalizer = {"type": "Sequence", "normalizers": normalizers}
    spec = _spec(model, normalizer=normalizer, pre_tokenizer=None)
    return HFTokenizer.from_str(json.dumps(spec, ensure_ascii=False))
