"""What the served model makes of text: the `Tokenizes` side of the engine.

Kept apart from the scheduler: it reads only the tokenizer and the chat template (both safe
to use from a server thread while replies run), never a KV slot, so a /tokenize request never
waits for the engine's steps.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import InvalidRequestError
from .events import ChatRequest
from .prompts import PromptBuilder


class TokenView:
    """`Tokenizes` over one model's prompt builder (its tokenizer and chat template)."""

    def __init__(self, prompts: PromptBuilder) -> None:
        self._prompts = prompts

    def tokenize(self, text: str, *, parse_special: bool, add_bos: bool) -> list[int]:
        return self._prompts.tokenizer.encode(text, parse_special=parse_special, add_bos=add_bos)

    def chat_tokens(self, request: ChatRequest) -> list[int]:
        r = request
        return self._prompts.ids(r.system_prompt, r.messages, r.tools, r.continue_reply)

    def _check(self, ids: Sequence[int]) -> None:
        n = self._prompts.tokenizer.vocab_size
        for i in ids:
            if not 0 <= i < n:
                raise InvalidRequestError(f"token id {i} is not in the vocabulary (0 to {n - 1})")

    def token_pieces(self, ids: Sequence[int]) -> list[bytes]:
        self._check(ids)
        tok = self._prompts.tokenizer
        return [tok.piece_bytes(i, special=True) for i in ids]

    def detokenize(self, ids: Sequence[int]) -> str:
        self._check(ids)
        return self._prompts.tokenizer.decode(ids, special=True)
