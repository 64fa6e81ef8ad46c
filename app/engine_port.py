"""How the app obtains an engine without knowing how engines are built.

The CLI owns model pulling and loading; the TUI only needs "give me a ChatEngine for this
model/draft/device, and tell me how far you are". Passing that in as a callable keeps the TUI
testable with a scripted engine and keeps Textual out of the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from npuchat.engine.catalog import Catalog
from npuchat.engine.events import ChatEngine

ProgressCallback = Callable[[str, float], None]
"""(stage text, fraction 0..1); called from the loader's thread, possibly often."""


@dataclass(frozen=True)
class EngineSpec:
    """What to load. `draft` follows `--draft`: "default" = the catalog's draft plus lookup,
    "lookup", a name, NAME+lookup; "" or "none" = plain decoding (`parse_draft`)."""

    model: str
    draft: str
    device: str


EngineLoader = Callable[[EngineSpec, ProgressCallback], ChatEngine]
"""Pulls the model if needed and loads it. Raises NpuchatError for anything the user can fix."""


@dataclass(frozen=True)
class ModelChoice:
    """A model the user can pick: from the catalog (pulled on first use) or imported."""

    name: str
    arch: str
    size_bytes: int
    installed: bool
    params: str = ""


ModelLister = Callable[[], list[ModelChoice]]
"""The models the app can load, installed or not (read when asked: a pull adds one)."""


def catalog_lister(catalog: Catalog) -> ModelLister:
    def models() -> list[ModelChoice]:
        out = []
        for name in catalog.names():
            entry = catalog.get(name)
            manifest = catalog.installed(entry)
            size = manifest.size if manifest else entry.size
            out.append(ModelChoice(name, entry.arch, size, manifest is not None, entry.params))
        return out

    return models
