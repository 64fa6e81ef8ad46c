"""Batched and mixed steps give each sequence the logits it gets alone: batched decode equals
decoding alone, bit for bit and against the numpy reference, a prefill chunk mixed into a decode
step equals each alone, and swapped KV rows carry their contents.

These are the numerics the concurrent engine's scheduling rests on, checked on `Model` directly
(no engine, no threads), so a failure here is the graphs' or the KV rows', not the scheduler's
(whose behaviour is `test_concurrent.py`).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from reference_forward import ReferenceModel
from synthetic import ARCHS, synthetic_gguf  # noqa: F401  (fixture)

from npuchat.engine.model import Model

STEPS = 12


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


@pytest.mark.parametrize("arch", [*ARCHS, "mistral"])
def test_batched_decode_equals_decoding_alone(synthetic_gguf, tmp_path: Path, arch: str) -> None:  # noqa: F811
    """Three sequences of different lengths decoded together in one batch give, row by row,
    the logits each gives alone (bit for bit, the production int8 path), and both agree with
    the numpy reference forward pass. Gemma 3 slides every other layer over 8 positions;
    "mistral" is llama with every layer sliding over 8 (the prompts run past both windows)."""
    if arch == "mistral":
        path = synthetic_gguf("llama", "q4_k", sliding_window=8)
    else:
        path = synthetic_gguf(arch, "q4_k")
    kw = {"cache_dir": tmp_path, "capacities": [64], "prefill_chunk": 16}
    prompts = [_prompt(200, n, seed) for seed, n in enumerate((5, 11, 17))]
    alone: list[list[np.ndarray]] = []
    with Model.load(path, **kw) as m:
        for p in prompts:
            m.rollback(0)
            rows = [m.prefill(p)]
            for _ in range(STEPS):
                rows.append(m.decode(int(np.argmax(rows[-1]))))
            alone.append(rows)
    with Model.load(path, batch_max=4, **kw) as m:
        batched = [[m.prefill(p, row=r)] for r, p in enumerate(prompts)]
        for _ in range(STEPS):
            tokens = [int(np.argmax(rows[-1])) for rows in batched]
            out = m.decode_batch(tokens, first_row=0)
            for rows, logits in zip(batched, out, strict=True):
                rows.append(logits)
        assert [m.length(r) for r in range(4)] == [len(p) + STEPS for p in prompts] + [0]
    ref = ReferenceModel(path)
    for p, want, got in zip(prompts, alone, batched, strict=True):
        for a, b in zip(want, got, strict=True):
            np.testing.assert_array_equal(a, b)
        seq = p + [int(np.argmax(r)) for r in got[:-1]]
        expect = ref.logits(seq)[len(p) - 1 :]
        scale = float(np.abs(expect).max())
        err = float(np.abs(np.stack(got) - expect).max()) / scale
        assert err <= 4e-2, f"{arch}: batched logits differ from the reference by {err:.2e}"


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_prefill_chunk_mixed_into_a_decode_step_equals_each_alone(
    synthetic_gguf,  # noqa: F811
    tmp_path: Path,
    arch: str,
) -> None:
    """One graph run holding two decode tokens and a 9-token prefill chunk (rows left-padded
    to one length) gives each row the logits it gets alone, bit for bit; the padding leaves
    nothing behind (the rows go on decoding exactly). A chunk whose logits are not wanted
    (`want`: not the last of its prompt) skips its logits row, and the rest is the same: the
    decode rows' logits, then the prompt's next chunk after its K/V."""
    path = synthetic_gguf(arch, "q4_k")
    kw = {"cache_dir": tmp_path, "capacities": [64], "prefill_chunk": 16}
    a, b, c = _prompt(200, 6, 1), _prompt(200, 13, 2), _prompt(200, 20, 3)
    chunk, rest = c[:9], c[9:]
    with Model.load(path, **kw) as m:
        want_a = [m.prefill(a)]
        want_a.append(m.decode(7))
        want_a.append(m.decode(8))
        m.rollback(0)
        want_b = [m.prefill(b)]
        want_b.append(m.decode(7))
        want_b.append(m.decode(8))
        m.rollback(0)
        want_c = [m.prefill(chunk), m.prefill(rest)]
    with Model.load(path, batch_max=4, **kw) as m:
        for want in (None, [True, True, False]):
            for r, ids in enumerate((a, b)):
                m.rollback(0, row=r)
                m.prefill(ids, row=r)
            m.rollback(0, row=2)
            mixed = m.step_rows([[7], [7], chunk], 0, want)
            assert [m.length(r) for r in range(3)] == [len(a) + 1, len(b) + 1, len(chunk)]
            assert len(mixed) == (3 if want is None else 2)
            np.testing.assert_array_equal(mixed[0], want_a[1])
            np.testing.assert_array_equal(mixed[1], want_b[1])
            if want is None:
                np.testing.assert_array_equal(mixed[2], want_c[0])
            after = m.step_rows([[8], [8], rest])
            np.testing.assert_array_equal(after[0], want_a[2])
            np.testing.assert_array_equal(after[1], want_b[2])
            np.testing.assert_array_equal(after[2], want_c[1])
    with Model.load(path, batch_max=2, **kw) as m:  # one logits row left: the decode's own
        m.prefill(a, row=0)
        mixed = m.step_rows([[7], chunk], 0, [True, False])
        assert mixed.shape[0] == 1
        np.testing.assert_array_equal(mixed[0], want_a[1])
        np.testing.assert_array_equal(m.step_rows([[8], rest])[1], want_c[1])


def test_rows_swap_with_their_contents(synthetic_gguf, tmp_path: Path) -> None:  # noqa: F811
    """Swapping two KV slots moves each sequence's K/V with it: decoding continues exactly."""
    path = synthetic_gguf("llama", "q8_0")
    with Model.load(path, cache_dir=tmp_path, capacities=[64], batch_max=2) as m:
        a, b = _prompt(200, 7, 1), _prompt(200, 12, 2)
        la, lb = m.prefill(a, row=0), m.prefill(b, row=1)
        want = m.decode_batch([int(np.argmax(la)), int(np.argmax(lb))])
        m.rollback(len(a), row=0)
        m.rollback(len(b), row=1)
        m.swap_rows(0, 1)
        assert (m.length(0), m.length(1)) == (len(b), len(a))
        got = m.decode_batch([int(np.argmax(lb)), int(np.argmax(la))])
        np.testing.assert_array_equal(got[::-1], want)


@pytest.mark.parametrize(
    ("arch", "kv_dtype"), [("llama", "f32"), ("qwen2", "int8"), ("gemma3", "f16")]
)
def test_a_short_row_beside_a_long_one_gets_the_logits_it_gets_alone(
    synthetic_gguf,  # noqa: F811
    tmp_path: Path,
    arch: str,
    kv_dtype: str,
) -> None:
    """Each step attends the cache slots its rows reach (a capacity variant), not the whole
    capacity: a short row decoded alone (16 slots), in a batch beside a long row (128) and
    beside a long prompt's chunk gives the same logits bit for bit, K/V in every dtype
    (gemma3: its sliding layers on rings), and they agree with the numpy reference."""
    path = synthetic_gguf(arch, "q4_k")
    kw = {"cache_dir": tmp_path, "capacities": [16, 32, 64, 128], "kv_dtype": kv_dtype}
    short, long = _prompt(200, 5, 1), _prompt(200, 90, 2)
    with Model.load(path, **kw) as m:
        alone = [m.prefill(short), m.decode(7), m.decode(8), m.decode(9)]
    with Model.load(path, batch_max=2, **kw) as m:
        m.prefill(short, row=0)
        m.prefill(long[:60], row=1)
        assert m.capacity == 64
        got = [m.decode_batch([7, 3], first_row=0)[0], m.step_rows([[8], long[60:80]])[0]]
        while not m.reserve(128):  # the cache at its largest, the short row's window 16
            time.sleep(0.01)  # (its pages are faulted in off the step path first)
        got.append(m.decode_batch([9], first_row=0)[0])
        assert m.capacity == 128
    for a, b in zip(alone[1:], got, strict=True):
        np.testing.assert_array_equal(a, b)
    expect = ReferenceModel(path).logits([*short, 7, 8, 9])[len(short) :]
    err = float(np.abs(np.stack(got) - expect).max()) / float(np.abs(expect).max())
    assert err <= 4e-2, f"{arch}: logits differ from the reference by {err:.2e}"


def test_a_step_reads_no_slot_past_its_rows_window(synthetic_gguf, tmp_path: Path) -> None:  # noqa: F811
    """A decode of a 6-slot row while the cache is at 128 slots reads only its first 16: the
    slots past them (garbage here: NaN) cannot reach its logits. (Reading the whole capacity,
    masked, both costs the attention of every slot and turns NaN into the result.)"""
    path = synthetic_gguf("llama", "q8_0")
    kw = {"cache_dir": tmp_path, "capacities": [16, 32, 64, 128]}
    prompt = _prompt(200, 5, 3)
    with Model.load(path, **kw) as m:
        want = [m.prefill(prompt), m.decode(7)]
    with Model.load(path, batch_max=2, **kw) as m:
        m.prefill(prompt, row=0)
        while not m.reserve(128):
            time.sleep(0.01)
        assert m.capacity == 128
        for layer in m._kv.k + m._kv.v:
            layer[0, :, 16:] = np.nan
        np.testing.assert_array_equal(m.decode_batch([7], first_row=0)[0], want[1])
