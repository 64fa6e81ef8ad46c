"""KV caches stored as f16 or int8: the graphs against the numpy reference rounding K/V the same
way, greedy agreement with f32, and snapshots that never cross between dtypes.

Tolerance against the reference with the same K/V rounding, relative to the largest |logit|, at
`accuracy_level=0` (float activations, q8_0 weights): 1e-4. The reference rounds float64 rows
and the graph float32 ones, so now and then one value lands on the other side of a rounding
boundary (one int8 step, 1/254 of its head's range; one f16 ulp); measured ≤ 4e-5. Against
the plain f32 reference the same logits differ by 2.6e-4 to 8e-3 (measured), which the test
requires too: the rounding really happens inside the graph.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from reference_forward import ReferenceModel, log_softmax
from test_graphs import CAPS, P, scripted_run

from npuchat.app.cli import main
from npuchat.app.settings import set_setting
from npuchat.engine.custom_ops import kernels_for
from npuchat.engine.errors import NpuchatError
from npuchat.engine.gguf_reader import GGUFFile
from npuchat.engine.kv_layout import KVSnapshot
from npuchat.engine.kv_smoothing import k_smoothing
from npuchat.engine.model import Model
from npuchat.engine.paths import Paths
from npuchat.engine.prefix_store import PrefixStore

TOL = 1e-4


def _load(path: Path, cache: Path, kv_dtype: str, **kw: object) -> Model:
    return Model.load(
        path,
        cache_dir=cache,
        prefill_chunk=P,
        verify_k=4,
        capacities=CAPS,
        kv_dtype=kv_dtype,
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("kv_dtype", ["f16", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_graphs_match_reference_with_the_same_kv_rounding(
    synthetic_gguf, tmp_path: Path, arch: str, kv_dtype: str
) -> None:
    """Prefill, decode, verify, rollback, a capacity move and a full cache, every row checked."""
    path = synthetic_gguf(arch, "q8_0")
    seq = [int(t) for t in np.random.default_rng(7).integers(0, 100, 64)]
    expect = ReferenceModel(path, kv_dtype=kv_dtype).logits(seq)
    plain = ReferenceModel(path).logits(seq)
    scale = float(np.abs(expect).max())
    with _load(path, tmp_path, kv_dtype, accuracy_level=0) as model:
        assert model.kv_dtype == kv_dtype
        rows = scripted_run(model, seq)
    errs = {pos: float(np.abs(row - expect[pos]).max()) / scale for pos, row in rows.items()}
    worst = max(errs, key=errs.__getitem__)
    assert errs[worst] <= TOL, f"position {worst}: {errs[worst]:.2e} > {TOL:.0e}"
    off_f32 = max(float(np.abs(row - plain[pos]).max()) / scale for pos, row in rows.items())
    assert off_f32 > 3 * errs[worst], "the K/V rounding did not change the logits"


def _mean_kl(want: np.ndarray, got: np.ndarray) -> float:
    lw, lg = log_softmax(want), log_softmax(got)
    return float((np.exp(lw) * (lw - lg)).sum(axis=-1).mean())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "gemma3"])
def test_k_smoothing_scales_exactly_the_outlier_channels(synthetic_gguf, arch: str) -> None:
    """Channels 1 and 5 of every K head made 16x larger (weights, bias, K norm): they and their
    rotary partners get a power of two of 8 or 16, every other channel 1; a model without
    outliers is left unscaled."""
    with GGUFFile(synthetic_gguf(arch, "q8_0", k_outliers=16.0)) as g:
        dh, smooth = g.config.head_dim, k_smoothing(g)
    partners = [0, 4] if arch == "llama" else [1 + dh // 2, 5 + dh // 2]  # llama: file order
    for s in smooth:
        assert s.shape == (2, dh)
        for head in s:
            assert set(np.flatnonzero(head != 1)) == {1, 5, *partners}
            assert set(head[[1, 5, *partners]]) <= {8.0, 16.0}
    with GGUFFile(synthetic_gguf(arch, "q8_0")) as g:
        assert all((s == 1).all() for s in k_smoothing(g))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_int8_k_smoothing_matches_the_reference_and_beats_per_head_scales(
    synthetic_gguf, tmp_path: Path, arch: str
) -> None:
    """K with outlier channels: the graph's int8 cache (K smoothed) gives the reference's
    logits for the same scheme at every step, and stays closer to f32 than one scale per
    (token, head) without smoothing does (mean KL of the next-token distributions)."""
    path = synthetic_gguf(arch, "q8_0", k_outliers=16.0)
    seq = [int(t) for t in np.random.default_rng(7).integers(0, 100, 64)]
    expect = ReferenceModel(path, kv_dtype="int8").logits(seq)
    plain = ReferenceModel(path).logits(seq)
    per_head = ReferenceModel(path, kv_dtype="int8", smooth_k=False).logits(seq)
    scale = float(np.abs(expect).max())
    with _load(path, tmp_path, "int8", accuracy_level=0) as model:
        rows = scripted_run(model, seq)
    pos = sorted(rows)
    got = np.stack([rows[p] for p in pos])
    errs = np.abs(got - expect[pos]).max(axis=1) / scale
    # A value on the other side of a rounding boundary (float32 graph, float64 reference) is
    # now s times one int8 step: up to 16x the flips of unsmoothed rows (measured 1.8e-4 on
    # one row of 19); the other rows agree to float32 rounding.
    assert errs.max() <= 5 * TOL and np.median(errs) <= 1e-5, errs
    smoothed, unsmoothed = _mean_kl(plain[pos], got), _mean_kl(plain[pos], per_head[pos])
    assert smoothed < 0.8 * unsmoothed, f"KL {smoothed:.2e} vs per-head {unsmoothed:.2e}"


def test_int8_rows_of_a_batch_move_with_their_scales(synthetic_gguf, tmp_path: Path) -> None:
    """Two sequences in one int8 cache: a batched decode, a row swap and a park/resume (export
    then import) keep each sequence's rows and scales together: logits as the reference's."""
    path = synthetic_gguf("qwen2", "q8_0")
    rng = np.random.default_rng(3)
    a, b = ([int(t) for t in rng.integers(0, 100, 24)] for _ in range(2))
    ref = ReferenceModel(path, kv_dtype="int8")
    want_a, want_b = ref.logits(a), ref.logits(b)
    scale = float(max(np.abs(want_a).max(), np.abs(want_b).max()))
    with _load(path, tmp_path, "int8", accuracy_level=0, batch_max=2) as model:
        model.prefill(a[:20], row=0)
        model.prefill(b[:20], row=1)
        got = model.decode_batch([a[20], b[20]], first_row=0)
        model.swap_rows(0, 1)  # b in row 0 now
        parked = model.kv_export(0, model.length(1), row=1)
        model.rollback(0, row=1)
        got_b = model.decode(b[21], row=0)
        model.kv_import(parked, 0, row=1)
        got_a = model.decode(a[21], row=1)
    for row, want in ((got[0], want_a[20]), (got[1], want_b[20]), (got_a, want_a[21])):
        assert float(np.abs(row - want).max()) / scale <= TOL
    assert float(np.abs(got_b - want_b[21]).max()) / scale <= TOL


@pytest.mark.parametrize("kv_dtype", ["f16", "int8"])
def test_verify_rows_equal_decode_bit_for_bit(
    synthetic_gguf, tmp_path: Path, kv_dtype: str
) -> None:
    """What exact speculative decoding rests on holds for converted caches too: each row is
    rounded alone, so k+1 rows verified at once give the logits of k+1 decode steps (int8:
    with K smoothed, on a model whose K has outlier channels)."""
    path = synthetic_gguf("qwen2", "q4_k", k_outliers=16.0 if kv_dtype == "int8" else 1.0)
    ids = [int(t) for t in np.random.default_rng(9).integers(0, 100, 17)]
    with _load(path, tmp_path, kv_dtype) as model:
        model.prefill(ids[:12])
        decoded = np.stack([model.decode(t) for t in ids[12:]])
        model.rollback(12)
        verified = model.verify(ids[12:])
    assert np.array_equal(decoded, verified)


def test_int8_batched_decode_equals_decoding_alone(synthetic_gguf, tmp_path: Path) -> None:
    """Two sequences decoded together in an int8 cache with K smoothed give, bit for bit, the
    logits each gives alone (each row is quantized on its own when written)."""
    path = synthetic_gguf("qwen2", "q4_k", k_outliers=16.0)
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(0, 100, n)] for n in (7, 13)]
    alone = []
    with _load(path, tmp_path, "int8") as model:
        for p in prompts:
            model.rollback(0)
            rows = [model.prefill(p)]
            for _ in range(6):
                rows.append(model.decode(int(np.argmax(rows[-1]))))
            alone.append(rows)
    with _load(path, tmp_path, "int8", batch_max=2) as model:
        together = [[model.prefill(p, row=r)] for r, p in enumerate(prompts)]
        for _ in range(6):
            out = model.decode_batch([int(np.argmax(r[-1])) for r in together], first_row=0)
            for rows, logits in zip(together, out, strict=True):
                rows.append(logits)
    for want, got in zip(alone, together, strict=True):
        assert all(np.array_equal(a, b) for a, b in zip(want, got, strict=True))


@pytest.mark.parametrize("kv_dtype", ["f16", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_tokens_agree_with_f32(
    synthetic_gguf, tmp_path: Path, arch: str, kv_dtype: str
) -> None:
    """On the fast path (int8 activations), 32 greedy tokens after a 20-token prompt are the
    f32 cache's tokens (these synthetic models have no near ties over that stretch)."""
    path = synthetic_gguf(arch, "q4_k")
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 100, 20)]

    def greedy(dtype: str) -> list[int]:
        with _load(path, tmp_path, dtype) as model:
            out = [int(np.argmax(model.prefill(prompt)))]
            while len(out) < 32:
                out.append(int(np.argmax(model.decode(out[-1]))))
        return out

    assert greedy(kv_dtype) == greedy("f32")


def test_a_snapshot_of_one_dtype_is_refused_by_another(synthetic_gguf, tmp_path: Path) -> None:
    path = synthetic_gguf("llama", "q8_0")
    ids = [int(t) for t in np.random.default_rng(2).integers(0, 100, 12)]
    with _load(path, tmp_path, "int8") as q8, _load(path, tmp_path, "f16") as h:
        assert q8.graph_dir.name != h.graph_dir.name  # the layout key of the prefix store
        q8.prefill(ids)
        snap = q8.kv_export(0, len(ids))
        with pytest.raises(NpuchatError, match="holds int8 rows but this cache stores f16"):
            h.kv_import(snap, 0)
        assert h.n_past == 0
        # On disk: the int8 rows come back with their scales, and only to the int8 layout.
        PrefixStore(q8.graph_dir.name, disk_dir=tmp_path / "p").persist(ids, q8.kv_export)
        assert PrefixStore(h.graph_dir.name, disk_dir=tmp_path / "p").lookup(ids, 99) is None
        hit = PrefixStore(q8.graph_dir.name, disk_dir=tmp_path / "p").lookup(ids, 99)
        assert hit is not None and hit.source == "disk" and hit.snapshot.kv_dtype == "int8"
        for got, want in zip(hit.snapshot.parts(), snap.parts(), strict=True):
            assert all(np.array_equal(x, y) for x, y in zip(got, want, strict=True))
        assert len(snap.parts()) == 4  # K, V and their scales
        q8.rollback(0)
        q8.kv_import(hit.snapshot, 0)
        assert q8.n_past == len(ids)


def test_int8_bytes_per_token_and_a_bad_dtype(synthetic_gguf, tmp_path: Path) -> None:
    path = synthetic_gguf("llama", "q8_0")
    sizes = {}
    for dtype in ("f32", "f16", "int8"):
        with _load(path, tmp_path, dtype) as model:
            sizes[dtype] = model.kv_bytes_per_token
            cfg = model.config
    per_head = 2 * cfg.n_layers * cfg.n_kv_heads
    assert sizes == {
        "f32": per_head * cfg.head_dim * 4,
        "f16": per_head * cfg.head_dim * 2,
        "int8": per_head * (cfg.head_dim + 4),
    }
    with pytest.raises(NpuchatError, match="unknown KV dtype 'q4': use one of f32, f16, int8"):
        _load(path, tmp_path, "q4")
    with pytest.raises(NpuchatError, match="NPU graph keeps f32 or int8 K/V"):
        _load(path, tmp_path, "f16", device="npu")


def _run_ids(args: list[str], capsys: pytest.CaptureFixture[str]) -> list[int]:
    assert main(["run", "--model", "syn", "-p", "the quick fox", "-n", "12", "--json", *args]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    return [r["id"] for r in rows[:-1]]


def test_run_takes_kv_dtype_from_the_flag_and_the_config(
    syn: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    graphs = Paths.from_env().cache_dir / "graphs"
    plain = _run_ids([], capsys)
    built = {p.name for p in graphs.iterdir()}
    assert _run_ids(["--kv-dtype", "int8"], capsys) == plain
    int8 = {p.name for p in graphs.iterdir()} - built
    assert len(int8) == 1  # its own graphs (the int8 cache layout)
    config = Paths.from_env().config_file  # it registers the imported model too
    set_setting(config, "kv_dtype", "int8")
    assert _run_ids([], capsys) == plain
    assert {p.name for p in graphs.iterdir()} == built | int8  # the same int8 graphs again
    config.write_text(config.read_text().replace('kv_dtype = "int8"', 'kv_dtype = "q4"'))
    assert main(["run", "--model", "syn", "-p", "hi", "-n", "1"]) == 2
    err = capsys.readouterr().err
    assert "kv_dtype = 'q4' is not one of auto, f32, f16, int8" in err and "Traceback" not in err


def test_auto_is_f16_where_the_native_attention_reads_it_and_f32_elsewhere(
    synthetic_gguf, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The app's default: half the cache where `RopeAttentionF16` widens it in place; ONNX
    Runtime's own ops would convert the whole cache every step, so without the kernels f32."""
    path = synthetic_gguf("qwen2", "q8_0")
    if kernels_for(4).available:
        with _load(path, tmp_path, "auto") as model, _load(path, tmp_path, "f32") as f32:
            assert model.kv_dtype == "f16"
            assert 2 * model.kv_bytes_per_token == f32.kv_bytes_per_token
        with _load(path, tmp_path, "auto", accuracy_level=0) as model:  # ORT's float matmuls
            assert model.kv_dtype == "f32"
    monkeypatch.setenv("NPUCHAT_KERNELS", "off")
    with _load(path, tmp_path, "auto") as model:
        assert model.kv_dtype == "f32"
    with pytest.raises(NpuchatError, match="unknown KV dtype 'f8'"):
        _load(path, tmp_path, "f8")


def test_an_int8_prefix_file_without_its_scales_is_refused(tmp_path: Path) -> None:
    """int8 rows are meaningless without their scales: a file that lost them (its hash made to
    match, as another program could write it) is reported and not loaded."""
    ids = [5, 6, 7]
    rng = np.random.default_rng(0)

    def rows(start: int, end: int) -> KVSnapshot:
        n = end - start
        ints = [rng.integers(-127, 128, (1, 2, n, 4)).astype(np.int8) for _ in range(4)]
        scales = [np.ones((1, 2, n, 1), np.float32) for _ in range(4)]
        return KVSnapshot(start, ints[:2], ints[2:], scales[:2], scales[2:])

    PrefixStore("layout", disk_dir=tmp_path).persist(ids, rows)
    (head,) = (tmp_path / "layout").glob("*.json")
    body = head.with_suffix(".npz")
    with np.load(body) as z:
        kept = {name: z[name] for name in z.files if "scale" not in name}
    buf = io.BytesIO()
    np.savez(buf, **kept)
    body.write_bytes(buf.getvalue())
    header = json.loads(head.read_text())
    header["sha256"] = hashlib.sha256(buf.getvalue()).hexdigest()
    head.write_text(json.dumps(header))
    store = PrefixStore("layout", disk_dir=tmp_path)
    assert store.lookup(ids, 10) is None
    assert any("does not hold K/V rows" in w for w in store.warnings)
