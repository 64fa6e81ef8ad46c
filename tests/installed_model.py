"""A synthetic model installed through `npuchat import`, for the tests that run the CLI on one.

The `syn` fixture (through conftest) is a tiny Llama installed as "syn" in the test's own
NPUCHAT_HOME; a test file that needs another arch or one file for the whole module overrides it
with `install_as_syn`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from synthetic import write_synthetic_gguf

from npuchat.app.cli import main

__all__ = ["install_as_syn", "syn"]


def install_as_syn(path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """Import the GGUF at `path` under the name "syn" (its output swallowed); returns `path`."""
    assert main(["import", str(path), "--name", "syn"]) == 0
    capsys.readouterr()
    return path


@pytest.fixture()
def syn(isolated_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    return install_as_syn(write_synthetic_gguf(tmp_path / "syn.gguf", "llama", seed=5), capsys)
