"""The typed interface between a chat front end (TUI, `npuchat run`) and the engine.

A front end builds a `ChatRequest`, calls `ChatEngine.generate` in a worker thread and consumes
the events it yields until exactly one terminal event (`Finished`, `Cancelled` or `Failed`).
Cancellation is a `threading.Event` the front end sets from any thread; the engine checks it
between decode steps. Nothing here imports Textual, so the UI can be tested against a scripted
engine that yields the same events.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

Role = Literal["system", "user", "assistant", "tool"]
"""`tool`: the result of a tool call, sent back by a client that ran it."""
StopReason = Literal["eos", "stop_string", "max_tokens", "length"]
NoticeLevel = Literal["info", "warning", "error"]
Priority = Literal["interactive", "background"]
"""Interactive requests (a user waiting) go before background ones (titles, summaries)."""
FailureKind = Literal["error", "busy", "invalid"]
"""busy: the engine is full, try again later; invalid: the request itself is wrong."""


@dataclass(frozen=True)
class ToolCall:
    """A function call the assistant asked for; `arguments` is JSON text, as OpenAI sends it."""

    name: str
    arguments: str = "{}"
    id: str = ""


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call, handed to the chat template (`tools`).

    `parameters` is the JSON Schema of its arguments as JSON text, so the request stays a plain
    immutable value."""

    name: str
    description: str = ""
    parameters: str = "{}"


@dataclass(frozen=True)
class ChatMessage:
    """One turn. An assistant turn may carry the tool calls it made; a `tool` turn answers the
    call named by `tool_call_id`."""

    role: Role
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""


@dataclass(frozen=True)
class SamplingParams:
    """Host-side sampling. temperature == 0 means greedy (argmax)."""

    temperature: float = 0.7
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from a token seen in the window
    frequency_penalty: float = 0.0  # and this much again for every time it was seen
    logprobs: int | None = None  # each token's log probability, with this many likeliest
    json_schema: str | None = None  # the reply is JSON this schema allows (`grammar`)
    grammar: str | None = None  # or text this Lark grammar (llguidance's) allows
    grammar_after: tuple[str, str] | None = None
    """(token text, Lark grammar): free text until the reply writes that token (one token of
    the vocabulary), the rest held to the grammar; llama.cpp's lazy grammar, which holds a
    tool call the model starts under `auto` to the tools' schemas. Unused with the two above."""
    grammar_if_starts: tuple[tuple[str, str], ...] = ()
    """(text, Lark grammar) pairs: a reply whose text, whitespace left out, starts with one's
    text is held to its grammar from its first token, the tokens already written included (a
    small model's bare `{"name": ...}` call under `auto`, or one in a json code block); else
    free. Unused with the first two."""
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), OpenAI's
    seed: int | None = None
    max_tokens: int = 1024
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # run to max_tokens past end-of-turn tokens (benchmarks)


@dataclass(frozen=True)
class ChatRequest:
    """One generation: the whole conversation so far, the engine works out what it can reuse."""

    conversation_id: str
    system_prompt: str
    messages: tuple[ChatMessage, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: Priority = "interactive"
    tools: tuple[ToolSpec, ...] = ()
    """Functions the chat template should offer the model (empty: none)."""
    raw_prompt: str | None = None
    """Continue this text as is, with no chat template (special tokens in it are parsed, BOS
    added as the model wants); `system_prompt`, `messages` and `tools` are then ignored."""
    continue_reply: bool = False
    """The last message is an assistant reply cut short (by max_tokens): extend that reply
    instead of starting a new one (the prompt ends with its text, not an end-of-turn)."""
    reply_prefix: str = ""
    """Text the reply starts with, written by the front end rather than the user (special
    tokens in it are parsed): the model continues after it. `npuchat serve` forces a tool call
    this way; the prefix is not streamed back."""
    drop_turns: bool = True
    """Drop the oldest turns when the conversation does not fit (the app's conversations);
    false: fail with `Failed.too_long` instead, so an API's client decides what to cut."""


@dataclass(frozen=True)
class Metrics:
    """Figures for one reply, as measured by the engine.

    - ttft_s: request received -> first token text available (templating, tokenization,
      prefill and the first sample included).
    - prefill_tokens / prefill_tps: only tokens actually run through prefill; tokens whose KV
      was reused are counted in reused_tokens instead.
    - prefill_total: tokens this reply's prefill runs in all; an update with prefill_tokens <
      prefill_total is progress during a long prefill (0: not reported).
    - decode_tokens / decode_tps: tokens generated after the first one, over the time after it.
    - kv_used / kv_capacity: slots holding valid KV / slots in the current capacity variant;
      kv_max_capacity is the largest variant.
    - kv_dtype / kv_bytes_per_token: how the cache stores K/V ("f32", "f16", "int8") and the
      bytes one token's K/V take in every layer (int8: with its scales); kv_bytes: what the
      cache holds now (every row at the current capacity). 0 / "": not reported.
    - drafted / accepted: speculative draft tokens proposed / accepted by the target.
    """

    ttft_s: float = 0.0
    prefill_tokens: int = 0
    prefill_tps: float = 0.0
    prefill_total: int = 0
    reused_tokens: int = 0
    decode_tokens: int = 0
    decode_tps: float = 0.0
    kv_used: int = 0
    kv_capacity: int = 0
    kv_max_capacity: int = 0
    kv_dtype: str = ""
    kv_bytes_per_token: int = 0
    kv_bytes: int = 0
    drafted: int = 0
    accepted: int = 0
    mean_accepted_len: float = 0.0
    draft_k: int = 0
    draft_time_share: float = 0.0
    model: str = ""
    draft: str = ""
    device: str = ""

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def kv_bytes_used(self) -> int:
        """The K/V bytes of this reply's tokens (kv_used of them)."""
        return self.kv_used * self.kv_bytes_per_token


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log probability under the model at its step (`engine.logprobs`), with its
    bytes and text (a character split over tokens shows as U+FFFD) so that no front end needs
    the tokenizer; `top`: the likeliest tokens at that step, most likely first."""

    token: int
    text: str
    piece: bytes
    logprob: float
    top: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class TokenDelta:
    """New reply text (never half a UTF-8 character) and the ids of the tokens sampled for it.

    Text can lag its ids (a character split over tokens, a possible stop string held back), so
    `ids` may come with empty text and text with no ids. `logprobs`: one per id, when the
    request asked for them (`SamplingParams.logprobs`).
    """

    text: str
    ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class MetricsUpdate:
    metrics: Metrics


@dataclass(frozen=True)
class Notice:
    """Something the user should see that is not an error (e.g. turns dropped to fit)."""

    text: str
    level: NoticeLevel = "info"


@dataclass(frozen=True)
class Finished:
    stop_reason: StopReason
    metrics: Metrics
    stop_string: str = ""  # which of the request's stop strings ended it ("stop_string")


@dataclass(frozen=True)
class Cancelled:
    metrics: Metrics


@dataclass(frozen=True)
class Failed:
    message: str
    kind: FailureKind = "error"
    too_long: tuple[int, int] | None = None
    """Set when the prompt does not fit (kind "invalid"): its tokens and the context's."""


Event = TokenDelta | MetricsUpdate | Notice | Finished | Cancelled | Failed
TerminalEvent = Finished | Cancelled | Failed


@runtime_checkable
class ChatEngine(Protocol):
    """What a front end needs from a loaded model (and optional draft)."""

    @property
    def model_name(self) -> str: ...

    @property
    def draft_name(self) -> str: ...

    @property
    def device(self) -> str: ...

    def generate(self, request: ChatRequest, cancel: threading.Event) -> Iterator[Event]:
        """Yield events for one reply; the last one is a TerminalEvent.

        Front ends may call this from several threads at once. An engine that cannot run two
        requests together answers the one it cannot take with `Failed(kind="busy")`.
        """
        ...


@runtime_checkable
class Tokenizes(Protocol):
    """An engine that shows what text is in its model's token ids (`npuchat serve`'s
    /tokenize and /detokenize): a client counts a prompt against the context, or checks what a
    stop string or a logit bias will meet, before it asks for a reply."""

    def tokenize(self, text: str, *, parse_special: bool, add_bos: bool) -> list[int]: ...

    def chat_tokens(self, request: ChatRequest) -> list[int]:
        """The ids of a chat's prompt, its template applied, as a reply to it would start."""
        ...

    def token_pieces(self, ids: Sequence[int]) -> list[bytes]:
        """Each id's bytes, special tokens as their text (an id outside the vocabulary:
        `InvalidRequestError`)."""
        ...

    def detokenize(self, ids: Sequence[int]) -> str: ...
