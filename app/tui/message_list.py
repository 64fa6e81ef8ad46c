"""The scrolling list of chat turns: user messages, streaming assistant replies, inline notices."""

from __future__ import annotations

from textual import events
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.dom import DOMNode
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Label, Markdown, Static
from textual.widgets.markdown import MarkdownFence, MarkdownStream

from npuchat.app.store import MessageStatus
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
        yield Static(self.content, markup=False, classes="body")

    def action_edit(self) -> None:
        self.post_message(self.EditRequested(self))


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
    ) -> None:
        super().__init__(message_id, content)
        self.status = status
        self.metrics = metrics
        self.error = error
        self._stream: MarkdownStream | None = None
        self._copy_index = 0

    def compose(self) -> ComposeResult:
        yield Markdown(self.content, classes="body")
        yield Label(self._status_text(), classes="status", markup=False)

    def on_mount(self) -> None:
        self._refresh_status()

    async def append(self, text: str) -> None:
        if not text:
            return
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(Markdown))
        self.content += text
        await self._stream.write(text)

    async def finish(self, status: MessageStatus, metrics: Metrics | None, error: str = "") -> None:
        """Stop streaming and render the whole reply once more from its full source (the
        incremental parse can differ at block boundaries, e.g. a fence closed late)."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        await self.query_one(Markdown).update(self.content)
        self.status, self.metrics, self.error = status, metrics, error
        self._refresh_status()

    def set_generating(self) -> None:
        self.status = "partial"
        self._refresh_status(generating=True)

    def _status_text(self, generating: bool = False) -> str:
        if generating:
            return "generating… (Esc stops)"
        parts = []
        if self.status == "stopped":
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
        self.set_class(self.status in ("stopped", "partial", "error"), "-incomplete")

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
        super().__init__(text, markup=False, classes=f"-{level}")


class MessageList(VerticalScroll):
    """Holds the turns; anchored to the bottom so a streaming reply stays in view."""

    def on_mount(self) -> None:
        self.anchor()

    def last_assistant(self) -> AssistantMessage | None:
        replies = list(self.query(AssistantMessage))
        return replies[-1] if replies else None

    def focused_or_last_assistant(self) -> AssistantMessage | None:
        focused = self.app.focused
        if isinstance(focused, AssistantMessage):
            return focused
        return self.last_assistant()
