"""Running a model's static NPU graphs over the host KV cache.

The CPU path runs one symbolic graph for every step; the NPU has one compiled graph per step
shape (`npu_compile.npu_specs`): `decode` (S = 1), `prefill` (S = P) and `verify` (S = k+1),
all at one capacity C, or (`single_graph`) one `step` graph of max(P, k+1) rows, every row's
logits, that serves all three with one copy of the weights. A step with fewer rows than its
graph is *left-padded*: the pad rows come first, the mask hides them from the real rows
(`KVCache.fill_mask(pad=…)`), the last row is always a real one (prefill's logit row), and only
the real rows' K/V are written back.
Pad rows repeat the first real row's embedding and rotary angle rather than zeros, so every
value the fp16 HTP computes for them stays finite (a NaN in a masked column would still poison
the softmax of the real rows).

Every input and output is an OrtValue over a preallocated numpy buffer bound once (IOBinding);
the cache buffers are bound by reference, so a step copies only the new rows.

Batched decode (`step_batch`) runs `decode_b{B}` over cache rows `first_row..+B` (static batch
variants, the smallest that holds the running sequences); a batch entry past the running ones
is padding: it attends only itself, its logits are ignored and its K/V is never written back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort  # type: ignore[import-untyped]

from .devices import QnnOptions
from .errors import NpuchatError
from .gguf_reader import ModelConfig
from .graph_builder import MASK_NEG, GraphSpec
from .kvcache import KVCache
from .layer_inputs import apply_window
from .npu_compile import CompiledGraphs, compile_npu_graphs, load_compiled_session, npu_specs
from .runtime import GraphCache

__all__ = ["NpuGraphs"]

ProgressFn = Callable[[str, float], None]


class _Bound:
    """One compiled graph: its session, IOBinding and preallocated buffers."""

    def __init__(self, session: ort.InferenceSession, cfg: ModelConfig, spec: GraphSpec) -> None:
        assert spec.seq_len is not None and spec.capacity is not None and spec.logit_rows
        assert spec.batch is not None
        b, s, c, r = spec.batch, spec.seq_len, spec.capacity, spec.logit_rows
        f32 = np.float32
        self.session = session
        self.batch, self.seq_len, self.rows = b, s, r
        self.embeddings = np.zeros((b, s, cfg.d_model), f32)
        self.ring = int(spec.ring) if spec.ring is not False and any(cfg.swa_layers) else 0
        ring_cols = (self.ring or c) + s  # the ring layers' columns: their slots, the new rows
        every = self.ring and not cfg.mixed_windows  # every layer slides: `mask` is theirs
        self.mask = np.zeros((b, 1, s, ring_cols if every else c + s), f32)
        self.cos = np.zeros((b, s, cfg.head_dim // 2), f32)
        self.sin = np.zeros((b, s, cfg.head_dim // 2), f32)
        per = r // b
        rows = np.arange(b)[:, None] * s + np.arange(s - per, s)[None, :]
        self.logit_rows = rows.reshape(-1).astype(np.int64)
        self.cfg = cfg
        # sliding layers' own inputs (aliases of the shared ones for models without them)
        self.mask_swa = np.zeros((b, 1, s, ring_cols), f32) if cfg.mixed_windows else self.mask
        self.cos_swa = np.zeros_like(self.cos) if cfg.local_rope else self.cos
        self.sin_swa = np.zeros_like(self.sin) if cfg.local_rope else self.sin
        self.logits = np.zeros((r, cfg.vocab_size), f32)
        kv_shape = (b, cfg.n_kv_heads, s, cfg.head_dim)
        self.new_k = [np.zeros(kv_shape, f32) for _ in range(cfg.n_layers)]
        self.new_v = [np.zeros(kv_shape, f32) for _ in range(cfg.n_layers)]
        self.io = session.io_binding()
        self._values: list[ort.OrtValue] = []  # keep the OrtValues alive while bound
        inputs: list[tuple[str, np.ndarray]] = [
            ("embeddings", self.embeddings),
            ("mask", self.mask),
            ("cos", self.cos),
            ("sin", self.sin),
            ("logit_rows", self.logit_rows),
        ]
        if cfg.mixed_windows:
            inputs.append(("mask_swa", self.mask_swa))
        if cfg.local_rope:
            inputs += [("cos_swa", self.cos_swa), ("sin_swa", self.sin_swa)]
        for name, arr in inputs:
            self._bind(name, arr, output=False)
        self._bind("logits", self.logits, output=True)
        for i in range(cfg.n_layers):
            self._bind(f"new_k_{i}", self.new_k[i], output=True)
            self._bind(f"new_v_{i}", self.new_v[i], output=True)
        self.cache_key: tuple[int, int] | None = None  # (generation, first row)

    def close(self) -> None:
        """Drop the binding before the session (`CpuSteps.close` says why)."""
        self.io.clear_binding_inputs()
        self.io.clear_binding_outputs()
        del self.io
        self._values = []

    def _bind(self, name: str, arr: np.ndarray, output: bool) -> None:
        value = ort.OrtValue.ortvalue_from_numpy(arr)
        if output:
            self.io.bind_ortvalue_output(name, value)
        else:
            self.io.bind_ortvalue_input(name, value)
        self._values.append(value)

    def bind_cache(self, kv: KVCache, first_row: int) -> None:
        """Bind cache rows `first_row..+batch` (a contiguous view, no copy)."""
        if self.cache_key == (kv.generation, first_row):
            return
        rows = slice(first_row, first_row + self.batch)
        for i in range(kv.n_layers):
            self._bind(f"past_k_{i}", kv.k[i][rows], output=False)
            self._bind(f"past_v_{i}", kv.v[i][rows], output=False)
        self.cache_key = (kv.generation, first_row)


class NpuGraphs:
    """The compiled graph set of one model at one capacity, and the step that runs it."""

    def __init__(self, compiled: CompiledGraphs, cfg: ModelConfig, opts: QnnOptions) -> None:
        self.compiled = compiled
        self.capacity = next(iter(compiled.specs.values())).capacity
        t0 = time.perf_counter()
        self._graphs = {
            name: _Bound(load_compiled_session(compiled.ctx_model(name), opts), cfg, spec)
            for name, spec in compiled.specs.items()
        }
        self.load_seconds = time.perf_counter() - t0

    def close(self) -> None:
        for graph in self._graphs.values():
            graph.close()
        self._graphs = {}

    @classmethod
    def load(
        cls,
        gguf_path: Path,
        cfg: ModelConfig,
        model_sha: str,
        cache: GraphCache,
        *,
        prefill_chunk: int,
        verify_k: int,
        capacity: int,
        accuracy_level: int = 4,
        opts: QnnOptions | None = None,
        progress: ProgressFn | None = None,
        single_graph: bool = False,
        batch_max: int = 1,
        ring: int = 0,
    ) -> NpuGraphs:
        """Compile (first use) or load (later) the graphs, then open one session per graph.
        `ring`: the sliding layers' ring slots (0: none)."""
        opts = opts or QnnOptions()
        specs = npu_specs(
            prefill_chunk, verify_k, capacity, accuracy_level, single_graph, batch_max, ring
        )
        compiled = compile_npu_graphs(gguf_path, model_sha, specs, cache, opts, progress)
        if progress:
            progress("loading NPU graphs", 0.0)
        return cls(compiled, cfg, opts)

    @property
    def folder(self) -> Path:
        return self.compiled.folder

    def _pick(self, s: int, all_rows: bool) -> _Bound:
        if "step" in self._graphs:
            name = "step"
        elif s == 1:
            return self._graphs["decode"]
        else:
            name = "verify" if all_rows else "prefill"
        graph = self._graphs.get(name)
        if graph is None or s > graph.seq_len:
            raise NpuchatError(f"no NPU graph takes {s} rows at once ({name}); this is a bug")
        return graph

    def step(
        self,
        embeddings: np.ndarray,
        cos: np.ndarray,
        sin: np.ndarray,
        kv: KVCache,
        all_rows: bool,
        local: tuple[np.ndarray, np.ndarray] | None = None,
        row: int = 0,
    ) -> np.ndarray:
        """Run `s` new rows at cache row `row`'s fill level n; write their K/V into the cache;
        return logits.

        `embeddings` is `[s, D]`, `cos`/`sin` `[s, dh/2]` for positions n..n+s-1. Returns the
        last row's logits `[1, vocab]`, or every row's `[s, vocab]` when `all_rows`. The caller
        advances the fill level. `local`: the sliding layers' (cos, sin), for models with them.
        """
        s, n = embeddings.shape[0], kv.lengths[row]
        if kv.capacity != self.capacity:
            raise NpuchatError(f"the NPU graphs hold {self.capacity} KV slots, not {kv.capacity}")
        g = self._pick(s, all_rows)
        pad = g.seq_len - s
        g.embeddings[0, pad:] = embeddings
        g.cos[0, pad:] = cos
        g.sin[0, pad:] = sin
        if pad:
            g.embeddings[0, :pad] = embeddings[0]
            g.cos[0, :pad] = cos[0]
            g.sin[0, :pad] = sin[0]
        cfg = g.cfg
        self._check_ring(g, kv)
        if g.ring:  # sliding layers read their rings (`kv_ring`)
            kv.fill_ring_mask(g.mask_swa, pad, row)
        if not g.ring or cfg.mixed_windows:
            kv.fill_mask(g.mask, pad, row)
        if cfg.swa_layers and not g.ring:  # the C slots, then the S new rows (pad rows hidden)
            rows = np.arange(n - pad, n + s)
            cols = np.concatenate([np.arange(kv.capacity), rows])
            out = g.mask_swa if cfg.mixed_windows else g.mask
            apply_window(out, rows, cols, cfg.sliding_window, g.mask)
        if cfg.local_rope and local is not None:
            g.cos_swa[0, pad:], g.sin_swa[0, pad:] = local
            g.cos_swa[0, :pad], g.sin_swa[0, :pad] = local[0][0], local[1][0]
        g.bind_cache(kv, row)
        g.session.run_with_iobinding(g.io)
        kv.write(g.new_k, g.new_v, slice(pad, None), n, row)
        return g.logits[pad:].copy() if all_rows else g.logits[-1:].copy()

    @staticmethod
    def _check_ring(g: _Bound, kv: KVCache) -> None:
        if g.ring != kv.ring_slots:
            raise NpuchatError(
                f"the NPU graphs keep {g.ring} ring slots, the cache {kv.ring_slots}; this is a bug"
            )

    def step_batch(
        self,
        embeddings: np.ndarray,
        cos: np.ndarray,
        sin: np.ndarray,
        kv: KVCache,
        first_row: int,
        local: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> np.ndarray:
        """One decode step for rows `first_row..+b` (`embeddings` `[b, D]`, `cos`/`sin`
        `[b, dh/2]`, `local` the sliding layers' tables alike); writes each row's new K/V at its
        fill level; logits `[b, vocab]`. The caller advances the fill levels."""
        b = embeddings.shape[0]
        if kv.capacity != self.capacity:
            raise NpuchatError(f"the NPU graphs hold {self.capacity} KV slots, not {kv.capacity}")
        sizes = sorted(g.batch for name, g in self._graphs.items() if name.startswith("decode"))
        size = next((x for x in sizes if x >= b), None)
        if size is None or first_row + size > kv.rows:
            raise NpuchatError(f"no NPU decode graph takes {b} sequences at row {first_row}")
        g = self._graphs["decode" if size == 1 else f"decode_b{size}"]
        src = np.minimum(np.arange(size), b - 1)  # padding entries repeat the last real one
        g.embeddings[:, 0] = embeddings[src]
        g.cos[:, 0] = cos[src]
        g.sin[:, 0] = sin[src]
        cfg = g.cfg
        if cfg.local_rope and local is not None:
            g.cos_swa[:, 0], g.sin_swa[:, 0] = local[0][src], local[1][src]
        self._check_ring(g, kv)
        cols = np.arange(kv.capacity + 1)  # the C slots, then the new row at its position
        masks = [g.mask_swa] if g.ring else []
        if not g.ring or cfg.mixed_windows:
            masks.append(g.mask)
        for j in range(size):
            for mask in masks:
                if j < b and mask is g.mask_swa and g.ring:
                    kv.fill_ring_mask(mask, 0, first_row + j, j)
                elif j < b:
                    kv.fill_mask(mask, 0, first_row + j, j)
                else:  # padding entry: attends only its own new column
                    mask[j].fill(MASK_NEG)
                    mask[j, 0, 0, -1] = 0.0
            if cfg.swa_layers and not g.ring:
                pos = kv.lengths[first_row + j] if j < b else 0
                cols[-1] = pos
                out = g.mask_swa if cfg.mixed_windows else g.mask
                apply_window(
                    out[j : j + 1], np.array([pos]), cols, cfg.sliding_window, g.mask[j : j + 1]
                )
        g.bind_cache(kv, first_row)
        g.session.run_with_iobinding(g.io)
        for j in range(b):
            row = first_row + j
            kv.write(g.new_k, g.new_v, slice(None), kv.lengths[row], row, j)
        return g.logits[:b].copy()
