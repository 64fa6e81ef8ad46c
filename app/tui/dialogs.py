"""Small modal dialogs the user opens on purpose: confirm, and one-line text prompts."""

from __future__ import annotations

from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label


class ConfirmScreen(ModalScreen[bool]):
    """Yes/no; dismisses with True only on an explicit confirm."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel", id="dialog_cancel"),
        Binding("y", "confirm", "Yes", show=False, id="dialog_yes"),
        Binding("n", "cancel", "No", show=False, id="dialog_no"),
    ]

    def __init__(self, question: str, confirm_label: str = "Delete") -> None:
        super().__init__(classes="dialog")
        self.question = question
        self.confirm_label = confirm_label

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-body"):
            yield Label(self.question, classes="question", markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Cancel", id="cancel")
                yield Button(self.confirm_label, id="confirm", variant="error")

    def on_mount(self) -> None:
        self.query_one("#cancel", Button).focus()

    @on(Button.Pressed, "#confirm")
    def action_confirm(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(False)


class PromptScreen(ModalScreen[str | None]):
    """Ask for one line of text (a title, a file path); None when cancelled."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel", id="dialog_cancel")
    ]

    def __init__(self, title: str, value: str = "", hint: str = "") -> None:
        super().__init__(classes="dialog")
        self.title_text = title
        self.value = value
        self.hint = hint

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-body"):
            yield Label(self.title_text, classes="question", markup=False)
            yield Input(self.value, id="prompt-input")
            if self.hint:
                yield Label(self.hint, classes="hint", markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Cancel", id="cancel")
                yield Button("OK", id="ok", variant="primary")

    def on_mount(self) -> None:
        self.query_one(Input).cursor_blink = self.app.settings.cursor_blink  # type: ignore[attr-defined]

    @on(Input.Submitted)
    @on(Button.Pressed, "#ok")
    def _submit(self) -> None:
        value = self.query_one(Input).value.strip()
        if value:
            self.dismiss(value)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)
