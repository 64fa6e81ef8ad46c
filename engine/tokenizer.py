"""Tokenizer built from GGUF metadata, reproducing llama.cpp's token ids.

The model's own GGUF carries everything a tokenizer needs (pieces, merges or scores, token types,
special ids), so no `tokenizer.json` is downloaded. `tokenizer_build` turns the vocabulary into a
`tokenizers` BPE configured the way llama.cpp behaves (the ids we feed the model are the ids
llama.cpp would feed it); `vocab_tables` holds llama.cpp's tables; `detokenizer` renders ids as
llama.cpp's pieces, streamed without splitting a character.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from .detokenizer import StreamDecoder, piece_to_bytes
from .errors import NpuchatError
from .tokenizer_build import add_special_tokens, byte_level_bpe, sentencepiece_bpe
from .tokenizer_cache import cache_file, load_or_build
from .vocab_tables import EOG_TEXTS, PRE_REGEXES, PRE_TYPES, SPECIAL_TYPES, TokenType

if TYPE_CHECKING:
    from .gguf_reader import GGUFFile

__all__ = ["StreamDecoder", "TokenType", "Tokenizer", "TokenizerError", "cache_path"]

_SURROGATE = re.compile("[\ud800-\udfff]")


def cache_path(cache_dir: Path, model_sha256: str) -> Path:
    """Where `from_gguf` keeps the tokenizer of the model with this sha256 under the cache
    folder `cache_dir`: a change to this module, which decides what is built too, gives a new
    file."""
    return cache_file(cache_dir / "tokenizers", model_sha256, Path(__file__))


class TokenizerError(NpuchatError):
    """The GGUF's tokenizer metadata is missing, malformed or of an unsupported kind."""


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
        self._piece_cache: dict[int, bytes] = {}
        # `encode_special_tokens` is the library's per-tokenizer switch for parse_special;
        # requests may encode from several threads, so flipping it and encoding is one step.
        self._encode_lock = threading.Lock()
        self._specials: frozenset[int] | None = None

    # --- construction ----------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, g: GGUFFile, cache: Path | None = None) -> Tokenizer:
        """The tokenizer of an open GGUF file; `cache`: where to keep it built (`cache_file`)."""
        try:
            return cls.from_metadata(g.metadata, cache)
        except TokenizerError as exc:
            raise TokenizerError(f"{g.path.name}: {exc}") from exc

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], cache: Path | None = None) -> Tokenizer:
        """Build from a GGUF metadata mapping (string arrays as lists, numeric as numpy).

        The metadata is read and checked each time; only the `tokenizers` object, the costly
        part, is read from `cache` when it holds one built from the same model and code."""
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
            if pre not in PRE_TYPES:
                known = ", ".join(sorted(PRE_TYPES))
                raise TokenizerError(f"pre-tokenizer {pre!r} is not supported; known: {known}")
            family, ignore_merges, default_add_bos = PRE_TYPES[pre]
            merges = metadata.get("tokenizer.ggml.merges")
            if not isinstance(merges, Sequence) or not merges:
                raise TokenizerError("a 'gpt2' vocabulary needs tokenizer.ggml.merges")
            regexes = PRE_REGEXES[family]

            def subwords() -> HFTokenizer:
                return byte_level_bpe(tokens, merges, regexes, ignore_merges)

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
            spm_scores, space = scores, add_space_prefix

            def subwords() -> HFTokenizer:
                return sentencepiece_bpe(tokens, spm_scores, space, unk)

            default_add_bos = True
            bos_default, eos_default = 1, 2

        bos_id = opt_id("tokenizer.ggml.bos_token_id", bos_default)
        eos_id = opt_id("tokenizer.ggml.eos_token_id", eos_default)
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", default_add_bos))

        eot_ids: set[int] = {i for i, t in enumerate(tokens) if t in EOG_TEXTS}
        for i in eot_ids:  # llama.cpp forces end-of-generation tokens to CONTROL
            if types[i] not in SPECIAL_TYPES:
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
            rstrip = {int(i) for i in np.flatnonzero(np.isin(types, SPECIAL_TYPES))}
            rstrip |= {i for i, t in enumerate(tokens) if t == "</s>"}
            rstrip -= {i for i, t in enumerate(tokens) if t in ("<unk>", "<s>", "<|endoftext|>")}

        def build() -> HFTokenizer:
            hf = subwords()
            add_special_tokens(hf, tokens, types, frozenset(rstrip))
            return hf

        return cls(
            model=model,
            pre=pre,
            tokens=tokens,
            types=types,
            hf=load_or_build(cache, len(set(tokens)), build),
            bos_id=bos_id,
            eos_id=eos_id,
            eot_ids=frozenset(eot_ids),
            add_bos=add_bos,
            add_space_prefix=add_space_prefix,
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
        with self._encode_lock:
            self._hf.encode_special_tokens = not parse_special
            out.extend(self._hf.encode(text, add_special_tokens=False).ids)
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

    def encode_chat(self, pieces: Sequence[tuple[str, bool]]) -> list[int]:
        """Ids of a rendered chat prompt given as (text, is_markup) pieces (`ChatTemplate.
        render_pieces`): special tokens are parsed in the markup only, so message text that
        spells `<|im_start|>` stays text.

        The whole prompt is encoded as `encode_prompt` does; only if a special token matched
        inside a message is the text between the template's own special tokens encoded again
        with special tokens as plain text. Those runs are what the tokenizer splits the text
        into around special tokens anyway, so the template's markup keeps its exact ids.
        """
        text = "".join(piece for piece, _ in pieces)
        spans: list[tuple[int, int]] = []
        at = 0
        for piece, markup in pieces:
            if not markup and piece:
                spans.append((at, at + len(piece)))
            at += len(piece)
        text = _SURROGATE.sub("\ufffd", text)  # one character for one: offsets still hold
        with self._encode_lock:
            self._hf.encode_special_tokens = False
            enc = self._hf.encode(text, add_special_tokens=False)
            ids, offsets = list(enc.ids), list(enc.offsets)
            specials = self._special_ids()
            forged = {
                i
                for i, (tid, (a, b)) in enumerate(zip(ids, offsets, strict=True))
                if tid in specials and any(a < e and s < b for s, e in spans)
            }
            if forged:
                ids = self._encode_around(text, ids, offsets, specials, forged)
        if self._add_bos and self._bos_id is not None and (not ids or ids[0] != self._bos_id):
            ids.insert(0, self._bos_id)
        return ids

    def _special_ids(self) -> frozenset[int]:
        if self._specials is None:
            decoder = self._hf.get_added_tokens_decoder()
            self._specials = frozenset(i for i, tok in decoder.items() if tok.special)
        return self._specials

    def _encode_around(
        self,
        text: str,
        ids: list[int],
        offsets: list[tuple[int, int]],
        specials: frozenset[int],
        forged: set[int],
    ) -> list[int]:
        """`text` encoded with only the special tokens not in `forged` as tokens (called with
        the encode lock held)."""
        self._hf.encode_special_tokens = True
        out: list[int] = []
        start = 0
        for i, tid in enumerate(ids):
            if tid in specials and i not in forged:
                run = text[start : offsets[i][0]]
                if run:
                    out.extend(self._hf.encode(run, add_special_tokens=False).ids)
                out.append(tid)
                start = offsets[i][1]
        if text[start:]:
            out.extend(self._hf.encode(text[start:], add_special_tokens=False).ids)
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
        if cached is None:
            cached = piece_to_bytes(self._tokens[token_id], ttype, self.model == "llama")
            self._piece_cache[token_id] = cached
        return cached

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
