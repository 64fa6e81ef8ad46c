"""The scrolling list of chat turns: user messages, streaming assistant replies, inline notices."""

from __future__ import annotations

from collections.abc import Sequence

from textual import events
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.content import Content
from textual.dom import DOMNode
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Label, Markdown, Static
from textual.widgets.markdown import MarkdownFence, MarkdownStream

from npuchat.app.store_records import MessageStatus, StoredMessage
from npuchat.app.tui.display_text import for_terminal
from npuchat.app.tui.formatting import reply_summary
from npuchat.app.tui.keys import bindings
from npuchat.engine.events import Metrics


class MessageView(Widget, can_focus=True):
    """One turn. Focusable so keys can act on it (copy, edit); `message_id` ties it to the
    store (None only for a reply whose row is not written yet)."""

    BINDINGS = bindings("message_copy")

    def __init__(self, message_id: int | None, content: str) -> None:
        super().__init__()
        self.message_id = message_id
        self.content = content

    def action_copy_text(self) -> None:
        self.app.copy_to_clipboard(self.content)
        self.app.notify("Message copied", timeout=2)


class UserMessage(MessageView):
    BINDINGS = bindings("message_edit")

    class EditRequested(Message):
        def __init__(self, view: UserMessage) -> None:
            super().__init__()
            self.view = view

    def compose(self) -> ComposeResult:
        yield Static(for_terminal(self.content), markup=False, classes="body")

    def action_edit(self) -> None:
        self.post_message(self.EditRequested(self))


class CodeFence(MarkdownFence):
    """A code block whose tabs are expanded before highlighting: the highlighter counts a tab
    as one cell and the terminal as several, which shifted every colour after a tab. The
    copied code (`code`) keeps its tabs."""

    TAB_SIZE = 4

    @classmethod
    def highlight(cls, code: str, language: str, ansi: bool = False, dark: bool = False) -> Content:
        return super().highlight(code.expandtabs(cls.TAB_SIZE), language, ansi=ansi, dark=dark)


class ReplyMarkdown(Markdown):
    BLOCKS = {**Markdown.BLOCKS, "fence": CodeFence, "code_block": CodeFence}  # noqa: RUF012


class AssistantMessage(MessageView):
    """A reply rendered as Markdown; streamed through a MarkdownStream while generating."""

    BINDINGS = bindings("message_copy_code")

    def __init__(
        self,
        message_id: int | None,
        content: str = "",
        status: MessageStatus = "complete",
        metrics: Metrics | None = None,
        error: str = "",
        limit: int = 0,
    ) -> None:
        """`limit`: the token limit that cut this reply short (0: it was not cut)."""
        super().__init__(message_id, content)
        self.status = status
        self.metrics = metrics
        self.error = error
        self.limit = limit
        self.continue_key = "Ctrl+T"
        self.progress = ""
        self._stream: MarkdownStream | None = None
        self._copy_index = 0

    def compose(self) -> ComposeResult:
        yield ReplyMarkdown(for_terminal(self.content), classes="body")
        yield Label(self._status_text(), classes="status", markup=False)

    def on_mount(self) -> None:
        self._refresh_status()

    async def append(self, text: str) -> None:
        if not text:
            return
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(Markdown))
        self.content += text
        await self._stream.write(for_terminal(text))

    async def finish(
        self, status: MessageStatus, metrics: Metrics | None, error: str = "", limit: int = 0
    ) -> None:
        """Stop streaming and render the whole reply once more from its full source (the
        incremental parse can differ at block boundaries, e.g. a fence closed late)."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        await self.query_one(Markdown).update(for_terminal(self.content))
        self.status, self.metrics, self.error, self.limit = status, metrics, error, limit
        self._refresh_status()

    def set_generating(self, progress: str = "") -> None:
        """Mark the reply as streaming; `progress` says what the engine does before the first
        token (reading a long prompt)."""
        self.status = "partial"
        self.progress = progress
        self._refresh_status(generating=True)

    def _status_text(self, generating: bool = False) -> str:
        if generating:
            return f"{self.progress or 'generating…'} (Esc stops)"
        parts = []
        if self.limit and self.status == "complete":
            parts.append(
                f"stopped at the {self.limit:,}-token limit · {self.continue_key} continues"
            )
        elif self.status == "stopped":
            parts.append("stopped")
        elif self.status == "partial":
            parts.append("interrupted")
        elif self.status == "error":
            parts.append(f"error: {self.error}" if self.error else "error")
        if self.metrics is not None:
            parts.append(reply_summary(self.metrics))
        return " · ".join(parts)

    def _refresh_status(self, generating: bool = False) -> None:
        label = self.query_one(".status", Label)
        text = self._status_text(generating)
        label.update(text)
        label.display = bool(text)
        incomplete = self.status in ("stopped", "partial", "error") or self.limit > 0
        self.set_class(incomplete, "-incomplete")

    def code_blocks(self) -> list[str]:
        return [fence.code for fence in self.query(MarkdownFence)]

    def action_copy_code(self) -> None:
        """Copy a code block; pressing again walks back to the previous block."""
        blocks = self.code_blocks()
        if not blocks:
            self.app.notify("This reply has no code block", severity="warning", timeout=2)
            return
        index = len(blocks) - 1 - (self._copy_index % len(blocks))
        self._copy_index += 1
        copy_code(self, blocks[index], index, len(blocks))

    def on_click(self, event: events.Click) -> None:
        node: DOMNode | None = event.widget
        while node is not None and node is not self:
            if isinstance(node, MarkdownFence):
                blocks = list(self.query(MarkdownFence))
                copy_code(self, node.code, blocks.index(node), len(blocks))
                return
            node = node.parent


def copy_code(widget: Widget, code: str, index: int, count: int) -> None:
    widget.app.copy_to_clipboard(code)
    where = f" {index + 1} of {count}" if count > 1 else ""
    lines = code.count("\n") + (0 if code.endswith("\n") else 1)
    widget.app.notify(f"Copied code block{where} ({lines} lines)", timeout=2)


class NoticeView(Static):
    """An inline notice from the engine (e.g. turns dropped to fit the context)."""

    def __init__(self, text: str, level: str = "info") -> None:
        super().__init__(for_terminal(text), markup=False, classes=f"-{level}")


class MessageList(VerticalScroll):
    """Holds the turns; anchored to the bottom so a streaming reply stays in view."""

    def on_mount(self) -> None:
        self.anchor()

    async def show_history(
        self,
        history: Sequence[StoredMessage],
        streaming: tuple[int, str] | None = None,
    ) -> AssistantMessage | None:
        """Show a conversation's stored messages. `streaming` is (message id, text so far) of
        a reply still being generated: its view (returned) shows that text, not the stored."""
        await self.remove_children([c for c in self.children if c.id != "empty"])
        views: list[MessageView] = []
        live: AssistantMessage | None = None
        for m in history:
            if m.role == "user":
                views.append(UserMessage(m.id, m.content))
            elif streaming is not None and m.id == streaming[0]:
                live = AssistantMessage(m.id, streaming[1], "partial")
                views.append(live)
            elif m.role == "assistant":
                views.append(
                    AssistantMessage(m.id, m.content, m.status, m.metrics, m.error, m.cut_at)
                )
        await self.mount_all(views)
        self.update_empty_hint()
        self.scroll_end(animate=False)
        return live

    async def remove_from(self, message_id: int) -> None:
        """Remove the view of `message_id` and everything after it (notices included)."""
        doomed = []
        seen = False
        for child in self.children:
            if isinstance(child, MessageView) and child.message_id is not None:
                seen = seen or child.message_id >= message_id
            if seen and child.id != "empty":
                doomed.append(child)
        if doomed:
            await self.remove_children(doomed)
        self.update_empty_hint()

    def update_empty_hint(self) -> None:
        """The first-screen hint shows while there is no message."""
        self.query_one("#empty").display = not self.query(MessageView)

    def last_assistant(self) -> AssistantMessage | None:
        replies = list(self.query(AssistantMessage))
        return replies[-1] if replies else None

    def focused_or_last_assistant(self) -> AssistantMessage | None:
        focused = self.app.focused
        if isinstance(focused, AssistantMessage):
            return focused
        return self.last_assistant()
