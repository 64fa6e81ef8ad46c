"""Sliding-window layers keep only a ring of K/V rows: the memory it takes, logits against the
numpy reference long after the ring wrapped, exact speculation over the ring, and reuse of
cached or stored prefixes only where the ring still holds the rows they need.

Each model here has a window of 4 and steps of at most 4 rows (prefill chunk 4, verify k = 3),
so a ring holds R = 8 slots and an 80-token run wraps it ten times. Gemma 3 slides every other
layer ("gemma3": one ring layer, one full layer); "mistral" is llama with every layer sliding.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from reference_forward import ReferenceModel
from speculative_steps import decode_and_verify
from synthetic import write_synthetic_gguf

from npuchat.engine.errors import NpuchatError
from npuchat.engine.model import Model
from npuchat.engine.prefix_store import PrefixStore
from npuchat.engine.sequence import Sequence

WINDOW, CHUNK, K = 4, 4, 3
RING = WINDOW + CHUNK  # slots of a ring layer
TOL = 1e-5  # float activations, q8_0 weights: only float32 rounding (test_graphs.py says why)


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch = "gemma3" if request.param == "gemma3" else "llama"
    d = tmp_path_factory.mktemp(f"ring-{request.param}")
    return write_synthetic_gguf(d / "m.gguf", arch, seed=7, sliding_window=WINDOW)


def _load(path: Path, cache: Path, **kw: object) -> Model:
    opts: dict[str, object] = {
        "cache_dir": cache,
        "prefill_chunk": CHUNK,
        "verify_k": K,
        "capacities": [32, 128],
        "accuracy_level": 0,
    }
    return Model.load(path, **{**opts, **kw})  # type: ignore[arg-type]


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 200, n)]


def _close(got: np.ndarray, want: np.ndarray) -> None:
    err = float(np.abs(got - want).max()) / float(np.abs(want).max())
    assert err <= TOL, f"max|diff|/max|logit| = {err:.2e}"


def test_ring_layers_hold_only_their_ring(model_path: Path, tmp_path: Path) -> None:
    """The cache's bytes: full layers at the capacity, sliding layers at R slots."""
    with _load(model_path, tmp_path) as m:
        cfg = m.config
        m.prefill(_tokens(40, 1))  # capacity 32 -> 128
        slides = sum(cfg.swa_layers)
        per_slot = 2 * cfg.n_kv_heads * cfg.head_dim * 4  # K and V, f32
        want = ((cfg.n_layers - slides) * 128 + slides * RING) * per_slot
        assert slides > 0 and m.capacity == 128
        assert m.kv_bytes == want


def test_logits_match_reference_across_many_wraps(model_path: Path, tmp_path: Path) -> None:
    """Prefill chunks, decode, verify with a rollback, a prefill that moves the cache to the
    next capacity, then decode to position 80: every row equals the reference's."""
    seq = _tokens(80, 2)
    want = ReferenceModel(model_path).logits(seq)
    with _load(model_path, tmp_path) as m:
        _close(m.prefill(seq[:10]), want[9])
        for pos in range(10, 24):
            _close(m.decode(seq[pos]), want[pos])
        rows = m.verify(seq[24:28])
        for j, row in enumerate(rows):
            _close(row, want[24 + j])
        m.rollback(26)  # two drafts rejected: the ring still holds what row 26 needs
        _close(m.prefill(seq[26:45]), want[44])
        assert m.capacity == 128
        for pos in range(45, 80):
            _close(m.decode(seq[pos]), want[pos])


@pytest.mark.parametrize("kv_dtype", ["f32", "int8"])
def test_verify_equals_decode_bit_for_bit_after_wrapping(
    model_path: Path, tmp_path: Path, kv_dtype: str
) -> None:
    """At the production int8 activations, after the ring wrapped several times; int8 K/V
    moves its scales through the ring with its rows."""
    with _load(model_path, tmp_path, accuracy_level=4, kv_dtype=kv_dtype) as m:
        for ref, row in decode_and_verify(m, _tokens(37, 3), _tokens(4, 4)):
            assert np.array_equal(ref, row)


def test_rolling_back_past_the_ring_is_refused(model_path: Path, tmp_path: Path) -> None:
    """And a step longer than the ring's spare slots is refused (it would overwrite rows its
    own first queries still see)."""
    with _load(model_path, tmp_path) as m:
        with pytest.raises(NpuchatError, match="longer than the sliding-window rings"):
            m.step_rows([_tokens(CHUNK + 1, 5)])
        assert m.n_past == 0
        m.prefill(_tokens(40, 5))
        assert m.usable(40) == 40 and m.usable(37) == 37  # the last rows are all there
        assert m.usable(20) == 0  # positions 17..19 were overwritten long ago
        with pytest.raises(NpuchatError, match="sliding-window layers no longer hold"):
            m.rollback(20)
        assert m.n_past == 40
        m.rollback(0)  # starting over is always possible
        assert m.usable(0) == 0 and m.n_past == 0


def test_prefix_reuse_stops_where_the_ring_holds_it(model_path: Path, tmp_path: Path) -> None:
    """A new prompt sharing 20 tokens with a 40-token cache cannot reuse them (the ring lost
    rows 16..19): it reuses the 12-token prefix stored while it was held, and the reply's
    logits are the reference's. A snapshot taken after the wrap serves a prompt sharing 39
    tokens (its ring rows reach back far enough) but not one sharing 20; both survive disk."""
    a, b = _tokens(40, 6), _tokens(12, 7)
    ref = ReferenceModel(model_path)
    with _load(model_path, tmp_path) as m:
        seq, store = Sequence(m), PrefixStore("ring-test")
        seq.prefill(a[:12])
        store.put(a[:12], seq.kv_export)
        seq.prefill(a[12:])
        ids = a[:20] + b
        assert store.restore(seq, ids) == (12, "memory")
        _close(seq.prefill(ids[12:]), ref.logits(ids)[-1])

        disk = PrefixStore("ring-test", disk_dir=tmp_path / "prefixes")
        seq.rollback(0)
        seq.prefill(a)
        disk.persist(a, seq.kv_export)  # rows 0..31 of the ring layers are gone
        for shared, reused in ((39, 39), (20, 0)):
            fresh = PrefixStore("ring-test", disk_dir=tmp_path / "prefixes")
            other = Sequence(m, row=0)
            other.rollback(0)
            ids = a[:shared] + b
            got = fresh.restore(other, ids)
            assert got[0] == reused
            _close(other.prefill(ids[got[0] :]), ref.logits(ids)[-1])


def test_park_and_batched_steps_after_wrapping(model_path: Path, tmp_path: Path) -> None:
    """A sequence parked and resumed in another row past several wraps, and mixed steps (a
    decode row beside a prefill chunk) over two rings, give the reference's logits."""
    a, c = _tokens(50, 8), _tokens(30, 9)
    want_a, want_c = (ReferenceModel(model_path).logits(x) for x in (a, c))
    with _load(model_path, tmp_path, batch_max=2) as m:
        seq = Sequence(m, row=0)
        seq.prefill(a[:30])
        seq.park()
        seq.resume(1)
        _close(seq.decode(a[30]), want_a[30])
        other = Sequence(m, row=0)
        other.prefill(c[:2])
        for j in range(7):  # row 0 prefills c in chunks of 4 while row 1 decodes a
            chunk = c[2 + 4 * j : 6 + 4 * j]
            out = m.step_rows([chunk, [a[31 + j]]], first_row=0)
            _close(out[0], want_c[5 + 4 * j])
            _close(out[1], want_a[31 + j])


def test_capacities_below_the_ring_grow_into_it_and_back(model_path: Path, tmp_path: Path) -> None:
    """At capacity 6 a ring layer holds 6 slots (slot = position); moving to 32 makes it a
    ring of 8, and after a new conversation the cache moves back down: each layout gives the
    reference's logits."""
    seq, other = _tokens(30, 10), _tokens(20, 11)
    ref = ReferenceModel(model_path)
    want, want_other = ref.logits(seq), ref.logits(other)
    with _load(model_path, tmp_path, capacities=[6, 32]) as m:
        _close(m.prefill(seq[:5]), want[4])
        assert m.capacity == 6
        for pos in range(5, 30):  # 6 -> 32 at position 6, then wraps of the 8-slot ring
            _close(m.decode(seq[pos]), want[pos])
        m.rollback(0)
        _close(m.prefill(other[:4]), want_other[3])
        assert m.capacity == 6
        for pos in range(4, 20):
            _close(m.decode(other[pos]), want_other[pos])
