"""Hostile prefix snapshots: headers and arrays of the wrong shape, written with a matching hash
as any program could. Each is reported once, never loaded, and rebuilt by the next prefill; a
run that meets one still answers."""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npuchat.app.cli import main
from npuchat.engine.kvcache import KVSnapshot
from npuchat.engine.prefix_store import PrefixStore

# ---- prefix snapshots of the wrong shape ------------------------------------------------------

LAYERS, HEADS, DIM = 2, 2, 4


def _rows(tokens: list[int]) -> Callable[[int, int], KVSnapshot]:
    def rows(start: int, end: int) -> KVSnapshot:
        def layer(i: int) -> np.ndarray:
            return np.full((1, HEADS, end - start, DIM), i, dtype=np.float32)

        return KVSnapshot(
            start, [layer(i) for i in range(LAYERS)], [layer(i) for i in range(LAYERS)]
        )

    return rows


def _npz(arrays: dict[str, np.ndarray], allow_pickle: bool = False) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, allow_pickle=allow_pickle, **arrays)
    return buf.getvalue()


def _rewrite(head: Path, body: Path, header: object, npz: bytes | None = None) -> None:
    """Replace a stored prefix with `header` (and body), the body's hash made to match, as a
    tool or another program could write it."""
    if npz is not None:
        body.write_bytes(npz)
    if isinstance(header, dict) and "sha256" in header:
        header["sha256"] = hashlib.sha256(body.read_bytes()).hexdigest()
    head.write_text(json.dumps(header))


def _good_header(tokens: list[int], body: Path) -> dict[str, object]:
    return {
        "format": 1,
        "layout": "layout",
        "tokens": tokens,
        "layers": LAYERS,
        "sha256": "",
        "bytes": body.stat().st_size,
    }


TOKENS = list(range(1, 30))
ROWS = _rows(TOKENS)(0, len(TOKENS))
WRONG_SHAPES: list[tuple[str, Callable[[Path], object], Callable[[], bytes | None]]] = [
    ("null", lambda b: None, lambda: None),
    ("a-list", lambda b: [1, 2], lambda: None),
    (
        "no-layers",
        lambda b: {k: v for k, v in _good_header(TOKENS, b).items() if k != "layers"},
        lambda: None,
    ),
    ("tokens-not-ints", lambda b: {**_good_header(TOKENS, b), "tokens": ["a"] * 29}, lambda: None),
    ("tokens-a-dict", lambda b: {**_good_header(TOKENS, b), "tokens": {"a": 1}}, lambda: None),
    ("layers-huge", lambda b: {**_good_header(TOKENS, b), "layers": 10**9}, lambda: None),
    ("layers-a-string", lambda b: {**_good_header(TOKENS, b), "layers": "2"}, lambda: None),
    (
        "rows-fewer-than-tokens",
        lambda b: _good_header(TOKENS, b),
        lambda: _npz(
            {
                f"{kv}{i}": a[:, :, :5]
                for kv, arrs in (("k", ROWS.k), ("v", ROWS.v))
                for i, a in enumerate(arrs)
            }
        ),
    ),
    (
        "a-layer-missing",
        lambda b: _good_header(TOKENS, b),
        lambda: _npz({"k0": ROWS.k[0], "v0": ROWS.v[0], "k1": ROWS.k[1]}),
    ),
    (
        "object-arrays",
        lambda b: _good_header(TOKENS, b),
        lambda: _npz(
            {f"{kv}{i}": np.array([object()] * 3) for kv in "kv" for i in range(2)},
            allow_pickle=True,
        ),
    ),
    (
        "strings-not-floats",
        lambda b: _good_header(TOKENS, b),
        lambda: _npz(
            {f"{kv}{i}": np.full((1, HEADS, 29, DIM), "x") for kv in "kv" for i in range(2)}
        ),
    ),
]


@pytest.mark.parametrize(("header", "body"), [pytest.param(h, b, id=i) for i, h, b in WRONG_SHAPES])
def test_a_prefix_snapshot_of_the_wrong_shape_is_reported_and_rebuilt(
    tmp_path: Path,
    header: Callable[[Path], object],
    body: Callable[[], bytes | None],
) -> None:
    PrefixStore("layout", disk_dir=tmp_path).persist(TOKENS, _rows(TOKENS))
    (head_path,) = tmp_path.rglob("*.json")
    body_path = head_path.with_suffix(".npz")
    _rewrite(head_path, body_path, header(body_path), body())
    store = PrefixStore("layout", disk_dir=tmp_path)
    assert store.lookup([*TOKENS, 99], 100) is None
    assert any(head_path.stem[:12] in w for w in store.warnings), store.warnings
    store.persist(TOKENS, _rows(TOKENS))  # the next prefill rebuilds it
    hit = PrefixStore("layout", disk_dir=tmp_path).lookup([*TOKENS, 99], 100)
    assert hit is not None and hit.length == len(TOKENS)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    extra=st.dictionaries(
        st.sampled_from(["format", "layout", "tokens", "layers", "sha256", "bytes"]), json_values
    ),
    whole=st.none() | json_values,
)
def test_fuzzed_prefix_headers_never_break_a_lookup(
    tmp_path_factory: pytest.TempPathFactory, extra: dict[str, object], whole: object
) -> None:
    folder = tmp_path_factory.mktemp("prefix")
    PrefixStore("layout", disk_dir=folder).persist(TOKENS, _rows(TOKENS))
    (head_path,) = folder.rglob("*.json")
    body_path = head_path.with_suffix(".npz")
    header: object = whole if whole is not None else {**_good_header(TOKENS, body_path), **extra}
    _rewrite(head_path, body_path, header)
    hit = PrefixStore("layout", disk_dir=folder).lookup([*TOKENS, 99], 100)
    if hit is not None:  # only a header that still describes the stored rows may be used
        assert hit.length == len(TOKENS) and all(a.shape[2] == len(TOKENS) for a in hit.snapshot.k)


def test_run_recovers_from_a_null_prefix_header(
    syn: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["run", "--model", "syn", "-p", "hello", "-n", "2", "--system", "Be brief."]
    assert main(args) == 0
    capsys.readouterr()
    from npuchat.engine.paths import Paths

    (head,) = Paths.from_env().cache_dir.rglob("prefixes/**/*.json")
    head.write_text("null")
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and head.stem[:12] in captured.err
    assert isinstance(json.loads(head.read_text()), dict)  # rebuilt
