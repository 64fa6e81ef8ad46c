"""The npuchat Textual App: themes, keymap, the engine it holds, and the first screen.

Everything the app needs comes in through the constructor (settings, store, engine loader,
clock), so tests build it with a scripted engine and a temporary database, and nothing happens
at import time.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from textual.app import App
from textual.filter import LineFilter

from npuchat.app.engine_port import EngineLoader, EngineSpec, ModelChoice, ModelLister
from npuchat.app.settings import Settings, set_setting
from npuchat.app.store import ConversationStore
from npuchat.app.store_records import ConversationSettings
from npuchat.app.tui.chat_screen import ChatScreen
from npuchat.app.tui.help_screen import HelpScreen
from npuchat.app.tui.keymap_check import check_keymap
from npuchat.app.tui.keys import bindings
from npuchat.app.tui.loading_screen import LoadingScreen
from npuchat.app.tui.messages import EngineLoaded
from npuchat.app.tui.safe_output import ControlCharacterFilter
from npuchat.engine.errors import NpuchatError
from npuchat.engine.events import ChatEngine
from npuchat.themes import (
    THEME_VARIABLE_DEFAULTS,
    builtin_themes,
    resolve_references,
    user_themes,
)

log = logging.getLogger(__name__)

DEFAULT_THEME = "npuchat-dark"


class NpuchatApp(App[None]):
    CSS_PATH = "npuchat.tcss"
    TITLE = "npuchat"
    BINDINGS = bindings("help", "command_palette", "quit")

    def __init__(
        self,
        settings: Settings,
        store: ConversationStore,
        loader: EngineLoader,
        *,
        config_path: Path | None = None,
        clock: Callable[[], datetime] | None = None,
        models: ModelLister | None = None,
    ) -> None:
        """`models` lists what the model picker offers (None: no picker, any name goes)."""
        super().__init__()
        self.settings = settings
        self.store = store
        self.loader = loader
        self.config_path = config_path
        self._models = models
        self._clock = clock or (lambda: datetime.now(UTC).astimezone())
        self.engine: ChatEngine | None = None
        self.engine_spec: EngineSpec | None = None
        self._startup_problems: list[str] = []
        self._control_filter = ControlCharacterFilter()
        self._register_themes()
        keymap, problems = check_keymap(settings.keymap)
        settings.keymap = keymap  # what is in effect; config.toml keeps what the user wrote
        self.set_keymap(keymap)
        self._startup_problems.extend(problems)

    # ---- set-up ----------------------------------------------------------------------------

    def _register_themes(self) -> None:
        for theme in builtin_themes():
            self.register_theme(theme)
        if self.config_path is not None:
            themes, problems = user_themes(self.config_path.parent / "themes")
            for theme in themes:
                self.register_theme(theme)
            self._startup_problems.extend(problems)
        wanted = self.settings.theme
        if wanted in self.available_themes:
            self.theme = wanted
        else:
            self._startup_problems.append(
                f"theme {wanted!r} not found; using {DEFAULT_THEME}"
                " (themes live in <config dir>/themes/*.toml)"
            )
            self.theme = DEFAULT_THEME

    def get_line_filters(self) -> Sequence[LineFilter]:
        """Textual's filters, then the one that keeps stored text from controlling the
        terminal (`safe_output`)."""
        return [*super().get_line_filters(), self._control_filter]

    def get_theme_variable_defaults(self) -> dict[str, str]:
        return dict(THEME_VARIABLE_DEFAULTS)

    def get_css_variables(self) -> dict[str, str]:
        return resolve_references(super().get_css_variables())

    def on_mount(self) -> None:
        self._exit_on_signals()
        spec = EngineSpec(self.settings.model, self.settings.draft, self.settings.device)
        self.push_screen(LoadingScreen(self.loader, spec))
        for problem in self._startup_problems:
            self.notify(problem, severity="warning", timeout=8)
        self.theme_changed_signal.subscribe(self, self._theme_changed)

    def _exit_on_signals(self) -> None:
        """SIGTERM and SIGHUP (a closed terminal, `kill`) quit like Ctrl+Q, so the terminal is
        restored (alternate screen left, mouse tracking off, cursor shown) and the reply being
        streamed is saved as stopped; the exit status is 128 + the signal, as a shell expects."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            if sig is None:
                continue
            try:
                loop.add_signal_handler(sig, self.exit, None, 128 + int(sig))
            except (NotImplementedError, RuntimeError, ValueError):
                return  # not the main thread, or a platform without signals

    # ---- engine ----------------------------------------------------------------------------

    def on_engine_loaded(self, message: EngineLoaded) -> None:
        """The first load finished: show the chat."""
        self.set_engine(message.spec, message.engine)
        self.switch_screen(ChatScreen())

    def set_engine(self, spec: EngineSpec, engine: ChatEngine) -> None:
        """Hold `engine`; the one it replaces (a conversation with another model) is closed.
        Only called between replies, so no worker is using the old one."""
        old, self.engine, self.engine_spec = self.engine, engine, spec
        if old is not None and old is not engine:
            close_engine(old)

    def models(self) -> list[ModelChoice] | None:
        """What the model picker offers and settings accept; None: not known (any name)."""
        return self._models() if self._models is not None else None

    def default_conversation_settings(self) -> ConversationSettings:
        return ConversationSettings(system_prompt=self.settings.system_prompt)

    def now(self) -> datetime:
        return self._clock()

    # ---- settings persistence --------------------------------------------------------------

    def _theme_changed(self, theme: Any) -> None:
        self.persist_setting("theme", theme.name)

    def persist_setting(self, name: str, value: object) -> None:
        """Save one setting to config.toml, re-reading the file first so that values the CLI
        overrode for this run (--model, --device) are not written back."""
        setattr(self.settings, name, value)
        if self.config_path is None:
            return
        try:
            set_setting(self.config_path, name, value)
        except NpuchatError as exc:
            self.notify(f"could not save {name}: {exc}", severity="warning")
        except OSError as exc:
            self.notify(f"could not save {name}: {exc.strerror}", severity="warning")

    # ---- actions ---------------------------------------------------------------------------

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.settings.keymap))


def run_app(
    settings: Settings,
    store: ConversationStore,
    loader: EngineLoader,
    *,
    config_path: Path | None = None,
    models: ModelLister | None = None,
) -> int:
    """Run the TUI until the user quits; returns the exit status (non-zero after a crash).
    The caller owns (and closes) the store; the engine the app loaded is closed here, after
    run() has joined the worker threads."""
    app = NpuchatApp(settings, store, loader, config_path=config_path, models=models)
    try:
        app.run()
    finally:
        if app.engine is not None:
            close_engine(app.engine)
    return app.return_code or 0


def close_engine(engine: ChatEngine) -> None:
    """Release an engine's memory if it offers `close()` (the ChatEngine protocol has none)."""
    close = getattr(engine, "close", None)
    if callable(close):
        close()
