"""A request's prompt as token ids: the chat template rendered, user text kept plain, and
the oldest turns dropped when the conversation no longer fits.

Rendering lives here, apart from the session's KV bookkeeping, because every path that runs a
chat (the session, the concurrent engine's slots, the benchmarks) asks the same questions: what
are this conversation's ids, and which of them does every conversation with this system prompt
start with (the part worth keeping in the prefix store).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import replace

from .chat_template import ChatTemplate, template_messages, template_tools
from .errors import PromptTooLongError
from .events import ChatMessage, ChatRequest, ToolSpec
from .prefix_store import common_prefix_len
from .tokenizer import Tokenizer

__all__ = ["SYSTEM_CACHE_SIZE", "PromptBuilder", "folded_system", "without_oldest_turn"]

SYSTEM_CACHE_SIZE = 32
"""System prompts whose token prefix is remembered (each a short list of ids)."""
_PROBE_A, _PROBE_B = "\x01a", "\x02b"  # two user messages that share no token


def folded_system(messages: Seq[ChatMessage]) -> list[ChatMessage]:
    """System messages inside a conversation as text of a user turn, for templates that render
    none there: each goes before the next user message, or, after the last one, at the end of
    it (Claude Code's environment note follows its question). Where the conversation has no
    user message, they stay as they are."""
    out: list[ChatMessage] = []
    waiting: list[str] = []
    for m in messages:
        if m.role == "system":
            waiting.append(m.content)
            continue
        if m.role == "user" and waiting:
            m = replace(m, content="\n\n".join([*waiting, m.content]))
            waiting = []
        out.append(m)
    users = [i for i, m in enumerate(out) if m.role == "user"]
    if waiting and users:
        last = out[users[-1]]
        out[users[-1]] = replace(last, content="\n\n".join([last.content, *waiting]))
    elif waiting:
        out += [ChatMessage("system", text) for text in waiting]
    return out


def without_oldest_turn(messages: Seq[ChatMessage]) -> list[ChatMessage] | None:
    """The conversation without its oldest turn (one user message and the replies after it),
    or None when only the last user message is left: that one always stays."""
    firsts = [i for i, m in enumerate(messages) if m.role == "user"]
    return list(messages[firsts[1] :]) if len(firsts) >= 2 else None


class PromptBuilder:
    """Prompt ids for one model's template and tokenizer (`name` is said in errors)."""

    def __init__(self, template: ChatTemplate, tokenizer: Tokenizer, name: str) -> None:
        self.template = template
        self.tokenizer = tokenizer
        self._name = name
        self._system: dict[str, list[int]] = {}

    def ids(
        self,
        system: str,
        messages: Seq[ChatMessage],
        tools: Seq[ToolSpec] = (),
        continue_reply: bool = False,
    ) -> list[int]:
        """The request's prompt ids: the template's markup with special tokens parsed, every
        message's text as plain text (so user text cannot forge a turn). `continue_reply`: the
        last (assistant) message is left open, its text after the assistant header."""
        if continue_reply and messages and messages[-1].role == "assistant":
            # the reply's own text after the assistant header: its KV is mostly still cached
            head = self.ids(system, messages[:-1], tools)
            return head + self.tokenizer.encode(messages[-1].content)
        if not self.template.keeps_late_system() and any(m.role == "system" for m in messages):
            messages = folded_system(messages)
        pieces = self.template.render_pieces(
            template_messages(system, messages), True, template_tools(tools)
        )
        return self.tokenizer.encode_chat(pieces)

    def system_prefix(self, system: str) -> list[int]:
        """Tokens every conversation with this system prompt starts with.

        Rendered twice with two unrelated user messages: whatever the template writes before the
        user's text (BOS, the system block, the user header) is the common token prefix.
        """
        if system in self._system:
            self._system[system] = self._system.pop(system)  # most recent last
        else:
            a = self.ids(system, [ChatMessage("user", _PROBE_A)])
            b = self.ids(system, [ChatMessage("user", _PROBE_B)])
            self._system[system] = a[: common_prefix_len(a, b)]
            while len(self._system) > SYSTEM_CACHE_SIZE:
                del self._system[next(iter(self._system))]
        return self._system[system]

    def check_raw(self, ids: Seq[int], cap: int) -> None:
        """Refuse a raw prompt (no turns to drop) that leaves no room for a reply token."""
        if len(ids) >= cap:
            raise PromptTooLongError(
                f"the prompt is {len(ids)} tokens and {self._name} holds {cap}; shorten it",
                len(ids),
                cap,
            )

    def fit(self, request: ChatRequest, cap: int) -> tuple[list[int], int]:
        """Prompt ids that leave room for a reply, dropping the oldest turns if needed.

        Returns (ids, dropped turn count). The reply budget is max_tokens, capped at a quarter
        of the context so that a long conversation still gets a useful reply budget. A request
        that may not drop turns (`drop_turns` false) fails only when no reply token fits.
        """
        reserve = max(1, min(request.sampling.max_tokens, cap // 4))
        messages = list(request.messages)
        dropped = 0
        forced = self.tokenizer.encode(request.reply_prefix, parse_special=True)

        def ids_of(messages: list[ChatMessage]) -> list[int]:
            system, tools, cont = request.system_prompt, request.tools, request.continue_reply
            return self.ids(system, messages, tools, cont) + forced

        ids = ids_of(messages)
        while request.drop_turns and len(ids) + reserve > cap:
            shorter = without_oldest_turn(messages)
            if shorter is None:
                break
            messages = shorter
            dropped += 1
            ids = ids_of(messages)
        if len(ids) >= cap:
            what = "message" if len(messages) == 1 or request.drop_turns else "conversation"
            raise PromptTooLongError(
                f"the {what} is too long: the prompt is {len(ids)} tokens and {self._name} "
                f"holds {cap}; shorten it or start a new conversation",
                len(ids),
                cap,
            )
        return ids, dropped
