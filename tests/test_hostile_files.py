"""Hostile files: GGUF headers built to crash or exhaust the reader, model files damaged after
import, prefix snapshots with valid hashes but the wrong shape, build folders left by a killed
process, and paths that are not regular files. Each is refused with one line (or, for caches,
reported and rebuilt); none raises a traceback or allocates without bound."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from synthetic import write_synthetic_gguf

from npuchat.app.cli import main
from npuchat.engine.errors import NpuchatError
from npuchat.engine.gguf_reader import GGUFFile
from npuchat.engine.runtime import GraphCache
from npuchat.engine.tokenizer import Tokenizer

# ---- GGUF headers, written byte by byte ------------------------------------------------------

U32, I32, F32, STR, ARR, U64 = 4, 5, 6, 8, 9, 10


def _s(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _u32(key: str, value: int) -> bytes:
    return _kv(key, U32, struct.pack("<I", value))


def _f32(key: str, value: float) -> bytes:
    return _kv(key, F32, struct.pack("<f", value))


def _tensor(name: str, dims: tuple[int, ...], ttype: int = 0, offset: int = 0) -> bytes:
    return (
        _s(name)
        + struct.pack("<I", len(dims))
        + b"".join(struct.pack("<Q", d) for d in dims)
        + struct.pack("<IQ", ttype, offset)
    )


def _llama_kv(**override: bytes) -> list[bytes]:
    base = {
        "general.architecture": _kv("general.architecture", STR, _s("llama")),
        "llama.embedding_length": _u32("llama.embedding_length", 8),
        "llama.attention.head_count": _u32("llama.attention.head_count", 2),
        "llama.block_count": _u32("llama.block_count", 1),
        "llama.feed_forward_length": _u32("llama.feed_forward_length", 16),
        "llama.context_length": _u32("llama.context_length", 64),
        "llama.attention.layer_norm_rms_epsilon": _f32(
            "llama.attention.layer_norm_rms_epsilon", 1e-5
        ),
    }
    base.update(override)
    return list(base.values())


def _gguf(
    kv: list[bytes],
    tensors: list[bytes] | None = None,
    *,
    n_kv: int | None = None,
    n_tensors: int | None = None,
    data: bytes = b"\0" * 256,
) -> bytes:
    tensors = [_tensor("token_embd.weight", (8, 8))] if tensors is None else tensors
    head = struct.pack(
        "<4sIQQ",
        b"GGUF",
        3,
        len(tensors) if n_tensors is None else n_tensors,
        len(kv) if n_kv is None else n_kv,
    )
    body = head + b"".join(kv) + b"".join(tensors)
    return body + b"\0" * (-len(body) % 32) + data


def _nested(depth: int) -> bytes:
    return struct.pack("<I", ARR) + struct.pack("<IQ", ARR, 1) * depth + struct.pack("<IQ", U32, 0)


HOSTILE_GGUF: list[tuple[str, Callable[[], bytes], str]] = [
    (
        "head-count-zero",
        lambda: _gguf(_llama_kv(**{"h": _u32("llama.attention.head_count", 0)})),
        "head_count",
    ),
    (
        "kv-heads-not-dividing",
        lambda: _gguf(_llama_kv(kv=_u32("llama.attention.head_count_kv", 3))),
        "head_count_kv",
    ),
    ("alignment-zero", lambda: _gguf([*_llama_kv(), _u32("general.alignment", 0)]), "alignment"),
    ("alignment-odd", lambda: _gguf([*_llama_kv(), _u32("general.alignment", 3)]), "alignment"),
    (
        "alignment-a-string",
        lambda: _gguf([*_llama_kv(), _kv("general.alignment", STR, _s("x"))]),
        "alignment",
    ),
    (
        "nested-arrays",
        lambda: _gguf([*_llama_kv(), _s("deep") + _nested(100_000)]),
        "nested",
    ),
    (
        "dims-overflow-int64",
        lambda: _gguf(_llama_kv(), [_tensor("token_embd.weight", (2**32, 2**32))]),
        "token_embd.weight",
    ),
    (
        "too-many-dims",
        lambda: _gguf(_llama_kv(), [_tensor("token_embd.weight", (1,) * 100)]),
        "dimensions",
    ),
    ("huge-kv-count", lambda: _gguf(_llama_kv(), n_kv=2**62), "metadata entries"),
    ("huge-tensor-count", lambda: _gguf(_llama_kv(), n_tensors=2**62), "tensors"),
    (
        "huge-string-array",
        lambda: _gguf([*_llama_kv(), _kv("x", ARR, struct.pack("<IQ", STR, 2**40))]),
        "elements",
    ),
    (
        "rms-eps-nan",
        lambda: _gguf(_llama_kv(e=_f32("llama.attention.layer_norm_rms_epsilon", float("nan")))),
        "layer_norm_rms_epsilon",
    ),
    (
        "block-count-array",
        lambda: _gguf(_llama_kv(b=_kv("llama.block_count", ARR, struct.pack("<IQI", U32, 1, 2)))),
        "block_count",
    ),
]


def _open_all(path: Path) -> None:
    """Everything `npuchat import` and a model load read from the header."""
    with GGUFFile(path) as g:
        _ = g.config
        Tokenizer.from_gguf(g)
        sum(t.n_elements for t in g.tensors.values())


@pytest.mark.parametrize(("make", "needle"), [pytest.param(m, n, id=i) for i, m, n in HOSTILE_GGUF])
def test_hostile_gguf_headers_are_one_line_errors(
    tmp_path: Path, make: Callable[[], bytes], needle: str
) -> None:
    path = tmp_path / "hostile.gguf"
    path.write_bytes(make())
    with pytest.raises(NpuchatError) as err:
        _open_all(path)
    message = str(err.value)
    assert "\n" not in message and needle in message and "hostile.gguf" in message


def test_a_sparse_gguf_of_empty_strings_is_refused_before_it_allocates(tmp_path: Path) -> None:
    """60 MB of zero bytes read as 7.5 million empty strings: refused by count, not by RAM."""
    path = tmp_path / "sparse.gguf"
    head = _gguf([*_llama_kv(), _kv("x", ARR, struct.pack("<IQ", STR, 7_500_000))], data=b"")
    with path.open("wb") as f:
        f.write(head)
        f.truncate(len(head) + 60_000_000)
    tracemalloc.start()
    try:
        with pytest.raises(NpuchatError, match="elements"):
            GGUFFile(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzzed_gguf_headers_load_or_fail_with_one_line(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    base = tmp_path_factory.getbasetemp() / "fuzz-base.gguf"
    if not base.exists():
        write_synthetic_gguf(base, "llama", seed=1)
    raw = bytearray(base.read_bytes())
    header_end = min(len(raw), 40_000)  # metadata and tensor directory
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(4, header_end - 1))
        raw[at] = data.draw(st.integers(0, 255))
    path = tmp_path_factory.mktemp("fuzz") / "f.gguf"
    path.write_bytes(bytes(raw))
    try:
        _open_all(path)
    except NpuchatError as exc:
        assert "\n" not in str(exc)


# ---- paths that are not model files ----------------------------------------------------------


def _symlink_loop(tmp: Path) -> Path:
    (tmp / "a.gguf").symlink_to(tmp / "b.gguf")
    (tmp / "b.gguf").symlink_to(tmp / "a.gguf")
    return tmp / "a.gguf"


def _directory(tmp: Path) -> Path:
    (tmp / "dir.gguf").mkdir()
    return tmp / "dir.gguf"


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (_symlink_loop, "symbolic link"),
        (_directory, "is a directory"),
        (lambda tmp: Path("/dev/zero"), "not a regular file"),
    ],
)
def test_import_names_what_is_wrong_with_the_path(
    isolated_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], make, needle: str
) -> None:
    path = make(tmp_path)
    assert main(["import", str(path), "--name", "x"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


# ---- a model file damaged after import -------------------------------------------------------


def test_tensor_data_damaged_after_import_is_refused(
    syn: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--model", "syn", "-p", "hello", "-n", "2"]) == 0
    capsys.readouterr()
    with GGUFFile(syn) as g:
        info = g.tensors["blk.0.ffn_down.weight"]
    with syn.open("r+b") as f:  # same size, new bytes in the middle of a tensor
        f.seek(info.offset + info.n_bytes // 2)
        f.write(b"\x7f" * 64)
    assert main(["run", "--model", "syn", "-p", "hello", "-n", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "sha256" in captured.err and "syn.gguf" in captured.err
    assert "npuchat import" in captured.err and "Traceback" not in captured.err


# ---- build folders left by a killed process --------------------------------------------------


def test_stale_build_folders_of_dead_processes_are_removed(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], text=True, capture_output=True
    ).stdout.strip()
    cache = GraphCache(tmp_path)
    cache.root.mkdir(parents=True)
    stale = cache.root / f"abc.tmp-{dead}-123"
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "graph.onnx").write_bytes(b"x" * 1000)
    live = cache.root / f"abc.tmp-{os.getpid()}-456"  # a build in progress: kept
    live.mkdir()
    other = cache.root / "not-ours"
    other.mkdir()
    cache.get_or_build("def", lambda folder: (folder / "g.onnx").write_bytes(b"graph"))
    assert not stale.exists() and live.exists() and other.exists()
