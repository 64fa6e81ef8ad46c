"""A loaded model: config, compiled graphs, one runtime session, and its static KV cache.

The interface sequences build on: `prefill` appends tokens and returns the last position's
logits, `decode` one token, `verify` up to k+1 tokens with logits for every row, `rollback`
moves the fill level back, `kv_export`/`kv_import` move rows for the prefix store. The cache
holds `batch_max` sequences (KV slots; each call takes its `row`); `decode_batch` and
`step_rows` run a contiguous range of rows in one step.

On the CPU one graph with symbolic S and C serves every step at every capacity, one session
(`cpu_graph`); `cpu_steps` binds the cache to it with no copy.

Decode, verify, batched and mixed steps give a row the same logits bit for bit (exact
speculation, batching that changes nothing): the `graph_ops` module doc says how.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort  # type: ignore[import-untyped]

from .cpu_graph import open_cpu_graph
from .cpu_steps import CpuSteps
from .custom_ops import kernels_for
from .devices import QnnOptions
from .errors import NpuchatError
from .gguf_reader import GGUFFile, ModelConfig
from .kv_layout import attention_window, check_context, default_capacities, resolve_kv_dtype
from .kvcache import KVCache, KVSnapshot
from .layer_inputs import rope_tables
from .npu_compile import NPU_STEP_ROWS, default_npu_capacity
from .npu_graphs import NpuGraphs
from .row_inputs import left_padded
from .runtime import GraphCache, model_sha256, providers_for
from .token_embeddings import TokenEmbeddings

__all__ = ["KVSnapshot", "Model", "ModelConfig", "default_capacities"]

Progress = Callable[[str, float], None]
Pair = tuple[np.ndarray, np.ndarray]


class Model:
    """A GGUF model compiled to ONNX graphs, with a preallocated KV cache (see module doc)."""

    config: ModelConfig
    sha256: str
    path: Path
    device: str
    batch_max: int  # KV slots: sequences the cache holds side by side
    threads: int | None  # the sessions' threads as asked (None: ONNX Runtime's choice)
    prefill_chunk: int
    verify_k: int

    def __init__(self) -> None:  # use Model.load
        self._session: ort.InferenceSession | None = None
        self._npu: NpuGraphs | None = None  # device "npu": compiled static graphs instead
        self._cpu: CpuSteps | None = None
        self._unbind: weakref.finalize | None = None  # CpuSteps.close, at close or at exit
        self._gguf: GGUFFile | None = None
        self.released_bytes = 0  # weight-file pages given back after the CPU session loaded
        self.kernels = ""  # which matmul kernels the CPU graph runs (`custom_ops`), for doctor

    @classmethod
    def load(
        cls,
        gguf_path: str | Path,
        *,
        cache_dir: Path,
        device: str = "cpu",
        prefill_chunk: int | None = None,
        verify_k: int = 4,
        capacities: Sequence[int] | None = None,
        threads: int | None = None,
        progress: Progress | None = None,
        accuracy_level: int = 4,
        npu_options: QnnOptions | None = None,
        batch_max: int = 1,
        kv_dtype: str = "f32",
        context: int | None = None,
    ) -> Model:
        """Open `gguf_path`, build (or reuse from `cache_dir`) its graphs and start a session.

        `accuracy_level` is MatMulNBits' activation precision: 4 = int8 activations (the fast
        path, like llama.cpp's Q8 activations), 0 = float32 (exact, ~30× slower; tests).
        `batch_max` is the number of KV slots (sequences the cache holds side by side).
        `prefill_chunk`: rows per prefill step; by default 128 on the CPU and, on the NPU, the
        rows of its one step graph (`npu_compile.NPU_STEP_ROWS`: every step pays for them).
        `kv_dtype`: how the cache stores K/V, "auto", "f32", "f16" or "int8" (the NPU's static
        graph reads f32 or int8; `kv_layout.resolve_kv_dtype`).
        `context`: how far the cache may grow without `capacities` (`kv_layout.check_context`).
        """
        report = progress or (lambda stage, fraction: None)
        providers_for(device)  # unknown device: fail before any work
        if prefill_chunk is None:  # the NPU's one graph runs every step at its rows
            prefill_chunk = NPU_STEP_ROWS if device == "npu" else 128
        if prefill_chunk < 1 or verify_k < 0 or batch_max < 1:
            raise NpuchatError("prefill_chunk and batch_max must be ≥ 1 and verify_k ≥ 0")
        native = device == "cpu" and kernels_for(accuracy_level).available
        kv_dtype = resolve_kv_dtype(kv_dtype, device, native)
        self = cls()
        self.path = Path(gguf_path).expanduser().resolve()
        self.device, self.batch_max, self.threads = device, int(batch_max), threads
        self.prefill_chunk, self.verify_k = int(prefill_chunk), int(verify_k)
        self._gguf = GGUFFile(self.path)
        try:
            opts = (capacities, threads, report, accuracy_level, npu_options, kv_dtype, context)
            self._open(Path(cache_dir), *opts)
        except BaseException:
            self.close()
            raise
        return self

    def _open(
        self,
        cache_dir: Path,
        capacities: Sequence[int] | None,
        threads: int | None,
        report: Progress,
        accuracy_level: int,
        npu_options: QnnOptions | None,
        kv_dtype: str,
        asked: int | None,
    ) -> None:
        assert self._gguf is not None
        self.config = cfg = self._gguf.config
        device = self.device
        # Full attention is exact only up to a sliding window the graphs do not apply (Phi-3's);
        # the windows of the other archs are in their masks (`layer_inputs`).
        window = int(self._gguf.metadata.get(f"{cfg.arch}.attention.sliding_window", 0) or 0)
        if cfg.swa_layers:
            window = 0
        context = min(cfg.context_length, window) if window > 0 else cfg.context_length
        check_context(asked, context, cfg.name)
        caps = list(capacities) if capacities else default_capacities(context, asked)
        if device == "npu":  # one static capacity: each costs a compiled binary per graph
            caps = [max(capacities) if capacities else asked or default_npu_capacity(context)]
        if max(caps) > context:
            raise NpuchatError(f"KV capacity {max(caps)} exceeds {cfg.name}'s context of {context}")
        steps = max(self.prefill_chunk, self.verify_k + 1)  # the most rows one run writes
        self._kv = KVCache.for_model(cfg, caps, self.batch_max, kv_dtype, steps)
        report("hashing model", 0.0)
        self.sha256 = model_sha256(self.path, cache_dir)
        self._graph_cache = GraphCache(cache_dir)
        t0 = time.perf_counter()
        if device == "npu":
            self._npu = NpuGraphs.load(
                self.path,
                cfg,
                self.sha256,
                self._graph_cache,
                prefill_chunk=self.prefill_chunk,
                verify_k=self.verify_k,
                capacity=caps[0],
                accuracy_level=accuracy_level,
                opts=npu_options,
                progress=report,
                batch_max=self.batch_max,
                ring=self._kv.ring_slots,
                kv_dtype=kv_dtype,
            )
            self.graph_dir = self._npu.folder
        else:
            opened = open_cpu_graph(
                self.path,
                cfg,
                self.sha256,
                self._graph_cache,
                accuracy_level=accuracy_level,
                kv_dtype=kv_dtype,
                threads=threads,
                report=report,
            )
            self.graph_dir, session = opened.folder, opened.session
            self.kernels, self.released_bytes = opened.kernels, opened.released_bytes
            self._session = session
        self.load_seconds = time.perf_counter() - t0
        if self._session is not None:
            self._cpu = CpuSteps(self._session, cfg, self._kv)
            # a model never closed still drops its bindings first, at exit (`CpuSteps.close`)
            self._unbind = weakref.finalize(self, self._cpu.close)
        self.exact_decode = device != "npu"  # pad decode steps (a draft turns it off)
        emb = self._gguf.tensors["token_embd.weight"]
        raw = self._gguf.raw("token_embd.weight")
        self.embed = TokenEmbeddings(raw, emb.ggml_type, cfg.d_model)
        positions = np.arange(self._kv.max_capacity)
        self._cos, self._sin = rope_tables(cfg, positions)
        self._cos_swa, self._sin_swa = rope_tables(cfg, positions, local=True)
        report("ready", 1.0)

    # ------------------------------------------------------------------ state

    @property
    def n_past(self) -> int:
        return self._kv.n

    @property
    def capacity(self) -> int:
        return self._kv.capacity

    @property
    def max_capacity(self) -> int:
        return self._kv.max_capacity

    @property
    def kv_bytes(self) -> int:
        return self._kv.bytes_for(self._kv.capacity)

    @property
    def kv_dtype(self) -> str:
        return self._kv.kv_dtype

    @property
    def kv_bytes_per_token(self) -> int:
        """K/V bytes one token takes in the cache (every layer, int8 scales included)."""
        return self._kv.bytes_per_token

    def length(self, row: int = 0) -> int:  # valid K/V slots of cache row `row`
        return self._kv.lengths[row]

    def window(self, slots: int) -> int:  # slots a step reaching `slots` attends (`CpuSteps`)
        kv, npu = self._kv, self._npu is not None
        return kv.capacity if npu else attention_window(kv.capacities, kv.capacity, slots)

    @property
    def graph_builds(self) -> int:  # graph folders built by this load (0: the cache had them)
        return self._graph_cache.builds

    def rollback(self, n: int, row: int = 0) -> None:
        self._kv.rollback(n, row)

    def usable(self, n: int, row: int = 0, ring_from: int | None = None) -> int:
        """`KVCache.usable` (of stored rows: `usable_prefix`): sliding layers' rings forget."""
        kv = self._kv
        return kv.usable(n, row) if ring_from is None else kv.floors.usable_prefix(n, ring_from)

    def kv_export(self, start: int, end: int, row: int = 0) -> KVSnapshot:
        return self._kv.export(start, end, row)

    def kv_import(self, snap: KVSnapshot, at: int, row: int = 0) -> None:
        self._kv.import_(snap, at, row)

    def reserve(self, slots: int) -> bool:
        """Keep room for `slots` (0: release): False while its pages are faulted in off the
        step path, after which the cache moves there once and stays (`KVCache.prepare`)."""
        if slots and not self._kv.prepare(slots):
            return False
        self._kv.hold(slots)
        return True

    def swap_rows(self, a: int, b: int) -> None:
        """Exchange two KV slots' contents (the scheduler keeps a batch's rows contiguous)."""
        self._kv.swap(a, b)

    @property
    def gguf(self) -> GGUFFile:
        """The model file, open while the model is (the session reads its vocabulary here)."""
        if self._gguf is None:
            raise NpuchatError("the model is closed")
        return self._gguf

    def close(self) -> None:
        if self._unbind is not None:
            self._unbind()  # the bindings go before the sessions (and the finalizer lets go)
        if self._npu is not None:
            self._npu.close()
        self._cpu, self._session, self._npu = None, None, None
        gguf = getattr(self, "_gguf", None)
        if gguf is not None:
            embed = getattr(self, "embed", None)
            if embed is not None:
                embed.release()  # the view must go before the file closes
            gguf.close()
            self._gguf = None

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ generation

    def prefill(
        self, ids: Sequence[int], row: int = 0, run_options: ort.RunOptions | None = None
    ) -> np.ndarray:
        """Append `ids` at the row's fill level in chunks of `prefill_chunk`; last logits
        (`run_options` can end a CPU run early, `run_abort`: the row keeps its length)."""
        ids = self._check_ids(ids)
        if not ids:
            raise NpuchatError("prefill needs at least one token")
        self._kv.ensure(self._kv.lengths[row] + len(ids))
        for start in range(0, len(ids), self.prefill_chunk):  # ids is not empty
            chunk = ids[start : start + self.prefill_chunk]
            logits = self._step(chunk, all_rows=False, row=row, run=run_options)
        return logits[0]

    def decode(self, token: int, row: int = 0) -> np.ndarray:
        """Append one token; its logits `[vocab]`."""
        return self._step(self._check_ids([token]), all_rows=False, row=row)[0]

    def verify(self, ids: Sequence[int], row: int = 0) -> np.ndarray:
        """Append up to k+1 tokens; logits for every one `[len(ids), vocab]` (roll back after)."""
        ids = self._check_ids(ids)
        if not 1 <= len(ids) <= self.verify_k + 1:
            raise NpuchatError(f"verify takes 1..{self.verify_k + 1} tokens, got {len(ids)}")
        return self._step(ids, all_rows=True, row=row)

    def decode_batch(self, tokens: Sequence[int], first_row: int = 0) -> np.ndarray:
        """One decode step for the sequences in rows `first_row ..`, one token each, in one run:
        their logits `[B, vocab]`, each row's the same as `decode` on that row alone (the
        matmuls run every row through the same multi-row kernels, a lone row padded:
        `exact_decode`; attention is per row)."""
        ids = self._check_ids(tokens)
        b = len(ids)
        if not b >= 1 or first_row + b > self.batch_max:
            raise NpuchatError(f"rows {first_row}..{first_row + b - 1} exceed {self.batch_max}")
        kv = self._kv
        rows = range(first_row, first_row + b)
        pos = np.array([kv.lengths[r] for r in rows], dtype=np.int64)
        kv.ensure(int(pos.max()) + 1)
        emb = np.stack([self.embed([t]) for t in ids])
        if self._npu is not None:
            cos, sin, local = self._rope(pos)
            logits = self._npu.step_batch(emb[:, 0], cos, sin, kv, first_row, local)
        else:
            assert self._cpu is not None
            pad = 1 if self.exact_decode and b == 1 else 0
            cos, sin, local = self._rope(pos[:, None])
            logits = self._cpu.run(emb, cos, sin, pos[:, None], first_row, 1, pad, local)
        for r in rows:
            kv.lengths[r] += 1
        return logits

    @property
    def mixes_steps(self) -> bool:  # `step_rows` runs on the CPU's symbolic graph only
        return self._npu is None

    def step_rows(
        self, ids: Sequence[Sequence[int]], first_row: int = 0, want: Sequence[bool] | None = None
    ) -> np.ndarray:
        """One step for rows `first_row ..`, each with its own new tokens (a decode token, or
        a prefill chunk), in one graph run; logits after each row's last token `[B, vocab]`,
        or only the rows `want` says (a prompt's chunk before its last skips the vocabulary
        matmul). Shorter rows are left-padded (`row_inputs`): each real row is computed as in
        a step of its own. The matmuls skip the pad rows (`CpuSteps.run`'s `real`)."""
        rows_ids = [self._check_ids(r) for r in ids]
        b = len(rows_ids)
        if not b >= 1 or first_row + b > self.batch_max or not all(rows_ids):
            raise NpuchatError(f"rows {first_row}..{first_row + b - 1} exceed {self.batch_max}")
        if self._cpu is None:
            raise NpuchatError("steps of mixed shapes run on the CPU graph only")
        kv = self._kv
        starts = [kv.lengths[first_row + j] for j in range(b)]
        kv.ensure(max(starts) + max(len(r) for r in rows_ids))  # pad slots are written too
        pos, emb = left_padded(rows_ids, starts, self.embed, self.config.d_model)
        cos, sin, local = self._rope(pos)
        heads = b if want is None else sum(map(bool, want))
        pad = 1 if self.exact_decode and heads == 1 else 0  # one logit row
        real = [len(r) for r in rows_ids]
        logits = self._cpu.run(emb, cos, sin, pos, first_row, 1, pad, local, real, None, want)
        for j, row_ids in enumerate(rows_ids):
            kv.lengths[first_row + j] += len(row_ids)
        return logits

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        if self._session is None and self._npu is None:
            raise NpuchatError("the model is closed; load it again")
        out = [int(t) for t in ids]
        bad = [t for t in out if not 0 <= t < self.config.vocab_size]
        if bad:
            raise NpuchatError(
                f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})"
            )
        return out

    def _step(
        self, ids: list[int], all_rows: bool, row: int = 0, run: ort.RunOptions | None = None
    ) -> np.ndarray:
        """Run the graph on `ids` at the row's slot n; write their K/V back; return logits."""
        s = len(ids)
        kv = self._kv
        n = kv.lengths[row]
        kv.ensure(n + s)
        pos = np.arange(n, n + s)
        if self._npu is not None:
            cos, sin, local = self._rope(pos)
            logits = self._npu.step(self.embed(ids), cos, sin, kv, all_rows, local, row)
        else:
            assert self._cpu is not None
            pad = 1 if self.exact_decode and (s == 1 or not all_rows) else 0  # one logit row
            cos, sin, local = self._rope(pos[None])
            emb, rows = self.embed(ids)[None], s if all_rows else 1
            logits = self._cpu.run(emb, cos, sin, pos[None], row, rows, pad, local, run_options=run)
        kv.lengths[row] = n + s
        return logits

    def _rope(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, Pair]:
        """Rotary (cos, sin) at positions `pos` (any shape), and the sliding layers' own."""
        return self._cos[pos], self._sin[pos], (self._cos_swa[pos], self._sin_swa[pos])
