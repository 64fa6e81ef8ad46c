"""Per-conversation settings: system prompt, model, draft, sampling parameters, reply format.

Values are checked here with messages that say what is allowed; the screen only dismisses with
settings that the engine will accept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.suggester import SuggestFromList
from textual.widgets import Button, Input, Label, TextArea

from npuchat.app.store_records import ConversationSettings
from npuchat.engine.sampling_domain import DOMAINS, sampling_problems


@dataclass(frozen=True)
class _Field:
    name: str
    label: str
    kind: str  # "text" | "float" | "int" | "seed" | "format"
    low: float | None = None
    high: float | None = None
    hint: str = ""


def _ranged(name: str, label: str, hint: str = "") -> _Field:
    """A number field with the engine's own range for it (`sampling_domain.DOMAINS`)."""
    domain = DOMAINS[name]
    return _Field(name, label, "int" if domain.whole else "float", domain.low, domain.high, hint)


REPLY_FORMATS = ("text", "json")

_FIELDS: tuple[_Field, ...] = (
    _Field("model", "Model", "text", hint="empty: the default model"),
    _Field("draft", "Draft", "text", hint="empty: none · lookup · default · a name"),
    _ranged("temperature", "Temperature", "0 = greedy"),
    _ranged("top_p", "Top-p", "1 = off"),
    _ranged("top_k", "Top-k", "0 = off"),
    _ranged("min_p", "Min-p", "0 = off"),
    _ranged("repeat_penalty", "Repeat penalty", "1 = off"),
    _ranged("presence_penalty", "Presence penalty", "0 = off"),
    _ranged("frequency_penalty", "Frequency penalty", "0 = off"),
    _ranged("max_tokens", "Max tokens"),
    _Field("seed", "Seed", "seed", hint="empty: random"),
    _Field("reply_format", "Reply format", "format", hint="text · json (one JSON object)"),
)


class SettingsError(ValueError):
    pass


def parse_field(spec: _Field, raw: str) -> object:
    """Turn one input's text into its value or raise SettingsError saying what is allowed."""
    text = raw.strip()
    if spec.kind == "text":
        return text
    if spec.kind == "format":
        if text.lower() not in REPLY_FORMATS:
            raise SettingsError(f"{spec.label}: text, or json for a JSON object")
        return text.lower()
    if spec.kind == "seed":
        if not text:
            return None
        try:
            return int(text)
        except ValueError:
            raise SettingsError(f"{spec.label}: a whole number, or empty for random") from None
    try:
        value: float = int(text) if spec.kind == "int" else float(text)
    except ValueError:
        kind = "a whole number" if spec.kind == "int" else "a number"
        raise SettingsError(
            f"{spec.label}: {kind} between {spec.low:g} and {spec.high:g}"
        ) from None
    if (spec.low is not None and value < spec.low) or (spec.high is not None and value > spec.high):
        raise SettingsError(f"{spec.label}: must be between {spec.low:g} and {spec.high:g}")
    if spec.name == "top_p" and value == 0:
        raise SettingsError("Top-p: must be above 0 (1 = off)")
    return value


def check_domains(settings: ConversationSettings) -> None:
    """The engine's own sampling check (`sampling_domain`), worded with this dialog's labels."""
    sampling = settings.sampling()
    labels = {spec.name: spec.label for spec in _FIELDS}
    problems = [(labels.get(name, name), why) for name, why in sampling_problems(sampling)]
    if problems:
        raise SettingsError("; ".join(f"{label}: {why}" for label, why in problems))


class SettingsScreen(ModalScreen[ConversationSettings | None]):
    """Edit one conversation's settings; dismisses with the new settings or None."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel", id="settings_cancel"),
        Binding("ctrl+s", "save", "Save", id="settings_save", priority=True),
    ]

    def __init__(
        self,
        settings: ConversationSettings,
        title: str,
        defaults: dict[str, str] | None = None,
        models: list[str] | None = None,
    ) -> None:
        """`defaults` fills the placeholder of empty text fields (what empty means now);
        `models` are the names the model field accepts (None: any), suggested as one types."""
        super().__init__(classes="dialog")
        self.settings = settings
        self.title_text = title
        self.defaults = defaults or {}
        self.models = models

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-body", id="settings-body"):
            yield Label(f"Settings · {self.title_text}", classes="question", markup=False)
            with VerticalScroll(id="settings-scroll"):
                yield Label("System prompt", classes="field-label")
                yield TextArea(self.settings.system_prompt, id="system_prompt", soft_wrap=True)
                with Grid(id="settings-grid"):
                    for spec in _FIELDS:
                        value = getattr(self.settings, spec.name)
                        yield Label(spec.label, classes="field-label")
                        suggest = self.models if spec.name == "model" and self.models else None
                        if spec.kind == "format":
                            suggest = list(REPLY_FORMATS)
                        yield Input(
                            "" if value is None else str(value),
                            id=spec.name,
                            placeholder=self.defaults.get(spec.name, spec.hint),
                            suggester=SuggestFromList(suggest) if suggest else None,
                        )
            yield Label("", id="settings-error", markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Cancel", id="cancel")
                yield Button("Save", id="save", variant="primary")

    def on_mount(self) -> None:
        blink = self.app.settings.cursor_blink  # type: ignore[attr-defined]
        for widget in self.query(Input):
            widget.cursor_blink = blink
        area = self.query_one("#system_prompt", TextArea)
        area.cursor_blink = blink
        area.focus()
        self.query_one("#settings-error").display = False

    def collect(self) -> ConversationSettings:
        values: dict[str, object] = {
            "system_prompt": self.query_one("#system_prompt", TextArea).text
        }
        for spec in _FIELDS:
            values[spec.name] = parse_field(spec, self.query_one(f"#{spec.name}", Input).value)
        model = values["model"]
        if self.models is not None and model and model not in self.models:
            raise SettingsError(
                f"Model: no model named {model!r}; one of {', '.join(self.models)}"
                " (npuchat models lists them, npuchat import adds a GGUF)"
            )
        settings = ConversationSettings(**values)  # type: ignore[arg-type]
        check_domains(settings)
        return settings

    @on(Button.Pressed, "#save")
    @on(Input.Submitted)
    def action_save(self) -> None:
        try:
            settings = self.collect()
        except SettingsError as exc:
            error = self.query_one("#settings-error", Label)
            error.update(str(exc))
            error.display = True
            return
        self.dismiss(settings)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)
