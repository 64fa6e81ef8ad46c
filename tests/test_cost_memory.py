"""The speculation cost model's start figures are measured once per model, graphs, threads and
machine: a second start on the same cache takes them from disk (no model step spent), and a
file that is damaged, a day old or was measured on another CPU is measured again."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from npuchat.engine import session as session_module
from npuchat.engine.drafters import LookupDrafter
from npuchat.engine.model import Model
from npuchat.engine.session import ChatSession


def _start(path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, dict]:
    """(model steps the start ran, the cost model's figures) of a session opened with lookup
    drafting."""
    steps = [0]
    for name in ("decode", "verify"):
        run = getattr(Model, name)

        def counted(self: Model, *a: object, _run: Callable = run, **kw: object) -> object:
            steps[0] += 1
            return _run(self, *a, **kw)

        monkeypatch.setattr(Model, name, counted)
    session = ChatSession.open(path, name="syn", cache_dir=cache, capacities=[64])
    try:
        session.use_drafters([LookupDrafter()])
        assert session.speculative is not None
        costs = session.speculative.costs
        return steps[0], {"decode": costs.t_dec, "verify": costs.t_ver}
    finally:
        session.close()
        monkeypatch.undo()


def test_a_second_start_recalls_the_figures(
    synthetic_gguf: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, cache = synthetic_gguf("qwen2", seed=3), tmp_path / "c"
    measured, first = _start(path, cache, monkeypatch)
    assert measured >= 3 and first["decode"] and first["verify"]
    recalled, second = _start(path, cache, monkeypatch)
    assert recalled == 0 and second == first
    (kept,) = (cache / "speculation").iterdir()
    raw = json.loads(kept.read_text())
    for damage in ({"decode_s": -1.0}, {"verify_s": {"99": 0.01}}, {"decode_s": "fast"}):
        kept.write_text(json.dumps(raw | damage))
        again, _ = _start(path, cache, monkeypatch)
        assert again == measured, damage  # measured again,
        assert json.loads(kept.read_text())["decode_s"] > 0  # and rewritten whole
    kept.write_text("{not json")
    assert _start(path, cache, monkeypatch)[0] == measured
    kept.write_text(json.dumps(raw | {"padding": "x" * 70_000}))  # not read: too big to be ours
    assert _start(path, cache, monkeypatch)[0] == measured
    day_old = time.time() - 25 * 3600
    os.utime(kept, (day_old, day_old))
    assert _start(path, cache, monkeypatch)[0] == measured
    assert _start(path, cache, monkeypatch)[0] == 0  # rewritten: fresh again
    monkeypatch.setattr(session_module, "machine_identity", lambda: "another CPU")
    elsewhere, _ = _start(path, cache, monkeypatch)
    assert elsewhere == measured
