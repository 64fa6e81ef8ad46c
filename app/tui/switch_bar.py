"""The bar above the composer that loads another model for a conversation, with progress.

It runs the engine loader in a thread worker and shows its stages; `EngineLoaded` and
`EngineLoadFailed` bubble up to the screen, which decides what to do with the result.
"""

from __future__ import annotations

import threading

from textual import work
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Label, ProgressBar

from npuchat.app.engine_port import EngineLoader, EngineSpec
from npuchat.app.tui.loader_worker import load_engine
from npuchat.app.tui.messages import EngineLoaded, EngineLoadFailed, LoadProgress


class ModelSwitchBar(Horizontal):
    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.loading_spec: EngineSpec | None = None
        self._abort = threading.Event()

    def compose(self) -> ComposeResult:
        yield Label("", id="switch-stage", markup=False)
        yield ProgressBar(total=1.0, show_eta=False, id="switch-bar")

    def on_mount(self) -> None:
        self.display = False

    def load(self, loader: EngineLoader, spec: EngineSpec) -> None:
        self.loading_spec = spec
        self.display = True
        self.query_one("#switch-stage", Label).update(f"Loading {spec.model}…")
        self.query_one("#switch-bar", ProgressBar).update(progress=0)
        self._load(loader, spec)

    @work(thread=True, exclusive=True, group="load", exit_on_error=False)
    def _load(self, loader: EngineLoader, spec: EngineSpec) -> None:
        load_engine(loader, spec, self.post_message, self._abort)

    def on_load_progress(self, message: LoadProgress) -> None:
        message.stop()
        self.query_one("#switch-stage", Label).update(message.stage)
        self.query_one("#switch-bar", ProgressBar).update(progress=message.fraction)

    def on_engine_loaded(self, message: EngineLoaded) -> None:
        self._done()

    def on_engine_load_failed(self, message: EngineLoadFailed) -> None:
        self._done()

    def _done(self) -> None:
        self.loading_spec = None
        self.display = False

    def on_unmount(self) -> None:
        """Quitting mid-load: the loader stops at its next progress report."""
        self._abort.set()
