"""Rich progress display for model pulls in the terminal (the TUI has its own screen)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


class RichPullProgress:
    """Implements `npuchat.engine.pull.PullProgress` with a byte bar and a part counter."""

    def __init__(self, console: Console) -> None:
        self._console = console
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._parts = 0

    def start(self, name: str, total_bytes: int, parts: int) -> None:
        self._parts = parts
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TextColumn("part {task.fields[part]}/{task.fields[parts]}"),
            TimeRemainingColumn(),
            console=self._console,
            transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task(
            f"pull {name}", total=total_bytes or None, part=min(1, parts), parts=parts
        )

    def update(self, done_bytes: int, part: int) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=done_bytes, part=min(part + 1, self._parts))

    def finish(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
