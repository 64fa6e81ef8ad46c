"""With the native kernels the graphs read the GGUF's blocks where they lie in the model file:
the graph cache holds no second copy of them (only rows regrouped for the kernels), and a
model file changed or cut short under cached graphs is never run with them (new graphs for new
bytes, a one-line error for a short file). Which blocks those are is indexed beside the graph,
so a start over built graphs never imports `onnx`; a damaged index is rebuilt or refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from npuchat.engine import runtime
from npuchat.engine.custom_ops import kernels_for
from npuchat.engine.errors import NpuchatError
from npuchat.engine.gguf_initializers import index_path
from npuchat.engine.gguf_reader import GGUFFile
from npuchat.engine.model import Model

if shutil.which("g++") is None or shutil.which("npm") is None:
    pytest.skip("building the kernels needs g++ and npm", allow_module_level=True)

IDS = [3, 14, 15, 92, 65, 35, 8, 97]


@pytest.fixture(autouse=True)
def native(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NPUCHAT_KERNELS", "on")


K_QUANTS = {"default": "q4_k", "attn_v": "q6_k", "ffn_down": "q6_k", "output": "q6_k"}
# qwen2.5-coder-0.5b's mix: widths that are no multiple of 256 take Q5_0 and Q8_0.
SMALL_MIX = {"default": "q5_0", "attn_v": "q8_0", "ffn_down": "q4_k", "output": "q8_0"}


def _copy(synthetic_gguf, tmp_path: Path, types: dict[str, str]) -> Path:
    path = tmp_path / "model.gguf"
    shutil.copyfile(synthetic_gguf("qwen2", types), path)
    return path


@pytest.fixture
def gguf(synthetic_gguf, tmp_path: Path) -> Path:
    """A private copy (the tests write into it) of a Q4_K_M-like qwen2 model."""
    return _copy(synthetic_gguf, tmp_path, K_QUANTS)


def _logits(path: Path, cache: Path) -> np.ndarray:
    with Model.load(path, cache_dir=cache, prefill_chunk=8, capacities=[32]) as m:
        return m.prefill(IDS)


def _tensor_bytes(path: Path) -> int:
    with GGUFFile(path) as g:
        return sum(t.n_bytes for t in g.tensors.values())


@pytest.mark.parametrize("types", [K_QUANTS, SMALL_MIX], ids=["k-quants", "q5_0-q8_0"])
def test_the_graph_cache_copies_only_the_regrouped_rows(
    synthetic_gguf, tmp_path: Path, types: dict[str, str]
) -> None:
    """Q4_K, Q6_K, Q8_0 and Q5_0 matrices are written regrouped eight rows at a time (Q4_K:
    1184 bytes for eight rows' 1152; the others the same size); the token embeddings stay in
    the GGUF."""
    gguf = _copy(synthetic_gguf, tmp_path, types)
    with Model.load(gguf, cache_dir=tmp_path / "c", prefill_chunk=8, capacities=[32]) as m:
        assert "MatMulNBits" not in m.kernels
        folder = m.graph_dir
        cached = sum(p.stat().st_size for p in folder.iterdir())
    with GGUFFile(gguf) as g:
        sizes = {name: (t.ggml_type, t.n_bytes) for name, t in g.tensors.items()}
    embd = sizes.pop("token_embd.weight")[1]
    q = GGMLQuantizationType
    q4k = sum(n for t, n in sizes.values() if t == q.Q4_K)
    same = sum(n for t, n in sizes.values() if t in (q.Q6_K, q.Q8_0, q.Q5_0))
    big = max(q4k, max(n for t, n in sizes.values() if t in (q.Q4_K, q.Q8_0, q.Q5_0)))
    # At most every such matrix regrouped (rows in sixteens) beside the graph, norms and biases,
    # at least the largest one; the embeddings are read from the GGUF.
    assert big <= cached < q4k * 1184 // 1152 + same + embd / 2, (cached, q4k, same, embd)


def test_a_gguf_rewritten_in_place_gets_new_graphs_not_its_old_ones(
    gguf: Path, tmp_path: Path
) -> None:
    """Same size, mtime set back: only the ctime tells. A norm's weights live in the graph
    cache's copy, so graphs reused from before would still compute with the old norm."""
    cache = tmp_path / "c"
    before = _logits(gguf, cache)
    with GGUFFile(gguf) as g:
        info = g.tensors["blk.0.attn_norm.weight"]
    st = gguf.stat()
    norm = np.fromfile(gguf, np.float32, info.n_bytes // 4, offset=info.offset)
    with gguf.open("r+b") as f:
        f.seek(info.offset)
        f.write((norm * 3).astype(np.float32).tobytes())
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert gguf.stat().st_size == st.st_size and gguf.stat().st_mtime_ns == st.st_mtime_ns
    after = _logits(gguf, cache)
    fresh = _logits(gguf, tmp_path / "fresh")  # the changed file with a cache of its own
    assert not np.allclose(after, before)
    np.testing.assert_array_equal(after, fresh)


def test_a_truncated_gguf_under_cached_graphs_is_a_one_line_error(
    gguf: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "c"
    _logits(gguf, cache)
    with gguf.open("r+b") as f:
        f.truncate(gguf.stat().st_size - 4096)
    with pytest.raises(NpuchatError) as err:
        _logits(gguf, cache)
    assert "truncated" in str(err.value) and "\n" not in str(err.value)


def test_graphs_opened_over_a_short_or_missing_gguf_are_refused(gguf: Path, tmp_path: Path) -> None:
    """The session's own check (a file cut after its digest was taken), and a graph opened
    without its GGUF: ONNX Runtime's read of the empty stand-in fails, it never runs."""
    with Model.load(gguf, cache_dir=tmp_path / "c", prefill_chunk=8, capacities=[32]) as m:
        graph = m.graph_dir / "decoder.onnx"
    kernels = kernels_for(4).path
    short = tmp_path / "short.gguf"
    short.write_bytes(gguf.read_bytes()[: gguf.stat().st_size // 2])
    with pytest.raises(NpuchatError, match="shorter than its built graphs expect") as err:
        runtime.create_session(graph, "cpu", 1, kernels, short)
    assert "\n" not in str(err.value)
    with pytest.raises(NpuchatError, match="could not load"):
        runtime.create_session(graph, "cpu", 1, kernels)


OPEN_BUILT = """
import sys
from pathlib import Path
import npuchat.app.cli, npuchat.app.engine_factory
from npuchat.engine.session import ChatSession
s = ChatSession.open(Path(sys.argv[1]), name="m", cache_dir=Path(sys.argv[2]), capacities=[32])
s.close()
print(sorted(m for m in ("onnx", "ml_dtypes") if m in sys.modules))
"""


def test_a_start_over_built_graphs_does_not_import_onnx(gguf: Path, tmp_path: Path) -> None:
    """`onnx` (and the `ml_dtypes` it loads, ~0.6 s) is for building graphs: the CLI and a
    session opened over a built folder, in a fresh interpreter, never import it."""
    cache = tmp_path / "c"
    _logits(gguf, cache)
    run = [sys.executable, "-c", OPEN_BUILT, str(gguf), str(cache)]
    out = subprocess.run(run, capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_damaged_tensor_index_is_rebuilt_and_a_missing_one_refused(
    gguf: Path, tmp_path: Path
) -> None:
    """An index entry whose length no longer matches its dims fails the folder's manifest:
    the graphs are built again and compute what they did. Opened directly, a graph whose
    index is missing or does not hold together is a one-line error, never mapped."""
    cache = tmp_path / "c"
    before = _logits(gguf, cache)
    with Model.load(gguf, cache_dir=cache, prefill_chunk=8, capacities=[32]) as m:
        graph = m.graph_dir / "decoder.onnx"
    index = index_path(graph)
    raw = json.loads(index.read_text())
    raw["tensors"][0]["length"] += 1
    index.write_text(json.dumps(raw))
    with Model.load(gguf, cache_dir=cache, prefill_chunk=8, capacities=[32]) as m:
        assert m._graph_cache.builds == 1
        np.testing.assert_array_equal(m.prefill(IDS), before)
    kernels = kernels_for(4).path
    damages = {"length": 7, "dtype": "object", "dims": "abc", "name": None}
    pristine = index.read_text()
    for damage in (*damages, "unhashable dtype", "missing"):
        raw = json.loads(pristine)  # one damage at a time
        if damage == "missing":
            index.unlink()
        else:
            raw["tensors"][-1][damage.split()[-1]] = damages.get(damage, [1])
            index.write_text(json.dumps(raw))
        with pytest.raises(NpuchatError, match="index of GGUF tensors") as err:
            runtime.create_session(graph, "cpu", 1, kernels, gguf)
        assert "\n" not in str(err.value)
