"""Chat prompts rendered with the model's own template.

A GGUF carries the Jinja template its authors wrote (`tokenizer.chat_template`); rendering that
template, rather than a format guessed per family, is what makes the prompt the model was trained
on. It runs the way Hugging Face's `apply_chat_template` runs it (trim_blocks, lstrip_blocks,
`raise_exception`, `tojson`, `strftime_now`, loop controls, `{% generation %}`), inside jinja2's
immutable sandbox so a template from a downloaded file cannot reach Python internals or mutate
our data.

A template that is missing, does not parse or fails to render falls back to the known format of
the architecture (ChatML, or Phi-3's `<|user|>` … `<|end|>`) and says so in `warning`, which the
caller shows: the chat still works, and the user knows the prompt format is a guess.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.nodes

from .template_limits import LimitedSandbox, TemplateLimitError, guard_filters, render_limited

if TYPE_CHECKING:
    from .events import ChatMessage, ToolSpec
    from .gguf_reader import GGUFFile

Message = Mapping[str, Any]

MAX_SOURCE_CHARS = 1 << 20
_PROBE_USER = "npuchat-probe-user-4b1d"
_PROBE_REPLY = "npuchat-probe-reply-9e2c"
_PROBE_SYSTEM = "npuchat-probe-system-7a3f"
# A tag-like special token right after the assistant's text: <|im_end|>, <|end|>, </s>, ...
_END_MARKER = re.compile(r"\s*(<[^\s<>]{1,40}>)")


class TemplateError(Exception):
    """Raised by a template's own `raise_exception(...)` call."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Hugging Face's tojson: plain json.dumps, not jinja2's HTML-escaping one.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which HF templates use to mark the assistant's
    tokens for training masks; for rendering it is a plain pass-through block."""

    tags = {"generation"}  # noqa: RUF012  (jinja2's Extension API declares it this way)

    def parse(self, parser: Any) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment() -> LimitedSandbox:
    env = LimitedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    guard_filters(env)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _chatml(messages: Sequence[Message], add_generation_prompt: bool) -> str:
    parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def _phi3(messages: Sequence[Message], add_generation_prompt: bool) -> str:
    parts = [f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


def _gemma(messages: Sequence[Message], add_generation_prompt: bool) -> str:
    """Gemma's turns: no system role (its text opens the first user turn), assistant = model."""
    prefix = ""
    parts = []
    for m in messages:
        if m["role"] == "system":
            prefix += m["content"] + "\n\n"
            continue
        role = "model" if m["role"] == "assistant" else m["role"]
        parts.append(f"<start_of_turn>{role}\n{prefix}{m['content'].strip()}<end_of_turn>\n")
        prefix = ""
    if add_generation_prompt:
        parts.append("<start_of_turn>model\n")
    return "".join(parts)


# Known formats per architecture: (name, renderer, assistant end marker).
_FALLBACKS: dict[str, tuple[str, Callable[[Sequence[Message], bool], str], str]] = {
    "phi3": ("Phi-3", _phi3, "<|end|>"),
    "llama": ("ChatML", _chatml, "<|im_end|>"),
    "qwen2": ("ChatML", _chatml, "<|im_end|>"),
    "qwen3": ("ChatML", _chatml, "<|im_end|>"),
    "gemma3": ("Gemma turn", _gemma, "<end_of_turn>"),
}


def _json_or_text(text: str) -> Any:
    """Parsed JSON when `text` is JSON, else the text itself (templates `tojson` arguments)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def template_messages(system: str, messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The `messages` a template renders: the system prompt first (if any), tool calls in
    Hugging Face's shape (`{"type": "function", "function": {"name", "arguments": dict}}`)."""
    out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": _json_or_text(c.arguments)},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def template_tools(tools: Sequence[ToolSpec]) -> list[dict[str, Any]] | None:
    """OpenAI-style function specs for a template's `tools`, or None when there are none."""
    if not tools:
        return None
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": _json_or_text(t.parameters),
            },
        }
        for t in tools
    ]


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def _pieces(parts: list[str], contents: Sequence[str]) -> list[tuple[str, bool]]:
    """re.split output (markup, index, markup, ...) → (text, is_markup) pieces."""
    out: list[tuple[str, bool]] = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            if part:
                out.append((part, True))
        else:
            out.append((contents[int(part)], False))
    return out


class ChatTemplate:
    """Renders a conversation into the prompt text the model expects.

    `render()` returns the text; `render_pieces()` the same text split into the template's
    markup and the messages' contents, for `Tokenizer.encode_chat` (special tokens parsed in
    the markup only). `warning` is None while the model's own template is in use, and a
    one-line message whenever the fallback format had to be used. `end_marker` is the text
    that closes an assistant turn (e.g. "<|im_end|>"), where it can be inferred; generation
    stops there.
    """

    def __init__(
        self,
        source: str | None,
        *,
        arch: str,
        bos_token: str = "",
        eos_token: str = "",
    ) -> None:
        self.source = source
        self.arch = arch
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.warning: str | None = None
        name, fallback, marker = _FALLBACKS.get(arch, _FALLBACKS["qwen2"])
        self.fallback_name = name
        self._fallback = fallback
        self._fallback_marker = marker
        self._template: jinja2.Template | None = None
        if not source:
            self.warning = f"the model has no chat template; using the {name} format"
        elif len(source) > MAX_SOURCE_CHARS:
            self.warning = (
                f"the model's chat template is {len(source)} characters long (real ones are a"
                f" few thousand); using the {name} format"
            )
        else:
            try:
                self._template = _environment().from_string(source)
            except (jinja2.TemplateError, TemplateLimitError, RecursionError, MemoryError) as exc:
                self.warning = (
                    f"the model's chat template does not parse ({_one_line(exc)}); "
                    f"using the {name} format"
                )
        self.end_marker = self._infer_end_marker()
        self._late_system: bool | None = None

    def keeps_late_system(self) -> bool:
        """Whether a system message after the conversation began is rendered (Qwen's and
        ChatML's templates do; Gemma's takes only alternating user and assistant turns and
        raises), so the prompt builder can fold one into a user turn where it would not be."""
        if self._late_system is None:
            probe = [  # between two turns: Gemma's check of the roles' order sees it there
                {"role": "user", "content": _PROBE_USER},
                {"role": "assistant", "content": _PROBE_REPLY},
                {"role": "system", "content": _PROBE_SYSTEM},
                {"role": "user", "content": _PROBE_USER},
            ]
            try:
                if self._template is not None and self.warning is None:
                    text = self._render_template(probe, True)
                else:
                    text = self._fallback(probe, True)
            except (Exception, TemplateLimitError):
                text = ""
            self._late_system = _PROBE_SYSTEM in text
        return self._late_system

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], arch: str | None = None) -> ChatTemplate:
        """The template of a GGUF's metadata; `arch` picks the fallback (default: the file's)."""
        arch = arch or str(metadata.get("general.architecture", ""))
        tokens = metadata.get("tokenizer.ggml.tokens") or []

        def token(key: str) -> str:
            value = metadata.get(key)
            if value is None or not 0 <= int(value) < len(tokens):
                return ""
            return str(tokens[int(value)])

        source = metadata.get("tokenizer.chat_template")
        return cls(
            str(source) if source else None,
            arch=arch,
            bos_token=token("tokenizer.ggml.bos_token_id"),
            eos_token=token("tokenizer.ggml.eos_token_id"),
        )

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> ChatTemplate:
        return cls.from_metadata(g.metadata, g.architecture)

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Message] | None = None,
    ) -> str:
        """The prompt text for `messages` (dicts with "role" and "content").

        `tools` are OpenAI-style function specs (`{"type": "function", "function": {...}}`),
        passed to the template as Hugging Face's `apply_chat_template(tools=...)` does; the
        fallback formats have no place for them."""
        if self._template is not None:
            try:
                text = self._render_template(messages, add_generation_prompt, tools)
            except TemplateLimitError as exc:  # it would cost that again on every render
                self._template = None
                self.warning = (
                    f"the model's chat template was stopped ({_one_line(exc)}); "
                    f"using the {self.fallback_name} format"
                )
            except Exception as exc:  # any failure of foreign template code means: fall back
                self.warning = (
                    f"the model's chat template failed ({_one_line(exc)}); "
                    f"using the {self.fallback_name} format"
                )
            else:
                self.warning = None
                return text
        return self._fallback(messages, add_generation_prompt)

    def render_pieces(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Message] | None = None,
    ) -> list[tuple[str, bool]]:
        """The prompt as (text, is_markup) pieces, for `Tokenizer.encode_chat`.

        Why: the template's own markup (`<|im_start|>user`) must become special tokens, but
        the same text inside a message must not, or a pasted document could forge a system
        turn. The template is rendered a second time with a unique placeholder for each
        message's content; what lies between placeholders is markup, and each placeholder is
        that message's text. Joined, the pieces are exactly `render()`'s text (when the template
        transforms the content, e.g. trims it, the transformed text is used where it can be
        matched, and the content as given otherwise).
        """
        text = self.render(messages, add_generation_prompt, tools)
        nonce = secrets.token_hex(8)
        marks = [f"\ue000{nonce}:{i}\ue001" for i in range(len(messages))]
        marked = [{**m, "content": marks[i]} for i, m in enumerate(messages)]
        try:
            if self._template is not None and self.warning is None:  # as `render` just did
                layout = self._render_template(marked, add_generation_prompt, tools)
            else:
                layout = self._fallback(marked, add_generation_prompt)
        except (Exception, TemplateLimitError):
            return [(text, True)]
        parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", layout)
        if len(parts) == 1:
            return [(text, True)]
        contents = [str(m.get("content", "")) for m in messages]
        for variant in (contents, [c.strip() for c in contents]):
            pieces = _pieces(parts, variant)
            if "".join(p for p, _ in pieces) == text:
                return pieces
        return _pieces(parts, contents)

    def _render_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        tools: Sequence[Message] | None = None,
    ) -> str:
        assert self._template is not None
        context = {
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "tools": [dict(t) for t in tools] if tools else None,
            "documents": None,
        }
        return render_limited(self._template, context)

    def _infer_end_marker(self) -> str | None:
        """The special token the template writes right after an assistant message."""
        if self._template is None:
            return self._fallback_marker
        probe = [
            {"role": "user", "content": _PROBE_USER},
            {"role": "assistant", "content": _PROBE_REPLY},
        ]
        try:
            text = self._render_template(probe, False)
        except TemplateLimitError as exc:
            self._template = None
            self.warning = (
                f"the model's chat template was stopped ({_one_line(exc)}); "
                f"using the {self.fallback_name} format"
            )
            return self._fallback_marker
        except Exception:  # a template that cannot render the probe: no inference
            return None
        at = text.find(_PROBE_REPLY)
        if at < 0:
            return None
        match = _END_MARKER.match(text, at + len(_PROBE_REPLY))
        return match.group(1) if match else None
