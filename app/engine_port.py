"""How the app obtains an engine without knowing how engines are built.

The CLI owns model pulling and loading; the TUI only needs "give me a ChatEngine for this
model/draft/device, and tell me how far you are". Passing that in as a callable keeps the TUI
testable with a scripted engine and keeps Textual out of the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
