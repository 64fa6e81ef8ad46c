"""Running the CPU graph over bound buffers: the IOBinding between `Model` and ONNX Runtime.

Every input and output is an OrtValue over a numpy buffer that stays bound between runs, so a
decode step only fills a few small arrays: no binding, no allocation. The cache rows a step
works on (one sequence's row, or a batch's contiguous range of rows) are views of the cache
bound as is, as the inputs and as the outputs of the graph's in-place scatter, so the new K/V
rows land in the cache with no copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnxruntime as ort  # type: ignore[import-untyped]

from .errors import NpuchatError
from .gguf_reader import ModelConfig
from .kv_layout import attention_window
from .kvcache import KVCache
from .layer_inputs import apply_window

__all__ = ["CpuSteps"]

_KEPT_SHAPES = 8  # decode, batched decodes, verify widths, prefill chunks, at their windows


class CpuSteps:
    """Runs the symbolic CPU decoder graph for B sequences of S new tokens each."""

    def __init__(self, session: ort.InferenceSession, cfg: ModelConfig, kv: KVCache) -> None:
        self.session = session
        self.cfg = cfg
        self.kv = kv
        self.io = session.io_binding()
        self._bound_cache: tuple[int, int, int] | None = None  # (generation, first row, rows)
        self._bound_step: tuple[int, ...] | None = None  # (B, S, R, P, W, cache generation)
        self._steps: dict[tuple[int, int, int, int, int], _StepBuffers] = {}
        self._cache_values: list[ort.OrtValue] = []
        self._row_values: list[ort.OrtValue] = []  # a mixed step's row selection (`_bind_rows`)

    def close(self) -> None:
        """Drop the binding before the session: ONNX Runtime's IOBinding points into its
        session, so it goes first rather than in the order Python drops attributes. Runs once."""
        if not hasattr(self, "io"):
            return
        self.io.clear_binding_inputs()
        self.io.clear_binding_outputs()
        del self.io
        self._cache_values = []
        self._steps.clear()

    def run(
        self,
        embeddings: np.ndarray,
        cos: np.ndarray,
        sin: np.ndarray,
        positions: np.ndarray,
        first_row: int,
        logit_rows: int,
        pad: int,
        local: tuple[np.ndarray, np.ndarray],
        real: Sequence[int] | None = None,
        run_options: ort.RunOptions | None = None,
        logits_of: Sequence[bool] | None = None,
    ) -> np.ndarray:
        """One run: `embeddings` `[B, S, D]`, `cos`/`sin` `[B, S, dh/2]`, `positions` `[B, S]`
        (the slots the new rows go to, in cache rows `first_row..+B`); logits of the last
        `logit_rows` rows of each sequence, `[B·logit_rows, vocab]`. `pad`: rows run twice by
        the matmuls whose one-row kernel differs (`graph_ops.RowPad`). `local`: the sliding
        layers' (cos, sin), shaped as `cos`, used by models with their own. `real`: how many
        of each sequence's S rows are tokens (the last ones; the others are left padding the
        matmuls skip, `graph_builder`); all when None. `run_options`: a run that can be ended
        early (`run_abort`). Attention reads the slots the rows reach, as a capacity variant
        (`kv_layout.attention_window`), not the whole cache. `logits_of` (with `real`): which
        sequences get logits (all when None); the others skip the vocabulary matmul."""
        b, s = embeddings.shape[:2]
        kv = self.kv
        window = attention_window(kv.capacities, kv.capacity, int(positions.max()) + 1)
        wanted = b if logits_of is None else sum(map(bool, logits_of))
        buf = self._bind(b, s, wanted * logit_rows, pad, first_row, window)
        if real is not None:
            self._bind_rows(b, s, logit_rows, real, logits_of)
        buf.embeddings[:] = embeddings
        buf.cos[:] = cos
        buf.sin[:] = sin
        cfg, ring = self.cfg, kv.ring
        if ring is not None and s > ring.size - ring.window:  # would overwrite rows still seen
            raise NpuchatError(f"a step of {s} rows is longer than the sliding-window rings allow")
        if ring is not None:  # sliding layers keep rings: their own slots and mask (`kv_ring`)
            buf.slots_swa[..., 2] = ring.slots(positions)[:, None, :]
            ring.fill_inplace_mask(buf.mask_swa, positions)
        if ring is None or cfg.mixed_windows:
            buf.slots[..., 2] = positions[:, None, :]
            kv.fill_causal_mask(buf.mask, positions)
        if cfg.swa_layers and ring is None:  # windows through the mask over the full cache
            out = buf.mask_swa if cfg.mixed_windows else buf.mask
            cols = np.arange(window)
            for j in range(b):
                rows = slice(j, j + 1)
                apply_window(out[rows], positions[j], cols, cfg.sliding_window, buf.mask[rows])
        if cfg.local_rope:
            buf.cos_swa[:], buf.sin_swa[:] = local
        for j in range(b):  # before the run: one that is stopped may have written some
            kv.note_written(first_row + j, int(positions[j].max()) + 1)
        self.session.run_with_iobinding(self.io, run_options)  # K/V rows into the cache
        return buf.logits.copy()

    def _bind_rows(
        self, b: int, s: int, per: int, real: Sequence[int], logits_of: Sequence[bool] | None
    ) -> None:
        """Bind the row selection of a step whose sequences have `real[j]` tokens each (the
        last of their S rows): `token_rows`, `row_tokens` (a pad row copies its sequence's
        first token) and the logit rows among the N tokens. The step's own (identity) arrays
        are bound again by the next `_bind`."""
        if len(real) != b or not all(per <= k <= s for k in real):
            raise ValueError(f"real token counts {list(real)} do not fit {b} rows of {s}")
        wanted = [True] * b if logits_of is None else [bool(w) for w in logits_of]
        if len(wanted) != b or not any(wanted):
            raise ValueError(f"logits of {list(wanted)} do not fit {b} rows")
        ends = np.cumsum(real)
        starts = ends - np.asarray(real)
        token_rows = np.concatenate([j * s + np.arange(s - k, s) for j, k in enumerate(real)])
        row_tokens = np.concatenate(
            [
                np.concatenate([np.full(s - k, a), np.arange(a, a + k)])
                for a, k in zip(starts, real, strict=True)
            ]
        )
        logit_rows = (ends[wanted, None] - per + np.arange(per)[None, :]).reshape(-1)
        value = ort.OrtValue.ortvalue_from_numpy
        self._row_values = [value(a.astype(np.int64)) for a in (token_rows, row_tokens, logit_rows)]
        for name, v in zip(
            ("token_rows", "row_tokens", "logit_rows"), self._row_values, strict=True
        ):
            self.io.bind_ortvalue_input(name, v)
        self._bound_step = None

    def _bind(self, b: int, s: int, r: int, p: int, first_row: int, w: int) -> _StepBuffers:
        """Bind cache rows `first_row..+b` and the buffers of this step shape attending `w`
        slots; a no-op when nothing changed."""
        kv, io = self.kv, self.io
        if self._bound_cache != (kv.generation, first_row, b):
            self._cache_values = []
            buffers = [("k", kv.k), ("v", kv.v), ("k", kv.k_scale), ("v", kv.v_scale)]
            for i in range(self.cfg.n_layers):
                for j, (kind, bufs) in enumerate(buffers[: len(kv.parts())]):
                    name = f"{kind}_{i}" + ("_scale" if j >= 2 else "")  # int8: its scales too
                    value = ort.OrtValue.ortvalue_from_numpy(bufs[i][first_row : first_row + b])
                    io.bind_ortvalue_input(f"past_{name}", value)
                    io.bind_ortvalue_output(f"present_{name}", value)  # in place
                    self._cache_values.append(value)
            self._bound_cache = (kv.generation, first_row, b)
        key = (b, s, r, p, w)
        buf = self._steps.pop(key, None)
        if buf is None or buf.capacity != kv.capacity:
            buf = _StepBuffers(self.cfg, b, s, r, p, kv, w)
        self._steps[key] = buf  # most recent last
        while len(self._steps) > _KEPT_SHAPES:
            del self._steps[next(iter(self._steps))]
        if self._bound_step != (*key, kv.generation):
            for name, value in buf.inputs.items():
                io.bind_ortvalue_input(name, value)
            for name, value in buf.outputs.items():
                io.bind_ortvalue_output(name, value)
            self._bound_step = (*key, kv.generation)
        return buf


class _StepBuffers:
    """Preallocated inputs and outputs of one step shape: B sequences of S new rows each, R
    logit rows (the last R/B of each sequence), capacity C, attending the first A ≤ C slots.

    The CPU graph scatters the new K/V rows into the cache itself (`kv_slots`, in place), so the
    only output here is the logits; the mask covers the A cache columns attended. Sliding
    layers with rings get their own slots and mask over the ring's columns (when every layer
    slides, those are `kv_slots` and `mask` themselves).
    """

    def __init__(
        self, cfg: ModelConfig, b: int, s: int, r: int, p: int, kv: KVCache, w: int
    ) -> None:
        f32 = np.float32
        self.capacity = kv.capacity
        ring = kv.ring is not None
        every = ring and not cfg.mixed_windows
        self.embeddings = np.zeros((b, s, cfg.d_model), f32)
        self.mask = np.zeros((b, 1, s, kv.ring_slots if every else w), f32)
        self.cos = np.zeros((b, s, cfg.head_dim // 2), f32)
        self.sin = np.zeros((b, s, cfg.head_dim // 2), f32)
        per = r // b
        self.rows = (np.arange(b)[:, None] * s + np.arange(s - per, s)[None, :]).reshape(-1)
        self.logits = np.zeros((r, cfg.vocab_size), f32)
        self.slots = np.zeros((b, cfg.n_kv_heads, s, 3), np.int64)  # (batch row, head, slot)
        self.slots[..., 0] = np.arange(b)[:, None, None]
        self.slots[..., 1] = np.arange(cfg.n_kv_heads)[:, None]
        value = ort.OrtValue.ortvalue_from_numpy
        self.inputs = {
            "embeddings": value(self.embeddings),
            "mask": value(self.mask),
            "cos": value(self.cos),
            "sin": value(self.sin),
            "logit_rows": value(self.rows),
            "kv_slots": value(self.slots),
            "pad_rows": value(np.zeros(p, np.int64)),  # row 0 again, or nothing (`RowPad`)
            "token_rows": value(np.arange(b * s, dtype=np.int64)),  # every row a token
            "row_tokens": value(np.arange(b * s, dtype=np.int64)),
        }
        # Sliding layers' own mask and rotary tables, for models whose layers differ.
        # (aliases of the shared ones, never bound, for models without them)
        swa_shape = (b, 1, s, kv.ring_slots or w)  # a cache without rings: the window
        self.mask_swa = np.zeros(swa_shape, f32) if cfg.mixed_windows else self.mask
        self.slots_swa = self.slots.copy() if ring and cfg.mixed_windows else self.slots
        self.cos_swa = np.zeros_like(self.cos) if cfg.local_rope else self.cos
        self.sin_swa = np.zeros_like(self.sin) if cfg.local_rope else self.sin
        if cfg.mixed_windows:
            self.inputs["mask_swa"] = value(self.mask_swa)
        if self.slots_swa is not self.slots:
            self.inputs["kv_slots_swa"] = value(self.slots_swa)
        if cfg.local_rope:
            self.inputs["cos_swa"] = value(self.cos_swa)
            self.inputs["sin_swa"] = value(self.sin_swa)
        self.outputs = {"logits": value(self.logits)}
