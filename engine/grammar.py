"""Constrained decoding: a reply held to a JSON schema (OpenAI's structured outputs), to any JSON
object (JSON mode) or to a Lark grammar around JSON values (the server's forced tool calls), by
llguidance, the grammar engine llama.cpp and vLLM use.

Each step llguidance gives the set of tokens that keep the reply a prefix of what the schema
allows (a bit per token, ~0.2 ms for a 152k vocabulary); the others' logits are set to -inf and
the sampling settings apply among the rest, so greedy takes the likeliest token that fits and a
sampled reply draws from the warped distribution over those that fit. The reply ends when the
value is complete. Whitespace between tokens is held to 16 characters at a time, so a model
cannot loop on newlines inside the format.

The vocabulary is handed to llguidance once per tokenizer (each token's bytes, control tokens
marked as llguidance expects; ~1-2 s for 150-260k tokens, so it is built on the first request
that needs it and kept). llguidance itself is imported then too (~30 ms a start would pay).
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import InvalidRequestError
from .events import SamplingParams
from .sampler import Sampler
from .tokenizer import Tokenizer, TokenType

if TYPE_CHECKING:
    import llguidance
    from llguidance._lib import JsonCompileOptions  # a type the stubs alone name

__all__ = [
    "ANY_OBJECT",
    "Constraint",
    "constraint_for",
    "embedded_json",
    "grammar_problem",
    "next_token",
    "prepare_vocabulary",
]

ANY_OBJECT = '{"type": "object"}'  # JSON mode's schema
_OPTIONS: JsonCompileOptions = {"whitespace_pattern": "[ \t\n\r]{0,16}"}
_VOCABS: weakref.WeakKeyDictionary[Tokenizer, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()
_VOCABS_LOCK = threading.Lock()
_CHECKED: OrderedDict[bytes, str | None] = OrderedDict()  # `grammar_problem`'s answers
_CHECKED_MAX = 4096
_CHECKED_LOCK = threading.Lock()


class _Vocab:
    """What llguidance's `TokenizerWrapper` reads: every token's bytes (control tokens behind a
    0xFF byte, as its llama.cpp adapter marks them), the ends of a turn and the encoder."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for t in range(tokenizer.vocab_size):
            if tokenizer.token_type(t) == TokenType.CONTROL:
                self.tokens.append(b"\xff" + tokenizer.piece_bytes(t, special=True))
                self.special_token_ids.append(t)
            else:
                self.tokens.append(tokenizer.piece_bytes(t))

    def __call__(self, text: str | bytes) -> list[int]:
        s = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return self._tokenizer.encode(s)


def _vocab(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    import llguidance

    with _VOCABS_LOCK:
        found = _VOCABS.get(tokenizer)
        if found is None:
            ends = sorted(tokenizer.eot_ids) or None
            wrapper = llguidance.TokenizerWrapper(_Vocab(tokenizer))
            found = llguidance.LLTokenizer(wrapper, n_vocab=tokenizer.vocab_size, eos_token=ends)
            _VOCABS[tokenizer] = found
        return found


def prepare_vocabulary(tokenizer: Tokenizer) -> None:
    """Build the tokenizer's llguidance vocabulary now rather than in the first constrained
    request (a server, which JSON and tool requests will come to, does it in the background
    as it starts)."""
    _vocab(tokenizer)


def embedded_json(schema: dict[str, Any]) -> str:
    """A Lark rule's body for a JSON value `schema` allows, with the whitespace bound a schema's
    reply gets (llguidance reads its options from the schema's `x-guidance`)."""
    return "%json " + json.dumps({**schema, "x-guidance": _OPTIONS}, ensure_ascii=False)


def grammar_problem(lark: str) -> str | None:
    """Why llguidance cannot use the Lark grammar `lark` (one line), or None when it can; no
    tokenizer needed, so a front end can decide before it sends a request.

    The answers are remembered by the grammar's digest (the newest `_CHECKED_MAX`, a few
    bytes each however big the grammar): a client sends the same tools with every request
    (an agent, a dozen or more), and checking them took 35-90 ms of each request's start
    for 16-40 tools."""
    key = hashlib.sha256(lark.encode("utf-8", "surrogatepass")).digest()
    with _CHECKED_LOCK:
        if key in _CHECKED:
            _CHECKED.move_to_end(key)
            return _CHECKED[key]
    problem = _problem(lark)
    with _CHECKED_LOCK:
        _CHECKED[key] = problem
        if len(_CHECKED) > _CHECKED_MAX:
            _CHECKED.popitem(last=False)
    return problem


def _problem(lark: str) -> str | None:
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        problem = llguidance.LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError, RecursionError) as exc:
        problem = str(exc) or type(exc).__name__
    return (problem.strip().splitlines() or ["unknown error"])[0][:300] if problem else None


def constraint_for(
    tokenizer: Tokenizer, schema: str | None, lark: str | None = None
) -> Constraint | None:
    """A reply's constraint to `schema` (JSON text) or else to `lark` (None: neither given); a
    schema that is not JSON, or either that llguidance cannot compile, is an
    `InvalidRequestError` saying why in one line."""
    if schema is None and lark is None:
        return None
    import llguidance

    what = "the JSON schema" if schema is not None else "the grammar"
    try:
        if schema is not None:
            parsed: Any = json.loads(schema)
            grammar = llguidance.LLMatcher.grammar_from_json_schema(parsed, defaults=_OPTIONS)
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(lark or "")
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"{what} is not valid: {exc}") from None
    except RecursionError:
        raise InvalidRequestError(f"{what} is nested too deeply") from None
    matcher = llguidance.LLMatcher(_vocab(tokenizer), grammar, log_level=0)
    if matcher.is_error():
        first = matcher.get_error().strip().splitlines()[:1] or ["unknown error"]
        raise InvalidRequestError(f"{what} cannot be used: {first[0][:300]}")
    return Constraint(matcher, tokenizer.vocab_size)


Later = Callable[[], "Constraint"]
"""Makes a constraint that starts mid-reply, compiled only when the reply gets there."""


def later_constraints(
    tokenizer: Tokenizer, params: SamplingParams
) -> tuple[tuple[int, Later] | None, list[tuple[str, Later]]]:
    """`SamplingParams.grammar_after` as (the token that starts the held part, its maker),
    None where the text is not one token of this vocabulary (the reply is then free, as
    without it); and `grammar_if_starts` as (text, the whole reply's maker) pairs."""

    def maker(lark: str) -> Later:
        def make() -> Constraint:
            shape = constraint_for(tokenizer, None, lark)
            assert shape is not None  # a grammar was given
            return shape

        return make

    after, starts = params.grammar_after, params.grammar_if_starts
    token = tokenizer.token_to_id(after[0]) if after is not None else None
    lazy = (token, maker(after[1])) if after is not None and token is not None else None
    return lazy, [(text, maker(lark)) for text, lark in starts]


class Constraint:
    """One reply's grammar state: which tokens may come next, and the choice among them."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int) -> None:
        self._matcher = matcher
        self._vocab = vocab

    @property
    def done(self) -> bool:
        """The value is complete: the reply ends here."""
        return bool(self._matcher.is_stopped())

    def allowed(self) -> np.ndarray:
        """A bool per token: whether it may come next."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self._vocab].astype(bool)

    def restrict(self, logits: np.ndarray) -> np.ndarray | None:
        """`logits` (float32) with every token that may not come next at -inf (the model's rows
        past the tokenizer's: never); None where none fits (the matcher failed: the reply ends)."""
        fits = np.zeros(len(logits), dtype=bool)
        known = self.allowed()[: len(logits)]
        fits[: len(known)] = known
        if self._matcher.is_error() or not fits.any():
            return None
        return np.where(fits, np.asarray(logits, dtype=np.float32), -np.inf)

    def consume(self, token: int) -> bool:
        """Advance past `token`; False where it does not fit (the matcher fails)."""
        return bool(self._matcher.consume_token(token))

    def fits(self, tokens: list[int]) -> int:
        """How many of `tokens` may come next in turn (the state is not advanced)."""
        return int(self._matcher.validate_tokens(tokens))

    def forced(self) -> list[int]:
        """The tokens the grammar alone decides next (a key's name), in llguidance's
        tokenization of them; the model may still choose another tokenization of the same text,
        so these are drafts to verify, not tokens to append."""
        return [int(t) for t in self._matcher.compute_ff_tokens()]

    def choose(self, logits: np.ndarray, sampler: Sampler) -> int | None:
        """The next token, drawn as `sampler` would among those that fit and recorded in its
        history; None where none fits (the matcher failed: the reply ends)."""
        masked = self.restrict(logits)
        if masked is None:
            return None
        token = sampler.sample(masked)
        return token if self.consume(token) else None


def next_token(logits: np.ndarray, sampler: Sampler, shape: Constraint | None) -> int:
    """The next token as `sampler` draws it, among those `shape` allows when there is one;
    -1 where none fits (the matcher failed: the reply ends)."""
    if shape is None:
        return sampler.sample(logits)
    chosen = shape.choose(logits, sampler)
    return -1 if chosen is None else chosen
