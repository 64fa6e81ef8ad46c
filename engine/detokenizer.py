"""Token ids -> text the way llama.cpp's `token_to_piece` renders them, streamed.

A byte-level BPE token or a SentencePiece `<0xNN>` token may carry part of a UTF-8 character, so
a reply streamed token by token must hold those bytes back until the character is complete;
`StreamDecoder` does that. It decodes by llama.cpp's piece rules rather than through
`tokenizers`' `DecodeStream`: with a ByteLevel decoder that one agrees on SmolLM2's and
Qwen2.5's every text case, but renders UNUSED tokens (Qwen2.5's 271 `[PAD…]`) as their text
where llama.cpp renders nothing, holds a byte that can never form a character back until the
next token, and would need a decoder chain per vocabulary kind (SentencePiece: "▁", byte
fallback, the space prefix) to do what `piece_to_bytes` does in a few lines.
"""

from __future__ import annotations

from typing import Protocol

from .vocab_tables import TokenType

SPACE = "\u2581"  # SentencePiece's visible space "▁"


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


def piece_to_bytes(text: str, token_type: int, sentencepiece: bool) -> bytes:
    """The bytes of one non-control piece as llama.cpp renders it.

    User-defined tokens are their text; byte tokens their byte; unused/undefined tokens nothing;
    normal pieces undo "▁" (SentencePiece) or GPT-2's byte map (byte-level BPE).
    """
    if token_type == TokenType.USER_DEFINED:
        return text.encode("utf-8")
    if token_type == TokenType.BYTE and text.startswith("<0x") and len(text) == 6:
        return bytes([int(text[3:5], 16)])
    if token_type != TokenType.NORMAL:
        return b""
    if sentencepiece:
        return text.replace(SPACE, " ").encode("utf-8")
    return b"".join(
        bytes((_BYTE_DECODER[c],)) if c in _BYTE_DECODER else c.encode("utf-8") for c in text
    )


class PieceSource(Protocol):
    """What a stream decoder needs of a tokenizer."""

    @property
    def add_space_prefix(self) -> bool: ...

    def piece_bytes(self, token_id: int, *, special: bool = False) -> bytes: ...


class StreamDecoder:
    """Turns generated ids into text one id at a time, never emitting half a character.

    Bytes that can never complete a character come out as U+FFFD. For SentencePiece
    vocabularies the leading space of the first piece (the space prefix convention) is dropped.
    """

    def __init__(self, tokenizer: PieceSource, *, special: bool = False) -> None:
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

    def piece(self, token_id: int) -> bytes:
        """One token's own bytes, as `push` reads them."""
        return self._tok.piece_bytes(token_id, special=self._special)

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
