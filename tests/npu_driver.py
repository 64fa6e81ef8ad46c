"""What the NPU tests share: the tiny models, their shapes, and a driver over `NpuGraphs`.

`NpuDriver` steps the compiled graphs directly, the way `Model` drives them, so the numerics
tests (`test_npu.py`, `test_npu_batch.py`) and the compile / cache tests (`test_npu_compile.py`)
reach the NPU path without the session on top; the CPU EP with float activations is their
reference (`cpu_greedy`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from npuchat.engine.gguf_reader import GGUFFile
from npuchat.engine.graph_builder import rope_tables
from npuchat.engine.kv_ring import ring_rows
from npuchat.engine.kvcache import KVCache
from npuchat.engine.model import Model
from npuchat.engine.npu_graphs import NpuGraphs
from npuchat.engine.quant import dequantize_rows
from npuchat.engine.runtime import GraphCache, model_sha256

CAPACITY = 64
PREFILL = 16
VERIFY_K = 3
DECODE_STEPS = 20
REL_TOL = 1.5e-2  # of the logit scale; why this bound: test_npu.py
# One weight format per arch, each on a different MatMulNBits path: 8-bit symmetric (llama),
# 4-bit with block offsets and QKV bias (qwen2, the Gemm correction and the bias Add), 4-bit
# symmetric with fused qkv / gate_up (phi3, 4 layers); qwen3 adds the per-head Q/K norms, and
# gemma3 the post norms, GELU, the embedding scale and sliding layers with their own mask and
# rotary tables (window 8, crossed by the greedy run).
MODELS = {
    "llama": ("q8_0", {}),
    "qwen2": ("q4_1", {}),
    "phi3": ("q4_0", {"n_layers": 4}),
    "qwen3": ("q8_0", {}),
    "gemma3": ("q4_0", {}),
}


class NpuDriver:
    """Prefill and greedy decode over `NpuGraphs`, the way `Model` drives its graphs."""

    def __init__(self, path: Path, cache_dir: Path, verify_k: int = VERIFY_K) -> None:
        self.gguf = GGUFFile(path)
        self.cfg = cfg = self.gguf.config
        self.cache = GraphCache(cache_dir)
        step = max(PREFILL, verify_k + 1)  # the most rows one graph run writes
        self.graphs = NpuGraphs.load(
            path,
            cfg,
            model_sha256(path, cache_dir),
            self.cache,
            prefill_chunk=PREFILL,
            verify_k=verify_k,
            capacity=CAPACITY,
            accuracy_level=0,
            ring=ring_rows(cfg, step, CAPACITY),
        )
        self.kv = KVCache(
            cfg.n_layers,
            cfg.n_kv_heads,
            cfg.head_dim,
            [CAPACITY],
            window=cfg.sliding_window,
            sliding=cfg.swa_layers,
            step_rows=step,
        )
        self.cos, self.sin = rope_tables(cfg, np.arange(CAPACITY))
        self.cos_swa, self.sin_swa = rope_tables(cfg, np.arange(CAPACITY), local=True)
        self._emb: np.ndarray | None = self.gguf.raw("token_embd.weight")
        self._emb_type = self.gguf.tensors["token_embd.weight"].ggml_type

    def close(self) -> None:
        self._emb = None  # the view pins the mapping
        self.gguf.close()

    def step(self, ids: list[int], all_rows: bool = False) -> np.ndarray:
        assert self._emb is not None, "closed"
        n, s = self.kv.n, len(ids)
        emb = dequantize_rows(
            self._emb, self._emb_type, self.cfg.d_model, np.asarray(ids, dtype=np.int64)
        )
        rows = slice(n, n + s)
        local = (self.cos_swa[rows], self.sin_swa[rows])
        out = self.graphs.step(
            emb, self.cos[rows], self.sin[rows], self.kv, all_rows=all_rows, local=local
        )
        self.kv.n = n + s
        return out

    def prefill(self, ids: list[int]) -> np.ndarray:
        for start in range(0, len(ids), PREFILL):
            logits = self.step(ids[start : start + PREFILL])
        return logits[0]


def random_prompt(vocab: int, n: int, seed: int = 5) -> list[int]:
    """`n` token ids below `vocab`, the same for the same seed."""
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def greedy(
    prefill: Callable[[list[int]], np.ndarray],
    decode: Callable[[int], np.ndarray],
    prompt: list[int],
    steps: int,
) -> tuple[list[int], np.ndarray]:
    """`steps` greedy tokens after `prompt`, and the logits row before each (and after the last)."""
    rows = [prefill(prompt)]
    tokens: list[int] = []
    for _ in range(steps):
        tokens.append(int(np.argmax(rows[-1])))
        rows.append(decode(tokens[-1]))
    return tokens, np.stack(rows)


def cpu_greedy(
    path: Path, cache: Path, prompt: list[int], steps: int = DECODE_STEPS
) -> tuple[list[int], np.ndarray]:
    """The reference run: `greedy` on the CPU EP with float activations (`accuracy_level=0`)."""
    with Model.load(
        path, cache_dir=cache, prefill_chunk=PREFILL, capacities=[CAPACITY], accuracy_level=0
    ) as m:
        return greedy(m.prefill, m.decode, prompt, steps)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| over the logit scale (max |want|): what `REL_TOL` bounds."""
    return float(np.abs(got - want).max() / np.abs(want).max())
