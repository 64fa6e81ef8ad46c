"""`Model`: the public generation API, its KV-cache semantics, and real-model agreement with
llama.cpp's greedy continuations and log-probabilities."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from real_models import REFERENCE_DIR, cache_root
from reference_forward import ReferenceModel, log_softmax

from npuchat.engine.errors import NpuchatError
from npuchat.engine.kvcache import KVCache
from npuchat.engine.model import Model, default_capacities


@pytest.fixture
def model(synthetic_gguf, tmp_path: Path):
    path = synthetic_gguf("qwen2", "q4_k")
    with Model.load(
        path, cache_dir=tmp_path, prefill_chunk=16, verify_k=4, capacities=[32, 64]
    ) as m:
        yield m


def _ids(model: Model, n: int, seed: int = 3) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, model.config.vocab_size, n)]


def _close(a: np.ndarray, b: np.ndarray, rel: float = 1e-5) -> None:
    np.testing.assert_allclose(a, b, rtol=0, atol=rel * float(np.abs(b).max()))


def test_prefill_then_decode_equals_whole_prefill(model: Model) -> None:
    ids = _ids(model, 30)
    whole = model.prefill(ids)
    model.rollback(0)
    model.prefill(ids[:21])
    for t in ids[21:-1]:
        model.decode(t)
    _close(model.decode(ids[-1]), whole)
    assert model.n_past == 30


@pytest.mark.parametrize("accuracy_level", [0, 4])
def test_verify_rows_equal_decode_rows(
    synthetic_gguf,
    tmp_path: Path,
    accuracy_level: int,
) -> None:
    """Speculative decoding relies on verify == decode row by row.

    With float activations they agree to float32 rounding (1e-5). With int8 activations (the
    fast path) they agree only to the int8 noise: the batched and the single-row MatMulNBits
    kernels differ by ~3e-7 relative (measured), and an activation that sits on an int8
    rounding boundary then rounds differently and the difference cascades through later layers
    (measured up to 9e-3 of the logit scale here), so the bound is the same 4e-2 as against the
    reference, and the argmax must agree.
    """
    path = synthetic_gguf("qwen2", "q4_k")
    with Model.load(
        path,
        cache_dir=tmp_path,
        prefill_chunk=16,
        verify_k=4,
        capacities=[32, 64],
        accuracy_level=accuracy_level,
    ) as model:
        ids = _ids(model, 45)
        for start in (20, 40):  # two fill levels, the second in the larger capacity
            model.rollback(0)
            model.prefill(ids[:start])
            rows = model.verify(ids[start : start + 5])
            assert rows.shape == (5, model.config.vocab_size)
            model.rollback(start)
            for j, t in enumerate(ids[start : start + 5]):
                got = model.decode(t)
                _close(rows[j], got, 1e-5 if accuracy_level == 0 else 4e-2)
                assert int(rows[j].argmax()) == int(got.argmax())


def test_rollback_and_kv_export_import_roundtrip(model: Model) -> None:
    ids = _ids(model, 40)
    model.prefill(ids[:35])
    expect = model.decode(ids[35])
    snap = model.kv_export(0, 35)
    assert snap.length == 35 and snap.nbytes == 2 * 2 * 35 * 2 * 64 * 4  # 2 layers, 2 kv heads
    model.rollback(3)
    model.prefill(_ids(model, 10, seed=9))  # overwrite slots 3..12 with something else
    model.rollback(0)
    model.kv_import(snap, 0)
    assert model.n_past == 35 and model.capacity == 64
    _close(model.decode(ids[35]), expect)
    with pytest.raises(NpuchatError, match="roll back"):
        model.rollback(37)
    with pytest.raises(NpuchatError, match="export"):
        model.kv_export(0, 37)


def test_capacity_is_the_smallest_that_fits(synthetic_gguf, tmp_path: Path) -> None:
    path = synthetic_gguf("llama", "q8_0")
    with Model.load(path, cache_dir=tmp_path, prefill_chunk=8, capacities=[64, 16, 32]) as m:
        ids = _ids(m, 40)
        assert (m.capacity, m.max_capacity) == (16, 64)
        m.prefill(ids[:16])
        assert m.capacity == 16
        m.decode(ids[16])
        assert m.capacity == 32
        m.prefill(ids[17:37])
        assert (m.capacity, m.n_past) == (64, 37)
        expect = m.decode(ids[37])
        m.rollback(10)  # after a rollback the next step moves back down, keeping the rows
        m.prefill(ids[10:20])
        assert (m.capacity, m.n_past) == (32, 20)
        m.prefill(ids[20:37])
        assert m.capacity == 64
        _close(m.decode(ids[37]), expect)


def test_bad_input_gives_one_line_errors(model: Model) -> None:
    with pytest.raises(NpuchatError, match="outside the vocabulary"):
        model.prefill([model.config.vocab_size])
    with pytest.raises(NpuchatError, match="at least one token"):
        model.prefill([])
    with pytest.raises(NpuchatError, match=r"verify takes 1\.\.5 tokens"):
        model.verify(_ids(model, 6))
    assert model.n_past == 0
    model.close()
    with pytest.raises(NpuchatError, match="closed"):
        model.decode(1)


def test_load_rejects_bad_options(synthetic_gguf, tmp_path: Path) -> None:
    path = synthetic_gguf("llama", "q8_0")
    with pytest.raises(NpuchatError, match="unknown device"):
        Model.load(path, cache_dir=tmp_path, device="tpu")
    with pytest.raises(NpuchatError, match="exceeds"):
        Model.load(path, cache_dir=tmp_path, capacities=[1 << 20])


def test_kv_mask_hides_unused_slots_and_padding() -> None:
    kv = KVCache(1, 1, 4, [8])
    kv.n = 3
    m = kv.mask(4, pad=1)[0, 0] == 0
    assert m.shape == (4, 12)
    assert not m[0, :8].any() and m[0, 8] and not m[0, 9:].any()  # padding row: itself only
    for i in range(1, 4):
        assert m[i, :3].all() and not m[i, 3:8].any()  # valid past slots only
        assert (m[i, 8:] == [False, *(j <= i for j in range(1, 4))]).all()  # causal, no pad


def test_default_capacities() -> None:
    assert default_capacities(32768)[:9] == [256, 512, 768, 1024, 1280, 1536, 1792, 2048, 3072]
    assert default_capacities(32768)[-1] == 8192
    assert default_capacities(2048) == [256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert default_capacities(300) == [256, 300]
    assert default_capacities(100) == [100]
    assert default_capacities(32768, 16384)[-3:] == [14336, 15360, 16384]  # `--context 16384`
    assert default_capacities(32768, 1000)[-2:] == [768, 1000]


def test_context_sets_how_far_the_cache_may_grow(synthetic_gguf, tmp_path: Path) -> None:
    """The cache grows to 8,192 tokens by default, to what `context` asks up to the model's
    trained context, and a context beyond that is a one-line error."""
    path = synthetic_gguf("llama", "q8_0", context_length=16384)
    with Model.load(path, cache_dir=tmp_path) as m:
        assert m.max_capacity == 8192
    with Model.load(path, cache_dir=tmp_path, context=12000) as m:
        assert m.max_capacity == 12000
    with Model.load(path, cache_dir=tmp_path, context=300) as m:
        assert m.max_capacity == 300
    for asked in (16385, 100):
        with pytest.raises(NpuchatError, match="holds 256 to 16384") as refused:
            Model.load(path, cache_dir=tmp_path, context=asked)
        assert len(str(refused.value).splitlines()) == 1


def test_engine_graphs_match_reference_after_rope_permutation(
    synthetic_gguf,
    tmp_path: Path,
) -> None:
    """llama's Q/K rows are permuted back to NEOX layout; K rows in the cache must still agree
    with a reference that uses llama.cpp's adjacent-pair rotary (checked through the logits of a
    long decode, where every cached K row matters)."""
    path = synthetic_gguf("llama", "f32")
    ref = ReferenceModel(path)
    ids = [int(t) for t in np.random.default_rng(5).integers(0, ref.config.vocab_size, 48)]
    expect = ref.logits(ids)
    with Model.load(
        path, cache_dir=tmp_path, prefill_chunk=16, capacities=[64], accuracy_level=0
    ) as m:
        m.prefill(ids[:2])
        for pos in range(2, 48):
            _close(m.decode(ids[pos]), expect[pos])


# --------------------------------------------------------------------------- real models
#
# llama.cpp's numerics differ from exact float math (int8 activations, f16 KV cache), and so do
# ours (int8 activations). Measured on these prompts, teacher-forced, against the engine at
# accuracy_level=0 (exact math: it equals the independent ReferenceModel to ~1e-6):
#
#   smollm2-135m, top-5 log-probs   |llama.cpp − exact|   |ours − exact|
#                                    max 1.44, mean 0.129   max 1.14, mean 0.115
#
# Both engines are the same distance from exact math, so they disagree with each other by up to
# ~1 on this small, rounding-sensitive model: at steps where llama.cpp's top-1/top-2 gap is at
# least 0.15, exact math picks a different token once in 91 steps, our int8 path three times
# (gaps 0.22, 0.30, 0.99). A bound like "greedy equal until the first gap < 0.1, top-5 within
# 0.15" therefore cannot hold for smollm2 even for exact math; what is asserted is agreement on
# ≥ 93% of those steps and the measured log-prob distances with some room. Qwen2.5-Coder-0.5B is
# better conditioned: every step with a gap ≥ 0.15 must agree (exact math ranks one token 0.126
# below llama.cpp's top-1 first, so 0.1 is too tight), log-probs within 0.5 (measured max 0.31,
# mean 0.051 with per-lane float sums; 0.40 and 0.057 with exact integer sums per block, which
# move each result by an ulp; exact math: max 0.28, mean 0.04). An ulp upstream flips the
# rounding of some int8 activations, so each scheme draws its own sample of int8 noise: against
# the numpy float forward both sit 0.22-0.32 (max) and RMS 0.06 away on the same tokens.
# Decoding is teacher-forced on llama.cpp's tokens, so every non-tie step is compared, not only
# those before the first tie.

TIE_GAP = 0.15
# model: (share of non-tie steps whose argmax must match, max |Δ log-prob|, mean |Δ|)
LLAMA_CPP_BOUNDS = {
    "smollm2-135m": (0.93, 1.5, 0.2),
    "qwen2.5-coder-0.5b": (1.0, 0.5, 0.1),
    # Measured: 133 of 133 decided steps equal; top-5 error mean 0.14, p90 0.33, max 2.0 (on
    # low-probability tokens: int8 activations here, llama.cpp's Q8 activations and fp16 KV).
    "gemma3-270m": (0.98, 2.5, 0.2),
}


@pytest.mark.realmodel
@pytest.mark.parametrize("name", list(LLAMA_CPP_BOUNDS))
def test_real_model_agrees_with_llama_cpp(real_gguf, tmp_path: Path, name: str) -> None:
    cases = json.loads((REFERENCE_DIR / f"greedy-{name}.json").read_text())["cases"]
    min_agree, max_bound, mean_bound = LLAMA_CPP_BOUNDS[name]
    errors: list[float] = []
    disagreements: list[str] = []
    compared = 0
    graphs = cache_root() / "graphs"  # built once per builder version
    with Model.load(real_gguf(name), cache_dir=graphs, capacities=[256], threads=2) as m:
        for case in cases:
            m.rollback(0)
            logprobs = [log_softmax(m.prefill(case["prompt_ids"]).astype(np.float64))]
            for t in case["greedy_ids"][:-1]:  # teacher-forced on llama.cpp's tokens
                logprobs.append(log_softmax(m.decode(t).astype(np.float64)))
            for i, (step, row) in enumerate(zip(case["steps"], logprobs, strict=True)):
                top = step["top"]
                if top[0]["logprob"] - top[1]["logprob"] >= TIE_GAP:
                    compared += 1
                    if int(row.argmax()) != step["id"]:
                        disagreements.append(f"step {i} of {case['prompt'][-60:]!r}")
                errors += [abs(row[e["id"]] - e["logprob"]) for e in top]
    assert compared >= 60  # the greedy comparison is not vacuous
    assert len(disagreements) <= (1 - min_agree) * compared, disagreements
    assert max(errors) <= max_bound and float(np.mean(errors)) <= mean_bound, (
        f"{name}: top-5 log-prob error max {max(errors):.3f}, mean {np.mean(errors):.3f}"
    )


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_releasing_a_stale_range_never_changes_what_it_now_holds() -> None:
    """The release reads the weight file's ranges while ONNX Runtime still loads; a range it
    unmaps meanwhile can be reused by the heap before the advice lands. Written memory at such
    an address must keep its bytes (the old advice zeroed it: wrong logits, then an abort in
    free())."""
    import ctypes
    import mmap

    from npuchat.engine.process_memory import release_ranges

    size = 16 * mmap.PAGESIZE
    heap = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)  # heap pages where a file was mapped
    pattern = bytes(range(256)) * (size // 256)
    heap[:] = pattern
    view = ctypes.c_char.from_buffer(heap)
    start = ctypes.addressof(view)
    release_ranges([(start, start + size)])
    del view
    assert heap[:] == pattern
    heap.close()


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_load_gives_back_the_weight_pages_onnx_runtime_no_longer_reads(
    synthetic_gguf, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ONNX Runtime keeps each prepacked weight's `scales` mapped although it reads its packed
    copy (184 MiB of RSS for qwen2.5-coder-1.5b): the load drops those pages, and generation
    afterwards neither needs them back nor changes (the release only affects residency).
    The native kernels read their blocks from the mapped file instead (nothing is prepacked)."""
    from npuchat.engine.graph_key import WEIGHTS_FILE
    from npuchat.engine.process_memory import mapped_ranges

    monkeypatch.setenv("NPUCHAT_KERNELS", "off")
    path = synthetic_gguf("qwen2", "q4_k")
    model = Model.load(path, cache_dir=tmp_path, prefill_chunk=16, capacities=[32, 64])

    weights = model.graph_dir / WEIGHTS_FILE
    assert mapped_ranges(weights), "ONNX Runtime no longer maps the weights: revisit the release"
    assert model.released_bytes > 0

    def resident_kib() -> int:
        ranges = {(start, end) for start, end, _ in mapped_ranges(weights)}
        total, inside = 0, False
        for line in Path("/proc/self/smaps").read_text().splitlines():
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = (start, end) in ranges
            elif inside and head == "Rss:":
                total += int(line.split()[1])
        return total

    ids = _ids(model, 20)
    first = model.prefill(ids)
    # what the graph reads from the file directly: a page or two per norm and per bias (one
    # may straddle pages, and the kernel's MADV_PAGEOUT may leave a page or its fault path map
    # a neighbour: 28 KiB alone, 36 KiB once inside the suite), far below the pages the
    # release dropped (188 KiB here), which generation must not read back
    resident = resident_kib()
    assert resident <= 8 * (3 * model.config.n_layers + 2)
    assert resident * 1024 < model.released_bytes / 2
    model.rollback(0)
    np.testing.assert_array_equal(model.prefill(ids), first)
    model.close()
