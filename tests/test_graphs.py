"""Engine graphs vs the independent numpy forward pass, on synthetic models of every arch and type.

One scripted run per model walks the cache through every regime a chat meets: a prefill
shorter than the chunk P, decode, verify, a rollback, a prefill of exactly P, a chunked prefill
longer than P that also moves the cache to the next capacity, and decode up to the last slot of
the largest capacity. Every logits row is compared with `ReferenceModel` on the same tokens
(causal, so one reference pass over the whole script's sequence serves every row).

Tolerances, relative to the largest |logit| of the reference:
* `accuracy_level=0` (float activations): the graphs compute the GGUF weights exactly, so only
  float32 rounding remains (measured ≤ 1.1e-6): 1e-5. Q6_K is the exception: its 16-value
  sub-blocks are requantized to 8-bit blocks of 32 (error ≤ half an int8 step per weight),
  measured ≤ 1.7e-2: 3e-2.
* `accuracy_level=4` (int8 activations per block of 32, the fast path, as llama.cpp's Q8
  activations): the rounding of every activation block adds ~1/254 relative noise per matmul
  input; measured 1.3e-2 to 2.5e-2 over these models: 4e-2. Float weights (f32, f16) take a
  float MatMul and stay at the exact tolerance.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from gguf import GGUFWriter
from reference_forward import ReferenceModel
from synthetic import ARCHS, TENSOR_TYPES

from npuchat.engine.errors import NpuchatError
from npuchat.engine.gguf_reader import GGUFFile
from npuchat.engine.graph_builder import GraphSpec, build_graphs, rope_tables
from npuchat.engine.kvcache import KVCache
from npuchat.engine.layer_inputs import apply_window
from npuchat.engine.model import Model
from npuchat.engine.quant import dequantize_rows

P = 16
CAPS = [32, 64]


def tolerance(type_name: str, accuracy_level: int) -> float:
    if type_name == "q6_k":
        return 4e-2 if accuracy_level == 4 else 3e-2
    if accuracy_level == 4 and type_name not in ("f32", "f16"):
        return 4e-2
    return 1e-5


def scripted_run(model: Model, seq: list[int]) -> dict[int, np.ndarray]:
    """Drive the model through every cache regime; {position: logits row}."""
    rows: dict[int, np.ndarray] = {}
    rows[9] = model.prefill(seq[0:10])  # shorter than P
    assert model.n_past == 10 and model.capacity == 32
    rows[10] = model.decode(seq[10])
    rows[11] = model.decode(seq[11])
    for j, row in enumerate(model.verify(seq[12:17])):
        rows[12 + j] = row
    model.rollback(14)  # reject the last three verified tokens, then feed them again
    rows[29] = model.prefill(seq[14:30])  # exactly P
    rows[54] = model.prefill(seq[30:55])  # longer than P: two chunks, and 32 -> 64
    assert model.capacity == 64
    for j, row in enumerate(model.verify(seq[55:60])):
        rows[55 + j] = row
    for pos in range(60, 64):  # up to the last slot
        rows[pos] = model.decode(seq[pos])
    assert model.n_past == 64
    with pytest.raises(NpuchatError, match="context is full"):
        model.decode(seq[0])
    assert model.n_past == 64
    return rows


def assert_script_matches_reference(
    path: Path, cache_dir: Path, seed: int, type_name: str, accuracy_level: int
) -> None:
    """`scripted_run` over 64 random tokens (from `seed`): every logits row is the vocabulary's
    width and within `tolerance` of the reference's row, relative to its largest |logit|."""
    ref = ReferenceModel(path)
    vocab = ref.config.vocab_size
    seq = [int(t) for t in np.random.default_rng(seed).integers(0, vocab, 64)]
    expect = ref.logits(seq)
    scale = float(np.abs(expect).max())
    with Model.load(
        path,
        cache_dir=cache_dir,
        prefill_chunk=P,
        verify_k=4,
        capacities=CAPS,
        accuracy_level=accuracy_level,
    ) as model:
        rows = scripted_run(model, seq)
    tol = tolerance(type_name, accuracy_level)
    for pos, row in rows.items():
        assert row.shape == (vocab,) and row.dtype == np.float32
        err = float(np.abs(row - expect[pos]).max()) / scale
        assert err <= tol, f"position {pos}: max|diff|/max|logit| = {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("accuracy_level", [0, 4])
@pytest.mark.parametrize("type_name", TENSOR_TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_reference(
    synthetic_gguf,
    tmp_path: Path,
    arch: str,
    type_name: str,
    accuracy_level: int,
) -> None:
    path = synthetic_gguf(arch, type_name)
    assert_script_matches_reference(path, tmp_path, 7, type_name, accuracy_level)


def _gemma_linear_rope(w: GGUFWriter) -> None:
    w.add_string("gemma3.rope.scaling.type", "linear")
    w.add_float32("gemma3.rope.scaling.factor", 8.0)


# Variants of the newer archs' features, each on one model (arch, writer options).
VARIANTS = {
    "llama3-rope-factors": ("llama", {"rope_freq_factors": True}),
    "mistral-window": ("llama", {"sliding_window": 12}),
    "gemma3-pattern6": ("gemma3", {"n_layers": 6, "swa_pattern": 6, "sliding_window": 12}),
    "gemma3-linear-rope": ("gemma3", {"extra": _gemma_linear_rope}),
}


@pytest.mark.parametrize(("type_name", "accuracy_level"), [("q8_0", 0), ("q4_k", 4)])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_feature_variants_match_reference(
    synthetic_gguf,
    tmp_path: Path,
    variant: str,
    type_name: str,
    accuracy_level: int,
) -> None:
    """Rope factors, a window on every layer, Gemma's default 5-local:1-global layout with a
    window crossed by the script, and linear rope scaling on Gemma's global layers only."""
    arch, kw = VARIANTS[variant]
    path = synthetic_gguf(arch, type_name, **kw)
    assert_script_matches_reference(path, tmp_path, 8, type_name, accuracy_level)


@pytest.mark.parametrize("arch", ARCHS)
def test_static_graphs_with_padding_match_reference(
    synthetic_gguf,
    tmp_path: Path,
    arch: str,
) -> None:
    """The NPU form: fixed S and C, unfused norms, a left-padded prefill chunk (the padding rows
    are masked and never written back), then a verify graph with logits for every row."""
    window = {"sliding_window": 4} if arch == "gemma3" else {}  # shorter than the 8 tokens
    path = synthetic_gguf(arch, "q4_k", **window)
    ref = ReferenceModel(path)
    cfg = ref.config
    seq = [int(t) for t in np.random.default_rng(11).integers(0, cfg.vocab_size, 8)]
    expect = ref.logits(seq)
    specs = {
        "prefill": GraphSpec(8, 32, 1, accuracy_level=0, fused_norms=False),
        "verify": GraphSpec(3, 32, 3, accuracy_level=0, fused_norms=False),
    }
    files = build_graphs(path, specs, tmp_path / "graphs")
    kv = KVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, [32])
    with GGUFFile(path) as g:
        info = g.tensors["token_embd.weight"]
        table = g.raw("token_embd.weight").copy()  # the mapping closes with the file

        def run(name: str, ids: list[int], s: int) -> np.ndarray:
            pad = s - len(ids)
            sess = ort.InferenceSession(str(files[name]), providers=["CPUExecutionProvider"])
            emb = np.zeros((1, s, cfg.d_model), np.float32)
            emb[0, pad:] = dequantize_rows(table, info.ggml_type, cfg.d_model, np.array(ids))
            positions = np.arange(kv.n - pad, kv.n + len(ids))
            cos, sin = rope_tables(cfg, positions.clip(0))
            feeds = {
                "embeddings": emb,
                "mask": kv.mask(s, pad),
                "cos": cos[None],
                "sin": sin[None],
                "logit_rows": np.arange(s - specs[name].logit_rows, s, dtype=np.int64),
            }
            if cfg.mixed_windows:  # columns: 32 slots, then the s new rows
                feeds["mask_swa"] = np.empty_like(feeds["mask"])
                cols = np.concatenate([np.arange(32), positions])
                apply_window(feeds["mask_swa"], positions, cols, cfg.sliding_window, feeds["mask"])
            if cfg.local_rope:
                cos_l, sin_l = rope_tables(cfg, positions.clip(0), local=True)
                feeds["cos_swa"], feeds["sin_swa"] = cos_l[None], sin_l[None]
            for i in range(cfg.n_layers):
                feeds[f"past_k_{i}"], feeds[f"past_v_{i}"] = kv.k[i], kv.v[i]
            out = sess.run(None, feeds)
            kv.write(out[1::2], out[2::2], slice(pad, None), kv.n)
            kv.n += len(ids)
            return out[0]

        first = run("prefill", seq[:5], 8)  # 3 padding rows
        rows = run("verify", seq[5:8], 3)
    scale = float(np.abs(expect).max())
    assert float(np.abs(first[0] - expect[4]).max()) <= 1e-5 * scale
    assert float(np.abs(rows - expect[5:8]).max()) <= 1e-5 * scale
