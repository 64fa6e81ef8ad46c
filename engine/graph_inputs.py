"""What a decoder graph is made for: its spec (shape, layout) and its dims.

Kept apart from the assembly in `graph_builder`, and free of the `onnx` package, because a start
whose graphs are already built reads specs (for the cache key) and nothing else of the builder
(`graph_key`). The I/O list each spec gives is in `graph_io`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .gguf_reader import ModelConfig
from .kv_smoothing import K_SMOOTHING


@dataclass(frozen=True)
class GraphSpec:
    """The shape of one graph: new rows S, cache capacity C, logit rows R (`None` = symbolic)."""

    seq_len: int | None
    capacity: int | None
    logit_rows: int | None
    accuracy_level: int = 4
    fused_norms: bool = True
    kv_inplace: bool = False  # the CPU layout: new rows scattered into the cache (module doc)
    row_padding: bool = False  # a `pad_rows` input (`graph_ops.RowPad`): exact one-row decode steps
    batch: int | None = 1  # B sequences side by side, each its own cache row (`None` = symbolic)
    kv_dtype: str = "f32"  # how the cache stores K/V (`kv_layout`); f16: in-place graphs only
    ring: bool | int = False  # sliding layers' own cache rows (`kv_ring`): True = symbolic
    row_select: bool = False  # `token_rows`/`row_tokens` inputs: matmuls skip pad rows (module doc)
    native_kernels: bool = False  # QMatMul on the GGUF's blocks where it covers the type
    attn_window: bool = False  # in place: attention reads the cache's first W slots (W: mask)
    fused_attention: bool = True  # native, in place, f32/f16: `npuchat.RopeAttention` (rope_attend)
    regroup_k: bool = True  # native: rows of every type but Q4_0 in eights (`graph_native`)

    @classmethod
    def cpu(
        cls,
        accuracy_level: int,
        kv_dtype: str = "f32",
        ring: bool = False,
        native_kernels: bool = False,
    ) -> GraphSpec:
        """The CPU's one graph for every step: symbolic shapes, new K/V rows scattered into the
        cache, row padding for exact one-row decode steps; `ring`: sliding-window layers keep
        a ring of their own size; `native_kernels`: `npuchat.QMatMul` for the block types it
        covers, and `npuchat.Attention` over a float32 cache. Attention reads as many of the
        cache's slots as the mask has columns (`attn_window`), so a step pays for what its rows
        hold, not for the capacity."""
        return cls(
            None,
            None,
            None,
            accuracy_level,
            kv_inplace=True,
            row_padding=True,
            batch=None,
            kv_dtype=kv_dtype,
            ring=ring,
            row_select=True,
            native_kernels=native_kernels,
            attn_window=True,
        )

    @classmethod
    def static(
        cls,
        seq_len: int,
        capacity: int,
        logit_rows: int,
        accuracy_level: int,
        batch: int = 1,
        ring: int = 0,
        kv_dtype: str = "f32",
    ) -> GraphSpec:
        """A fixed-shape graph for the NPU, with norms the HTP accepts (no fused ones);
        `ring`: the sliding layers' cache rows (0: the capacity, through the mask); `kv_dtype`
        f32 or int8 (the new rows come out as float32 either way)."""
        return cls(
            seq_len,
            capacity,
            logit_rows,
            accuracy_level,
            fused_norms=False,
            batch=batch,
            kv_dtype=kv_dtype,
            ring=ring or False,
        )

    def key(self) -> dict[str, Any]:
        """The spec as the compile-cache key sees it; fields at the value that builds the
        graphs from before the field existed (f32 K/V, no row selection) are left out, so
        those cached builds (the NPU's compiled ones) stay valid."""
        key = asdict(self)
        if key["kv_dtype"] == "f32":
            del key["kv_dtype"]
        if self.kv_dtype == "int8":
            key["k_smoothing"] = K_SMOOTHING
        if key["ring"] is False:
            del key["ring"]
        if not key["row_select"]:
            del key["row_select"]
        if not key["native_kernels"]:
            del key["native_kernels"]
        if not key["attn_window"]:
            del key["attn_window"]
        if not (self.kv_inplace and self.native_kernels):  # builds nothing else
            del key["fused_attention"]
        if not self.native_kernels:
            del key["regroup_k"]
        return key


@dataclass(frozen=True)
class GraphDims:
    """A graph's dims: ints where the spec fixes them, names where ONNX Runtime binds them."""

    batch: int | str
    seq: int | str
    capacity: int | str
    logit_rows: int | str
    ring: bool  # sliding layers keep a ring of `ring_rows` (else they span the capacity)
    ring_rows: int | str
    swa_layers: tuple[bool, ...]

    @classmethod
    def of(cls, cfg: ModelConfig, spec: GraphSpec) -> GraphDims:
        ring = bool(spec.ring) and any(cfg.swa_layers)
        capacity: int | str = spec.capacity if spec.capacity is not None else "C"
        return cls(
            batch=spec.batch if spec.batch is not None else "B",
            seq=spec.seq_len if spec.seq_len is not None else "S",
            capacity=capacity,
            logit_rows=spec.logit_rows if spec.logit_rows is not None else "R",
            ring=ring,
            ring_rows=("W" if spec.ring is True else int(spec.ring)) if ring else capacity,
            swa_layers=tuple(cfg.swa_layers),
        )

    def rows_of(self, layer: int) -> int | str:
        """Cache rows of a layer: its ring's or the capacity."""
        return self.ring_rows if self.swa_layers and self.swa_layers[layer] else self.capacity

    def plus_seq(self, rows: int | str, name: str) -> int | str:
        """`rows` + S as a dim (the static layout's attention columns), `name` when symbolic."""
        if isinstance(rows, int) and isinstance(self.seq, int):
            return rows + self.seq
        return name
