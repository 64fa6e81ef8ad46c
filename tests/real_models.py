"""Real models for tests: pulled once, through npuchat's own pull code, into a cache outside the
clone (`~/.cache/npuchat-test`, or `$NPUCHAT_TEST_CACHE`), so CI runs do not download them again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from npuchat.engine.catalog import Catalog
from npuchat.engine.paths import Paths
from npuchat.engine.pull import pull

__all__ = ["REFERENCE_DIR", "cache_root", "real_gguf"]

# Outputs of llama.cpp on the real models (see tests/data/README.md), kept in the repository.
REFERENCE_DIR = Path(__file__).resolve().parent / "data"


def cache_root() -> Path:
    return Path(os.environ.get("NPUCHAT_TEST_CACHE", Path.home() / ".cache" / "npuchat-test"))


@pytest.fixture(scope="session")
def real_gguf() -> Callable[[str], Path]:
    """Factory: `real_gguf("smollm2-135m") -> Path`, pulling the model on first use."""
    root = cache_root()
    paths = Paths(root / "config", root / "data", root / "cache", root / "models")
    catalog = Catalog.load(paths)

    def get(name: str) -> Path:
        path, _ = pull(catalog, name)
        return path

    return get
