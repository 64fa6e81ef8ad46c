"""Shared fixtures: real models (pulled once into a cache outside the clone), synthetic GGUFs,
and an isolated NPUCHAT_HOME for every test so no test touches the user's files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from installed_model import syn  # noqa: F401  (fixture)
from real_models import *  # noqa: F403  (fixtures)
from scripted_engine import store  # noqa: F401  (fixture)
from synthetic import synthetic_gguf  # noqa: F401  (fixture)
from tokenizer_checks import tokenizer_builds  # noqa: F401  (fixture)

# The native kernels are built once per machine beside the real models, not in each test's home.
os.environ.setdefault("NPUCHAT_KERNEL_CACHE", str(cache_root() / "kernels"))  # noqa: F405


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "npuchat-home"
    monkeypatch.setenv("NPUCHAT_HOME", str(home))
    return home
