"""The first screen: pulls/loads the model with visible progress, then hands over to the chat.

A full screen, not a modal: on first run the pull may take minutes and is the only thing
happening. A load failure is shown here as one line with what to do, never a traceback.
"""

from __future__ import annotations

import threading
from typing import ClassVar

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Center, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Label, ProgressBar

from npuchat.app.engine_port import EngineLoader, EngineSpec
from npuchat.app.tui.loader_worker import load_engine
from npuchat.app.tui.messages import EngineLoadFailed, LoadProgress


class LoadingScreen(Screen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "app.quit", "Quit", show=False, id="loading_quit")
    ]

    def __init__(self, loader: EngineLoader, spec: EngineSpec) -> None:
        super().__init__()
        self.loader = loader
        self.spec = spec
        self._abort = threading.Event()

    def compose(self) -> ComposeResult:
        with Center(), Vertical(id="loading-box"):
            yield Label("npuchat", id="loading-title")
            draft = f" + draft {self.spec.draft}" if self.spec.draft else ""
            yield Label(
                f"{self.spec.model}{draft} on {self.spec.device}", id="loading-spec", markup=False
            )
            yield Label("Starting…", id="loading-stage", markup=False)
            yield ProgressBar(total=1.0, show_eta=False, id="loading-bar")
            yield Label("", id="loading-error", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#loading-error").display = False
        self._load()

    @work(thread=True, exclusive=True, group="load", exit_on_error=False)
    def _load(self) -> None:
        # EngineLoaded goes to the app (it switches screens); progress and failure stay here.
        def post(message: object) -> None:
            target = self if isinstance(message, LoadProgress | EngineLoadFailed) else self.app
            target.post_message(message)  # type: ignore[arg-type]

        load_engine(self.loader, self.spec, post, self._abort)

    def on_unmount(self) -> None:
        self._abort.set()  # quitting mid-pull: the loader stops at its next progress report

    def on_load_progress(self, message: LoadProgress) -> None:
        self.query_one("#loading-stage", Label).update(message.stage)
        self.query_one("#loading-bar", ProgressBar).update(progress=message.fraction)

    def on_engine_load_failed(self, message: EngineLoadFailed) -> None:
        self.query_one("#loading-stage", Label).update("Could not load the model")
        self.query_one("#loading-bar").display = False
        error = self.query_one("#loading-error", Label)
        error.update(f"{message.message}\n\nPress q to quit.")
        error.display = True
