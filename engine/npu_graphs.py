"""Running a model's static NPU graph over the host KV cache.

The CPU path runs one symbolic graph for every step; the NPU runs one compiled `step` graph
(`npu_compile.npu_specs`, which says why one): S rows for each of the B cache rows (KV slots)
at one capacity C, with the logits of each entry's last k+1 rows. Batch entry j always reads
cache row j, so the whole cache is bound once. A step fills the entries of the rows it runs:
a prefill chunk or a verify fills one entry with up to S rows, a batched decode one row in
each of its entries. Fewer rows than S are *left-padded*: the pad rows come first, the mask
hides them from the real rows (`KVCache.fill_mask(pad=…)`), the last row is always a real one
(prefill's logit row), and only the real rows' K/V are written back. An entry the step does
not run is padding as a whole: each of its rows attends only itself, its logits are ignored
and its K/V is never written back.
Pad rows repeat a real row's embedding and rotary angle rather than zeros, so every value the
fp16 HTP computes for them stays finite (a NaN in a masked column would still poison the
softmax of the real rows).

Every input and output is an OrtValue over a preallocated numpy buffer bound once (IOBinding);
the cache buffers are bound by reference, so a step copies only the new rows. An int8 cache
(`kv_layout`) is read with its scales; the graph returns the new rows as float32 (K smoothed)
and `KVCache.write` quantizes them the way the CPU graph does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort  # type: ignore[import-untyped]

from .devices import QnnOptions
from .errors import NpuchatError
from .gguf_reader import ModelConfig
from .graph_inputs import GraphSpec
from .kvcache import KVCache
from .layer_inputs import MASK_NEG, apply_window
from .npu_compile import CompiledGraphs, compile_npu_graphs, load_compiled_session, npu_specs
from .runtime import GraphCache

__all__ = ["NpuGraphs"]

ProgressFn = Callable[[str, float], None]
Tables = tuple[np.ndarray, np.ndarray]


class _Bound:
    """The compiled graph: its session, IOBinding and preallocated buffers."""

    def __init__(self, session: ort.InferenceSession, cfg: ModelConfig, spec: GraphSpec) -> None:
        assert spec.seq_len is not None and spec.capacity is not None and spec.logit_rows
        assert spec.batch is not None
        b, s, c, r = spec.batch, spec.seq_len, spec.capacity, spec.logit_rows
        f32 = np.float32
        self.session = session
        self.batch, self.seq_len, self.kv_dtype = b, s, spec.kv_dtype
        self.per = r // b  # logit rows of each entry: its last `per` rows
        self.embeddings = np.zeros((b, s, cfg.d_model), f32)
        self.ring = int(spec.ring) if spec.ring is not False and any(cfg.swa_layers) else 0
        ring_cols = (self.ring or c) + s  # the ring layers' columns: their slots, the new rows
        every = self.ring and not cfg.mixed_windows  # every layer slides: `mask` is theirs
        self.mask = np.zeros((b, 1, s, ring_cols if every else c + s), f32)
        self.cos = np.zeros((b, s, cfg.head_dim // 2), f32)
        self.sin = np.zeros((b, s, cfg.head_dim // 2), f32)
        rows = np.arange(b)[:, None] * s + np.arange(s - self.per, s)[None, :]
        self.logit_rows = rows.reshape(-1).astype(np.int64)
        self.cfg = cfg
        # sliding layers' own inputs (aliases of the shared ones for models without them)
        self.mask_swa = np.zeros((b, 1, s, ring_cols), f32) if cfg.mixed_windows else self.mask
        self.cos_swa = np.zeros_like(self.cos) if cfg.local_rope else self.cos
        self.sin_swa = np.zeros_like(self.sin) if cfg.local_rope else self.sin
        self.logits = np.zeros((r, cfg.vocab_size), f32)
        row_inputs = [self.embeddings, self.cos, self.sin, self.cos_swa, self.sin_swa]
        self._row_inputs = list({id(a): a for a in row_inputs}.values())  # the distinct ones
        self._masks = [self.mask] + ([self.mask_swa] if self.mask_swa is not self.mask else [])
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
        self.cache_key: int | None = None  # the cache generation bound

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

    def bind_cache(self, kv: KVCache) -> None:
        """Bind every cache row (entry j reads row j; no copy)."""
        if self.cache_key == kv.generation:
            return
        for i in range(kv.n_layers):
            self._bind(f"past_k_{i}", kv.k[i], output=False)
            self._bind(f"past_v_{i}", kv.v[i], output=False)
            if kv.k_scale:  # int8: each slot's scale (`kv_layout`)
                self._bind(f"past_k_{i}_scale", kv.k_scale[i], output=False)
                self._bind(f"past_v_{i}_scale", kv.v_scale[i], output=False)
        self.cache_key = kv.generation

    def fill(
        self,
        entry: int,
        rows: tuple[np.ndarray, np.ndarray, np.ndarray],
        local: Tables | None,
        kv: KVCache,
    ) -> int:
        """Entry `entry` runs `rows` (embeddings `[s, D]`, cos, sin `[s, dh/2]`) at cache row
        `entry`'s fill level, left-padded; returns the pad count."""
        emb, cos, sin = rows
        s, n, cfg = emb.shape[0], kv.lengths[entry], self.cfg
        pad = self.seq_len - s
        tables = [(self.embeddings, emb), (self.cos, cos), (self.sin, sin)]
        if cfg.local_rope and local is not None:
            tables += [(self.cos_swa, local[0]), (self.sin_swa, local[1])]
        for buf, values in tables:
            buf[entry, pad:] = values
            buf[entry, :pad] = values[0]
        if self.ring:  # sliding layers read their rings (`kv_ring`)
            kv.fill_ring_mask(self.mask_swa, pad, entry, entry)
        if not self.ring or cfg.mixed_windows:
            kv.fill_mask(self.mask, pad, entry, entry)
        if cfg.swa_layers and not self.ring:  # the C slots, then the S new rows (pad rows hidden)
            positions = np.arange(n - pad, n + s)
            cols = np.concatenate([np.arange(kv.capacity), positions])
            out = self.mask_swa if cfg.mixed_windows else self.mask
            one = slice(entry, entry + 1)
            apply_window(out[one], positions, cols, cfg.sliding_window, self.mask[one])
        return pad

    def pad_entries(self, used: Sequence[int]) -> None:
        """Every entry not in `used` repeats `used[0]`'s inputs and attends only itself."""
        src = used[0]
        i = np.arange(self.seq_len)
        for j in range(self.batch):
            if j in used:
                continue
            for buf in self._row_inputs:
                buf[j] = buf[src]
            for mask in self._masks:
                mask[j].fill(MASK_NEG)
                mask[j, 0, i, mask.shape[-1] - self.seq_len + i] = 0.0

    def entry_logits(self, entry: int) -> np.ndarray:
        """The logit rows of one entry `[per, vocab]` (its last `per` rows)."""
        return self.logits[entry * self.per : (entry + 1) * self.per]


class NpuGraphs:
    """The compiled step graph of one model at one capacity, and the steps that run it."""

    def __init__(self, compiled: CompiledGraphs, cfg: ModelConfig, opts: QnnOptions) -> None:
        self.compiled = compiled
        spec = compiled.specs["step"]
        assert spec.capacity is not None
        self.capacity = spec.capacity
        t0 = time.perf_counter()
        session = load_compiled_session(compiled.ctx_model("step"), opts)
        self._graph: _Bound | None = _Bound(session, cfg, spec)
        self.load_seconds = time.perf_counter() - t0

    def close(self) -> None:
        if self._graph is not None:
            self._graph.close()
        self._graph = None

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
        batch_max: int = 1,
        ring: int = 0,
        kv_dtype: str = "f32",
    ) -> NpuGraphs:
        """Compile (first use) or load (later) the step graph, then open its session.
        `ring`: the sliding layers' ring slots (0: none); `kv_dtype`: the cache's, f32 or int8."""
        opts = opts or QnnOptions()
        specs = npu_specs(
            prefill_chunk, verify_k, capacity, accuracy_level, batch_max, ring, kv_dtype
        )
        compiled = compile_npu_graphs(gguf_path, model_sha, specs, cache, opts, progress)
        if progress:
            progress("loading NPU graphs", 0.0)
        return cls(compiled, cfg, opts)

    @property
    def folder(self) -> Path:
        return self.compiled.folder

    def _ready(self, kv: KVCache) -> _Bound:
        g = self._graph
        if g is None:
            raise NpuchatError("the NPU graphs are closed; load the model again")
        if kv.capacity != self.capacity:
            raise NpuchatError(f"the NPU graphs hold {self.capacity} KV slots, not {kv.capacity}")
        if g.ring != kv.ring_slots or g.batch != kv.rows or g.kv_dtype != kv.kv_dtype:
            raise NpuchatError(
                f"the NPU graph takes {g.batch} rows, {g.ring} ring slots and {g.kv_dtype} K/V, "
                f"the cache {kv.rows}, {kv.ring_slots} and {kv.kv_dtype}; this is a bug"
            )
        return g

    def _run(self, g: _Bound, kv: KVCache) -> None:
        g.bind_cache(kv)
        g.session.run_with_iobinding(g.io)

    def step(
        self,
        embeddings: np.ndarray,
        cos: np.ndarray,
        sin: np.ndarray,
        kv: KVCache,
        all_rows: bool,
        local: Tables | None = None,
        row: int = 0,
    ) -> np.ndarray:
        """Run `s` new rows at cache row `row`'s fill level n; write their K/V into the cache;
        return logits.

        `embeddings` is `[s, D]`, `cos`/`sin` `[s, dh/2]` for positions n..n+s-1. Returns the
        last row's logits `[1, vocab]`, or every row's `[s, vocab]` when `all_rows` (s ≤ k+1).
        The caller advances the fill level. `local`: the sliding layers' (cos, sin), for models
        with them.
        """
        g = self._ready(kv)
        s, n = embeddings.shape[0], kv.lengths[row]
        if s > g.seq_len or (all_rows and s > g.per) or not 0 <= row < g.batch:
            raise NpuchatError(f"the NPU graph takes no {s} rows at row {row}; this is a bug")
        pad = g.fill(row, (embeddings, cos, sin), local, kv)
        g.pad_entries([row])
        self._run(g, kv)
        kv.write(g.new_k, g.new_v, slice(pad, None), n, row, row)
        out = g.entry_logits(row)
        return out[g.per - s :].copy() if all_rows else out[-1:].copy()

    def step_batch(
        self,
        embeddings: np.ndarray,
        cos: np.ndarray,
        sin: np.ndarray,
        kv: KVCache,
        first_row: int,
        local: Tables | None = None,
    ) -> np.ndarray:
        """One decode step for rows `first_row..+b` (`embeddings` `[b, D]`, `cos`/`sin`
        `[b, dh/2]`, `local` the sliding layers' tables alike); writes each row's new K/V at its
        fill level; logits `[b, vocab]`. The caller advances the fill levels."""
        g = self._ready(kv)
        b = embeddings.shape[0]
        rows = list(range(first_row, first_row + b))
        if not rows or first_row < 0 or rows[-1] >= g.batch:
            raise NpuchatError(f"no NPU graph takes {b} sequences at row {first_row}")
        for j, row in enumerate(rows):
            one = slice(j, j + 1)
            row_local = (local[0][one], local[1][one]) if local is not None else None
            g.fill(row, (embeddings[one], cos[one], sin[one]), row_local, kv)
        g.pad_entries(rows)
        self._run(g, kv)
        last = g.seq_len - 1
        for row in rows:
            kv.write(g.new_k, g.new_v, slice(last, None), kv.lengths[row], row, row)
        return np.stack([g.entry_logits(row)[-1] for row in rows])
