"""The compile-once cache: a second start reuses the built graphs; damage or a new key rebuilds."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from npuchat.engine import runtime
from npuchat.engine.errors import NpuchatError
from npuchat.engine.model import Model

IDS = [3, 14, 15, 92, 65, 35]


def _load(path: Path, cache: Path, **kw) -> Model:
    return Model.load(path, cache_dir=cache, prefill_chunk=8, capacities=[32], **kw)


def _snapshot(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


def _run(model: Model) -> np.ndarray:
    with model:
        return model.prefill(IDS)


@pytest.fixture
def gguf(synthetic_gguf) -> Path:
    return synthetic_gguf("phi3", "q4_0")


def test_second_start_does_not_rebuild(gguf: Path, tmp_path: Path) -> None:
    first = _load(gguf, tmp_path)
    folder = first.graph_dir
    assert first.graph_builds == 1
    # with the native kernels the GGUF's blocks stay in the GGUF (`gguf-tensors` stands for it,
    # the graph's index of them beside it)
    native = [] if "MatMulNBits" in first.kernels else ["gguf-tensors", "decoder.onnx.gguf.json"]
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["decoder.onnx", "manifest.json", "weights.bin", *native]
    )
    logits = _run(first)
    before = _snapshot(folder)
    second = _load(gguf, tmp_path)
    assert second.graph_builds == 0 and second.graph_dir == folder
    assert _snapshot(folder) == before  # nothing rewritten
    np.testing.assert_array_equal(_run(second), logits)
    assert [p.name for p in (tmp_path / "graphs").iterdir()] == [folder.name]  # no leftovers


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_damaged_cache_is_rebuilt_not_run(gguf: Path, tmp_path: Path, damage: str) -> None:
    first = _load(gguf, tmp_path)
    folder = first.graph_dir
    logits = _run(first)
    weights = folder / "weights.bin"
    if damage == "truncate":
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size // 2)
    elif damage == "flip":  # same size, one byte changed inside a weight
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif damage == "delete":
        (folder / "decoder.onnx").unlink()
    else:
        (folder / "manifest.json").write_text("{not json")
    second = _load(gguf, tmp_path)
    assert second.graph_builds == 1
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["files"]["weights.bin"]["size"] == weights.stat().st_size
    np.testing.assert_array_equal(_run(second), logits)


def test_changed_key_builds_a_new_folder(gguf: Path, tmp_path: Path) -> None:
    first = _load(gguf, tmp_path)
    exact = _load(gguf, tmp_path, accuracy_level=0)
    assert exact.graph_builds == 1 and exact.graph_dir != first.graph_dir
    first.close()
    exact.close()
    key = runtime.cache_key("a" * 64, "specs", "v1", "cpu", {})
    assert key != runtime.cache_key("b" * 64, "specs", "v1", "cpu", {})
    assert key != runtime.cache_key("a" * 64, "specs", "v2", "cpu", {})
    assert key != runtime.cache_key("a" * 64, "specs", "v1", "cpu", {"htp": 1})


def test_model_hash_sidecar_skips_rehashing(
    gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    real = runtime.sha256_file

    def counting(path: Path) -> str:
        calls.append(Path(path))
        return real(path)

    monkeypatch.setattr(runtime, "sha256_file", counting)
    digest = runtime.model_sha256(gguf, tmp_path)
    assert digest == real(gguf) and calls == [gguf.resolve()]
    assert runtime.model_sha256(gguf, tmp_path) == digest
    assert len(calls) == 1  # served by the sidecar
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # "replaced" file
    assert runtime.model_sha256(gguf, tmp_path) == digest
    assert len(calls) == 2


def test_unloadable_graph_is_a_one_line_error(tmp_path: Path) -> None:
    bad = tmp_path / "decoder.onnx"
    bad.write_bytes(b"not a protobuf")
    with pytest.raises(NpuchatError, match=r"could not load decoder\.onnx"):
        runtime.create_session(bad, "cpu", 1)


def test_an_upgrade_removes_only_the_graphs_it_supersedes(
    gguf: Path,
    synthetic_gguf,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a builder (or ONNX Runtime) upgrade the old folders can never be hit again: the
    first build under the new version removes this model's, and no other model's."""
    old = _load(gguf, tmp_path)
    exact = _load(gguf, tmp_path, accuracy_level=0)  # another graph set of this model
    other = _load(synthetic_gguf("llama", "q8_0"), tmp_path)  # another model: kept
    for m in (old, exact, other):
        m.close()
    monkeypatch.setattr(runtime, "BUILDER_VERSION", "next")
    monkeypatch.setattr("npuchat.engine.cpu_graph.BUILDER_VERSION", "next")
    new = _load(gguf, tmp_path)
    assert new.graph_builds == 1 and new.graph_dir != old.graph_dir
    assert set((tmp_path / "graphs").iterdir()) == {other.graph_dir, new.graph_dir}
    assert sorted(new._graph_cache.pruned) == sorted([old.graph_dir.name, exact.graph_dir.name])
    again = _load(gguf, tmp_path)  # the new version's folder is served, nothing pruned
    assert again.graph_builds == 0 and not again._graph_cache.pruned
    _run(again)


def test_a_result_opened_from_a_damaged_folder_is_never_handed_out(tmp_path: Path) -> None:
    """`GraphCache.load` opens a folder while it verifies it: when the hashes fail, what was
    opened is dropped and the rebuilt folder is opened instead."""
    cache = runtime.GraphCache(tmp_path)

    def build(folder: Path) -> None:
        (folder / "w.bin").write_bytes(b"good" * 64)

    opened: list[bytes] = []

    def open_folder(folder: Path) -> bytes:
        opened.append((folder / "w.bin").read_bytes())
        return opened[-1]

    folder, result = cache.load("k", build, open_folder)
    assert result == b"good" * 64 and cache.builds == 1
    (folder / "w.bin").write_bytes(b"evil" * 64)  # same size: only the hash can tell
    folder, result = cache.load("k", build, open_folder)
    assert opened[-2:] == [b"evil" * 64, b"good" * 64]
    assert result == b"good" * 64 and cache.builds == 2
    folder, result = cache.load("k", build, open_folder)  # intact: opened once, not rebuilt
    assert result == b"good" * 64 and cache.builds == 2 and len(opened) == 4
