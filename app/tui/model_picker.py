"""The model picker: every model the app can load, in the command palette.

Picking one sets the model of the conversation on screen (or of the new chat); its next reply
loads it, pulling it first with progress above the composer if it is not installed yet.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, cast

from textual.command import DiscoveryHit, Hit, Hits, Provider

from npuchat.app.engine_port import ModelChoice
from npuchat.app.model_commands import human_size

if TYPE_CHECKING:
    from npuchat.app.tui.app import NpuchatApp


def describe(model: ModelChoice) -> str:
    """ "llama · 135M · 94.3 MiB · installed"."""
    parts = [p for p in (model.arch, model.params, human_size(model.size_bytes)) if p != "?"]
    parts.append("installed" if model.installed else "pulled when first used")
    return " · ".join(p for p in parts if p)


class ModelCommands(Provider):
    def _models(self) -> list[ModelChoice]:
        return cast("NpuchatApp", self.app).models() or []

    async def _use(self, name: str) -> None:
        use = getattr(self.screen, "use_model", None)
        if use is not None:
            await use(name)

    async def discover(self) -> Hits:
        for model in self._models():
            yield DiscoveryHit(
                f"Model: {model.name}", partial(self._use, model.name), help=describe(model)
            )

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for model in self._models():
            title = f"Model: {model.name}"
            score = matcher.match(title)
            if score > 0:
                command = partial(self._use, model.name)
                yield Hit(score, matcher.highlight(title), command, help=describe(model))
