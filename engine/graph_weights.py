"""GGUF tensors → the graphs' initializers: one page-aligned external-data file of weights.

Every graph of a model (CPU or NPU, any shape) references the same `weights.bin`, written once
here; with the native kernels, blocks kept as the GGUF holds them are not copied into it but
referenced where they lie in the model file (`gguf_initializers`). Matrices keep their GGUF block
quantization as `MatMulNBits` (4/8-bit, block 32), as the GGUF's own blocks for
`npuchat.QMatMul` (`graph_native`, when the native kernels are used), or dense float; Q/K/V and
gate/up are fused into one matrix each, llama Q/K rows are permuted back to the NEOX rotary
layout, and attention's 1/√dh is folded into the Q weights (`graph_builder` doc).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

from .errors import UnsupportedModelError
from .gguf_initializers import GGUF_REF
from .gguf_reader import GGUFFile, ModelConfig
from .graph_key import WEIGHTS_FILE
from .graph_native import (
    RawRows,
    native_rows,
    pair_halves,
    regroup_rows,
    stack_native,
)
from .layer_inputs import llama_rope_permutation
from .quant import QuantMatrix, concat_rows, decode_tensor, pack_nbits

Matrix = QuantMatrix | RawRows

__all__ = [
    "Layer",
    "Linear",
    "Weights",
    "write_weights",
]

_ALIGN = 4096  # page-aligned external data lets ONNX Runtime map it instead of copying


class _WeightWriter:
    """Streams initializers into one external-data file, page-aligned, as they are produced.

    With `source`, an array that is a stretch of the GGUF's own mapping (unchanged blocks: the
    mapping is read-only, so any changed array is a copy) is referenced at its file offset
    instead of written."""

    def __init__(self, path: Path, source: GGUFFile | None = None) -> None:
        self.path = path
        self.file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self.tensors: dict[str, TensorProto] = {}
        self.source = source.file_bytes() if source is not None else None
        self.mapped = 0  # bytes referenced in the GGUF instead of written

    def _file_offset(self, arr: np.ndarray) -> int | None:
        base = self.source
        if base is None or not arr.flags.c_contiguous or arr.flags.writeable:
            return None
        start = arr.__array_interface__["data"][0] - base.__array_interface__["data"][0]
        return start if start >= 0 and start + arr.nbytes <= base.size else None

    def joined(self, parts: Sequence[RawRows]) -> np.ndarray | None:
        """Several tensors' block rows as one view of the file, when they lie back to back in
        it (gate and up do in llama.cpp's files); None otherwise."""
        offsets = [self._file_offset(p.data) for p in parts]
        if len(parts) < 2 or self.source is None:
            return None
        for part, start, nxt in zip(parts, offsets, [*offsets[1:], None], strict=True):
            if start is None or (nxt is not None and start + part.data.nbytes != nxt):
                return None
        first = offsets[0]
        assert first is not None
        rows = sum(p.n for p in parts)
        size = rows * parts[0].data.shape[1]
        return self.source[first : first + size].reshape(rows, parts[0].data.shape[1])

    def add(self, name: str, arr: np.ndarray) -> str:
        offset = self._file_offset(arr)
        if offset is not None:
            self.mapped += arr.nbytes
            return self._record(name, arr, GGUF_REF, offset)
        arr = np.ascontiguousarray(arr)
        pos = self.file.tell()
        pad = (-pos) % _ALIGN
        if pad:
            self.file.write(b"\0" * pad)
            pos += pad
        self.file.write(arr.tobytes())
        return self._record(name, arr, WEIGHTS_FILE, pos)

    def _record(self, name: str, arr: np.ndarray, location: str, offset: int) -> str:
        t = TensorProto()
        t.name = name
        t.data_type = helper.np_dtype_to_tensor_dtype(arr.dtype)
        t.dims.extend(arr.shape)
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", location), ("offset", offset), ("length", arr.nbytes)):
            entry = t.external_data.add()
            entry.key, entry.value = key, str(value)
        self.tensors[name] = t
        return name

    def close(self) -> None:
        self.file.close()
        self.source = None  # the view must go before the GGUF closes
        if self.mapped:  # the stand-in for the GGUF that ONNX Runtime's path check wants
            (self.path.parent / GGUF_REF).touch()


@dataclass
class Linear:
    """A matmul's initializer names and shape (one fused group of output rows)."""

    n: int
    k: int
    bits: int
    b: str
    scales: str = ""
    mins: str = ""  # [N, K/32], read by the offset Gemm transposed
    bias: str = ""
    ggml_type: int = 0  # nonzero: `b` holds GGUF blocks of this type for npuchat.QMatMul
    scale: float = 1.0  # ... whose first `scaled_rows` outputs are multiplied by `scale`
    scaled_rows: int = 0
    layout: int = 0  # 1: rows regrouped in eights (`graph_native.regroup_rows`)
    paired: bool = False  # gate|up rows alternating in eights (`graph_native.pair_halves`)


@dataclass
class Layer:
    attn_norm: str
    ffn_norm: str
    qkv: list[Linear]
    out: list[Linear]
    gate_up: list[Linear]
    down: list[Linear]
    q_norm: str = ""  # per-head norms of Q (with the attention scale folded in) and K
    k_norm: str = ""
    post_attn_norm: str = ""  # norms of the attention and MLP outputs
    post_ffn_norm: str = ""


@dataclass
class Weights:
    layers: list[Layer]
    out_norm: str
    lm_head: list[Linear]
    tensors: dict[str, TensorProto]


def _store_linear(
    w: _WeightWriter,
    name: str,
    mats: Sequence[Matrix],
    bias: np.ndarray | None = None,
    want_groups: bool = False,
    glu: bool = False,
) -> list[Linear]:
    """Write matrices as fused groups of one kind each (output order is preserved);
    `want_groups`: groups of every type but Q4_0 whose rows come in sixteens (so that gate and
    up halves do in eights too) are written regrouped for the eight-row kernels; `glu`: the
    matrices are gate and up of an MLP whose op computes silu(gate) * up
    (`graph_ops.glu_fuses`), and a single group of them is written with gate and up rows
    alternating in eights (`graph_native.pair_halves`)."""
    groups: list[list[Matrix]] = []
    for m in mats:
        if groups and groups[-1][0].kind == m.kind:
            groups[-1].append(m)
        else:
            groups.append([m])
    out = []
    row = 0
    for gi, group in enumerate(groups):
        base = f"{name}.{gi}"
        if isinstance(group[0], RawRows):
            parts = [g for g in group if isinstance(g, RawRows)]
            raw, scaled_rows = stack_native(parts, w.joined(parts))
            paired = glu and len(groups) == 1 and scaled_rows == 0 and raw.n % 16 == 0
            data = pair_halves(raw.data) if paired else raw.data
            grouped = regroup_rows(data, raw.ggml_type) if want_groups and raw.n % 16 == 0 else None
            layout = int(grouped is not None)
            data = data if grouped is None else grouped
            lin = Linear(raw.n, raw.k, 0, w.add(base + ".blocks", data), layout=layout)
            lin.paired = paired
            lin.ggml_type, lin.scale, lin.scaled_rows = int(raw.ggml_type), raw.scale, scaled_rows
            if bias is not None:
                lin.bias = w.add(base + ".bias", bias[row : row + raw.n])
            row += raw.n
            out.append(lin)
            continue
        quant = [g for g in group if isinstance(g, QuantMatrix)]
        m = concat_rows(quant) if len(quant) > 1 else quant[0]
        if m.bits == 0:
            assert m.dense is not None
            lin = Linear(m.n, m.k, 0, w.add(base + ".w", m.dense.T))
        else:
            nb = pack_nbits(m)
            lin = Linear(m.n, m.k, m.bits, w.add(base + ".b", nb.b), w.add(base + ".s", nb.scales))
            if nb.mins is not None:
                lin.mins = w.add(base + ".mins", nb.mins)
        if bias is not None:
            lin.bias = w.add(base + ".bias", bias[row : row + m.n])
        row += m.n
        out.append(lin)
    return out


_ROWS_PER_CHUNK = 8192  # bounds the float temporaries of requantization (LM heads: 150k rows)


def _matrix(g: GGUFFile, name: str) -> QuantMatrix:
    info = g.tensors.get(name)
    if info is None:
        raise UnsupportedModelError(f"{g.path.name}: tensor {name} is missing")
    k, n = info.shape[0], int(np.prod(info.shape[1:]))
    raw = g.raw(name)
    if n <= _ROWS_PER_CHUNK:
        return decode_tensor(raw, info.ggml_type, n, k)
    row_bytes = info.n_bytes // n
    parts = [
        decode_tensor(
            raw[r * row_bytes : min(n, r + _ROWS_PER_CHUNK) * row_bytes],
            info.ggml_type,
            min(n, r + _ROWS_PER_CHUNK) - r,
            k,
        )
        for r in range(0, n, _ROWS_PER_CHUNK)
    ]
    return concat_rows(parts)


def _vector(g: GGUFFile, name: str) -> np.ndarray:
    if name not in g.tensors:
        raise UnsupportedModelError(f"{g.path.name}: tensor {name} is missing")
    return _matrix(g, name).dequantize().reshape(-1).astype(np.float32)


def _qkv(
    g: GGUFFile, cfg: ModelConfig, p: str, fetch: Callable[[str], Matrix]
) -> tuple[list[Matrix], np.ndarray | None]:
    """Q, K, V of layer prefix `p` in NEOX rotary layout, with 1/√dh folded into Q (and bias)."""
    dq, dk = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    cuts = [slice(0, dq), slice(dq, dq + dk), slice(dq + dk, dq + 2 * dk)]
    if cfg.fused_qkv:
        qkv = fetch(p + "attn_qkv.weight")
        mats = [qkv.rows(c) for c in cuts]
        fused_bias = p + "attn_qkv.bias"
        biases = [_vector(g, fused_bias)[c] for c in cuts] if fused_bias in g.tensors else None
    else:
        mats = [fetch(p + f"attn_{x}.weight") for x in "qkv"]
        names = [p + f"attn_{x}.bias" for x in "qkv"]
        biases = [_vector(g, n) for n in names] if all(n in g.tensors for n in names) else None
    if cfg.arch == "llama":
        perm_q = llama_rope_permutation(cfg.n_heads, cfg.head_dim)
        perm_k = llama_rope_permutation(cfg.n_kv_heads, cfg.head_dim)
        mats[0], mats[1] = mats[0].rows(perm_q), mats[1].rows(perm_k)
        if biases is not None:
            biases[0], biases[1] = biases[0][perm_q], biases[1][perm_k]
    # The attention scale rides in Q's weights, or in Q's norm when a norm follows them.
    scale = 1.0 if cfg.qk_norm else cfg.q_scale
    mats[0] = mats[0].scaled(scale)
    if biases is None:
        return mats, None
    biases[0] = (biases[0] * np.float32(scale)).astype(np.float32)
    return mats, np.concatenate(biases)


def write_weights(
    g: GGUFFile,
    out_dir: Path,
    progress: Callable[[float], None] | None = None,
    native: bool = False,
    regroup: bool = True,
) -> Weights:
    """Convert every matrix of the GGUF into `out_dir/weights.bin` (MatMulNBits layout), or with
    `native` keep the GGUF's own blocks wherever the native kernels cover the type: those rows
    stay in the GGUF where they can (a row permutation or a fusion of tensors that are not
    adjacent in the file is written as a copy); with `regroup` too, Q4_K and Q6_K matrices are
    written regrouped for the eight-row kernels (`_store_linear`)."""
    cfg = g.config

    def fetch(name: str) -> Matrix:
        if name not in g.tensors:
            raise UnsupportedModelError(f"{g.path.name}: tensor {name} is missing")
        return (native_rows(g, name) if native else None) or _matrix(g, name)

    w = _WeightWriter(out_dir / WEIGHTS_FILE, g if native else None)
    grouped = native and regroup
    glu = cfg.activation != "gelu_tanh"  # the fused op's SwiGLU (`graph_ops.glu_fuses`)
    try:
        layers = []
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            qkv_mats, qkv_bias = _qkv(g, cfg, p, fetch)
            if cfg.fused_gate_up:
                gate_up = [fetch(p + "ffn_up.weight")]
            else:
                gate_up = [fetch(p + "ffn_gate.weight"), fetch(p + "ffn_up.weight")]
            layer = Layer(
                attn_norm=w.add(p + "attn_norm", _vector(g, p + "attn_norm.weight")),
                ffn_norm=w.add(p + "ffn_norm", _vector(g, p + "ffn_norm.weight")),
                qkv=_store_linear(w, p + "qkv", qkv_mats, qkv_bias, grouped),
                out=_store_linear(
                    w, p + "attn_out", [fetch(p + "attn_output.weight")], None, grouped
                ),
                gate_up=_store_linear(w, p + "gate_up", gate_up, None, grouped, glu),
                down=_store_linear(w, p + "down", [fetch(p + "ffn_down.weight")], None, grouped),
            )
            if cfg.qk_norm:
                q_norm = _vector(g, p + "attn_q_norm.weight") * np.float32(cfg.q_scale)
                layer.q_norm = w.add(p + "q_norm", q_norm.astype(np.float32))
                layer.k_norm = w.add(p + "k_norm", _vector(g, p + "attn_k_norm.weight"))
            if cfg.post_norms:
                post_attn = _vector(g, p + "post_attention_norm.weight")
                layer.post_attn_norm = w.add(p + "post_attn_norm", post_attn)
                post_ffn = _vector(g, p + "post_ffw_norm.weight")
                layer.post_ffn_norm = w.add(p + "post_ffn_norm", post_ffn)
            layers.append(layer)
            if progress:
                progress((i + 1) / (cfg.n_layers + 1))
        head = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
        out_norm = w.add("output_norm", _vector(g, "output_norm.weight"))
        lm_head = _store_linear(w, "lm_head", [fetch(head)], None, grouped)
    finally:
        w.close()
    return Weights(layers, out_norm, lm_head, w.tensors)
