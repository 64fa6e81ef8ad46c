"""GGUF → ONNX graphs of the whole decoder: one step of S new tokens over a static KV cache.

One graph computes S new positions against C cached ones. Inputs (all float32 unless noted):

* `embeddings` `[1, S, D]` — rows of the token embedding, looked up on the host (the table stays
  quantized in the GGUF mapping; only the rows used are ever decoded);
* `mask` `[1, 1, S, C+S]` — additive: 0 = attend, `MASK_NEG` = ignore; columns are the C cached
  slots followed by the S new rows (causal among themselves);
* `cos`, `sin` `[1, S, dh/2]` — rotary tables for the S positions, computed on the host;
* `logit_rows` int64 `[R]` — which of the S rows get logits (prefill: the last; verify: all);
* `past_k_i`, `past_v_i` `[1, Hkv, C, dh]` — the cache, read only.

Outputs: `logits` `[R, vocab]` and `new_k_i`, `new_v_i` `[1, Hkv, S, dh]` — only the new
rows; the host writes them into the cache (DESIGN §3). Attention is decomposed into MatMul →
Add(mask) → Softmax → MatMul with Q reshaped to `[1, Hkv, G·S, dh]` and the mask tiled by G
(DESIGN §5: fastest on HTP; no GroupQueryAttention and no com.microsoft RotaryEmbedding, which
the NPU rejects; rotary is ONNX's own opset-23 `RotaryEmbedding`, which it accepts). Scores
against the cache and against the new rows are computed separately and concatenated, so the
cache itself is never concatenated (copied) inside the graph.

The CPU graph (`GraphSpec.kv_inplace`) differs in attention only: an int64 input `kv_slots`
`[1, Hkv, S, 3]` says where the new rows go, ScatterND writes them into the cache, and every row
attends the `[C]` cache columns under a `[1, 1, S, C]` mask. Its outputs `present_k_i`,
`present_v_i` are the whole cache, bound by the host to the input buffers themselves, so the
scatter is in place (ONNX Runtime skips ScatterND's copy when input and output share a buffer).
Why: a token's row is then computed identically whether it arrives alone (decode) or with the
drafts after it (verify), which exact speculative decoding needs (`model` module doc).

Every op costs ~2–5 µs of dispatch on this CPU whatever its size, and SmolLM2 runs 30 layers per
token in a ~8 ms budget, so the graph is built for few ops: Q/K/V and gate/up are one fused
matmul each, biases ride in `MatMulNBits`' bias input, attention's 1/√dh is folded into the Q
weights, and on the CPU residual adds fuse into `SkipSimplifiedLayerNormalization`
(`GraphSpec.fused_norms`; the NPU rejects that op and gets Add + norm).

S and C may be fixed (static graphs, what an NPU compiles) or left symbolic (`None`): on the CPU
one symbolic graph serves prefill, decode and verify at every capacity from one session, so the
weights are prepacked once (ONNX Runtime's Python API cannot share prepacked weights between
sessions; three static sessions would hold three copies).

All three architectures use NEOX rotary. llama.cpp applies "normal" (adjacent-pair) rotary to
llama models, whose Q/K rows the GGUF converter permuted; permuting those rows back per head
makes NEOX rotary on the result identical (attention scores are invariant to a common
permutation of Q and K dims), so the graph has one rotary form.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .errors import UnsupportedModelError
from .gguf_reader import GGUFFile, ModelConfig
from .layer_inputs import MASK_NEG, rope_tables
from .quant import QuantMatrix, concat_rows, decode_tensor, pack_nbits

# Bump when the graphs or the weight layout change: it is part of the compile-cache key.
BUILDER_VERSION = "12"
OPSET = 23  # RotaryEmbedding
__all__ = ["MASK_NEG", "GraphSpec", "build_graphs", "make_graph", "rope_tables", "write_weights"]
WEIGHTS_FILE = "weights.bin"
_ALIGN = 4096  # page-aligned external data lets ONNX Runtime map it instead of copying


@dataclass(frozen=True)
class GraphSpec:
    """The shape of one graph: new rows S, cache capacity C, logit rows R (`None` = symbolic)."""

    seq_len: int | None
    capacity: int | None
    logit_rows: int | None
    accuracy_level: int = 4
    fused_norms: bool = True
    kv_inplace: bool = False  # the CPU layout: new rows scattered into the cache (module doc)
    row_padding: bool = False  # a `pad_rows` input (`_RowPad`): exact one-row decode steps

    @classmethod
    def cpu(cls, accuracy_level: int) -> GraphSpec:
        """The CPU's one graph for every step: symbolic shapes, new K/V rows scattered into the
        cache, row padding for exact one-row decode steps."""
        return cls(None, None, None, accuracy_level, kv_inplace=True, row_padding=True)

    @classmethod
    def static(cls, seq_len: int, capacity: int, logit_rows: int, accuracy_level: int) -> GraphSpec:
        """A fixed-shape graph for the NPU, with norms the HTP accepts (no fused ones)."""
        return cls(seq_len, capacity, logit_rows, accuracy_level, fused_norms=False)

    def key(self) -> dict[str, Any]:
        return asdict(self)


def llama_rope_permutation(n_heads: int, head_dim: int) -> np.ndarray:
    """Row order that turns llama.cpp's adjacent-pair rotary layout into the NEOX half layout."""
    per_head = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    return (np.arange(n_heads)[:, None] * head_dim + per_head[None, :]).reshape(-1)


# --------------------------------------------------------------------------- weights


class _WeightWriter:
    """Streams initializers into one external-data file, page-aligned, as they are produced."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self.tensors: dict[str, TensorProto] = {}

    def add(self, name: str, arr: np.ndarray) -> str:
        arr = np.ascontiguousarray(arr)
        pos = self.file.tell()
        pad = (-pos) % _ALIGN
        if pad:
            self.file.write(b"\0" * pad)
            pos += pad
        self.file.write(arr.tobytes())
        t = TensorProto()
        t.name = name
        t.data_type = helper.np_dtype_to_tensor_dtype(arr.dtype)
        t.dims.extend(arr.shape)
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", WEIGHTS_FILE), ("offset", pos), ("length", arr.nbytes)):
            entry = t.external_data.add()
            entry.key, entry.value = key, str(value)
        self.tensors[name] = t
        return name

    def close(self) -> None:
        self.file.close()


@dataclass
class _Linear:
    """A matmul's initializer names and shape (one fused group of output rows)."""

    n: int
    k: int
    bits: int
    b: str
    scales: str = ""
    mins: str = ""  # [N, K/32], read by the offset Gemm transposed
    bias: str = ""


@dataclass
class _Layer:
    attn_norm: str
    ffn_norm: str
    qkv: list[_Linear]
    out: list[_Linear]
    gate_up: list[_Linear]
    down: list[_Linear]
    q_norm: str = ""  # per-head norms of Q (with the attention scale folded in) and K
    k_norm: str = ""
    post_attn_norm: str = ""  # norms of the attention and MLP outputs
    post_ffn_norm: str = ""


@dataclass
class _Weights:
    layers: list[_Layer]
    out_norm: str
    lm_head: list[_Linear]
    tensors: dict[str, TensorProto]


def _store_linear(
    w: _WeightWriter, name: str, mats: Sequence[QuantMatrix], bias: np.ndarray | None = None
) -> list[_Linear]:
    """Write matrices as fused groups of one kind each (output order is preserved)."""
    groups: list[list[QuantMatrix]] = []
    for m in mats:
        if groups and groups[-1][0].kind == m.kind:
            groups[-1].append(m)
        else:
            groups.append([m])
    out = []
    row = 0
    for gi, group in enumerate(groups):
        m = concat_rows(group) if len(group) > 1 else group[0]
        base = f"{name}.{gi}"
        if m.bits == 0:
            assert m.dense is not None
            lin = _Linear(m.n, m.k, 0, w.add(base + ".w", m.dense.T))
        else:
            nb = pack_nbits(m)
            lin = _Linear(m.n, m.k, m.bits, w.add(base + ".b", nb.b), w.add(base + ".s", nb.scales))
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


def _qkv(g: GGUFFile, cfg: ModelConfig, p: str) -> tuple[list[QuantMatrix], np.ndarray | None]:
    """Q, K, V of layer prefix `p` in NEOX rotary layout, with 1/√dh folded into Q (and bias)."""
    dq, dk = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    cuts = [slice(0, dq), slice(dq, dq + dk), slice(dq + dk, dq + 2 * dk)]
    if cfg.fused_qkv:
        qkv = _matrix(g, p + "attn_qkv.weight")
        mats = [qkv.rows(c) for c in cuts]
        fused_bias = p + "attn_qkv.bias"
        biases = [_vector(g, fused_bias)[c] for c in cuts] if fused_bias in g.tensors else None
    else:
        mats = [_matrix(g, p + f"attn_{x}.weight") for x in "qkv"]
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
    g: GGUFFile, out_dir: Path, progress: Callable[[float], None] | None = None
) -> _Weights:
    """Convert every matrix of the GGUF into `out_dir/weights.bin` (MatMulNBits layout)."""
    cfg = g.config
    w = _WeightWriter(out_dir / WEIGHTS_FILE)
    try:
        layers = []
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            qkv_mats, qkv_bias = _qkv(g, cfg, p)
            if cfg.fused_gate_up:
                gate_up = [_matrix(g, p + "ffn_up.weight")]
            else:
                gate_up = [_matrix(g, p + "ffn_gate.weight"), _matrix(g, p + "ffn_up.weight")]
            layer = _Layer(
                attn_norm=w.add(p + "attn_norm", _vector(g, p + "attn_norm.weight")),
                ffn_norm=w.add(p + "ffn_norm", _vector(g, p + "ffn_norm.weight")),
                qkv=_store_linear(w, p + "qkv", qkv_mats, qkv_bias),
                out=_store_linear(w, p + "attn_out", [_matrix(g, p + "attn_output.weight")]),
                gate_up=_store_linear(w, p + "gate_up", gate_up),
                down=_store_linear(w, p + "down", [_matrix(g, p + "ffn_down.weight")]),
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
        lm_head = _store_linear(w, "lm_head", [_matrix(g, head)])
    finally:
        w.close()
    return _Weights(layers, out_norm, lm_head, w.tensors)


# --------------------------------------------------------------------------- graph


class _Graph:
    """A tiny node/initializer accumulator with unique names."""

    def __init__(self, initializers: Mapping[str, TensorProto]) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, TensorProto] = dict(initializers)
        self.consts: dict[str, TensorProto] = {}
        self.count = 0

    def op(
        self,
        op_type: str,
        inputs: Sequence[str],
        n_out: int = 1,
        domain: str = "",
        outputs: Sequence[str] | None = None,
        **attrs: Any,
    ) -> Any:
        self.count += 1
        outs = list(outputs) if outputs else [f"{op_type}_{self.count}_{j}" for j in range(n_out)]
        self.nodes.append(
            helper.make_node(
                op_type,
                list(inputs),
                outs,
                domain=domain or None,
                name=f"{op_type}_{self.count}",
                **attrs,
            )
        )
        return outs[0] if len(outs) == 1 else outs

    def ints(self, values: Sequence[int]) -> str:
        name = "c_" + "_".join(str(v).replace("-", "m") for v in values)
        if name not in self.consts:
            self.consts[name] = numpy_helper.from_array(np.array(values, np.int64), name)
        return name

    def scalar(self, value: float) -> str:
        """A float32 scalar constant."""
        name = f"f_{len(self.consts)}"
        self.consts[name] = numpy_helper.from_array(np.array(value, np.float32), name)
        return name


def _kernel_rows_matter(lin: _Linear) -> bool:
    """Whether this matmul gives a row different bits alone than among other rows.

    ONNX Runtime runs `MatMulNBits` through a one-row kernel when M = 1. For symmetric 8-bit
    weights it agrees with the multi-row kernel bit for bit; for 4-bit weights it rounds
    differently (~1e-6, measured on ORT 1.32, AVX2). Offset Gemms and dense float MatMuls are
    counted as differing too (MLAS has GEMV paths for one row).
    """
    return lin.bits != 8 or bool(lin.mins)


class _RowPad:
    """Runs the matmuls whose one-row kernel differs on `x` plus the rows `pad_rows` of `x`.

    A decode step passes `pad_rows = [0]`: those matmuls then see two rows and take the
    multi-row kernel a verify step takes, and their output is sliced back to the S real rows;
    every other op runs on one row. Verify, prefill and draft steps pass no rows; the Concat and
    Slice still copy their tensors then (~2% of a 1.5B prefill chunk), so the MLP keeps the pad
    rows from gate/up through to down (`carrying`) instead of slicing and re-padding its widest
    tensors. `None` when the graph has no `pad_rows` input (the NPU's static graphs).
    """

    def __init__(self, rows: str) -> None:
        self.rows = rows  # the row count of every input padded here (a [1] int64 tensor)
        self.padded: dict[str, str] = {}  # x -> x with the pad rows
        self.sliced: dict[str, str] = {}  # a carrying tensor -> its S real rows
        self.carrying: set[str] = set()  # tensors that already hold the pad rows

    def pad(self, gr: _Graph, x: str) -> str:
        if x in self.carrying:
            return x
        if x not in self.padded:
            extra = gr.op("Gather", [x, "pad_rows"], axis=0)
            self.padded[x] = gr.op("Concat", [x, extra], axis=0)
        return self.padded[x]

    def unpad(self, gr: _Graph, y: str) -> str:
        if y not in self.carrying:
            return y
        if y not in self.sliced:
            self.sliced[y] = gr.op("Slice", [y, gr.ints([0]), self.rows, gr.ints([0])])
        return self.sliced[y]

    def input_for(self, gr: _Graph, x: str, lin: _Linear) -> str:
        """`x` as the matmul `lin` takes it: padded if its kernels differ, else plain rows."""
        return self.pad(gr, x) if _kernel_rows_matter(lin) else self.unpad(gr, x)


def _linear(
    gr: _Graph,
    x: str,
    lins: Sequence[_Linear],
    level: int,
    pad: _RowPad | None = None,
    keep_pad: bool = False,
) -> str:
    """`x @ Wᵀ (+ bias)` for 2-D `x` over fused groups: MatMulNBits or a dense MatMul.

    Blocks with offsets (`w = scale·(q − mid) + min`) add `(Σ x per block) @ offsetsᵀ`: Reshape +
    ReduceSum (O(K); a MatMul with a 0/1 block matrix would read K²/32 floats, 10 MB per call
    for K = 8960) and a Gemm that takes the matmul's output as its C input. The offsets are
    stored `[N, K/32]` and read transposed (`transB`): ONNX Runtime's Gemm runs that layout
    2–3× faster than `[K/32, N]` on one or two rows of a wide N (gate/up) when it sits in cache;
    in a whole 1.5B step, where it streams from memory, the two measured within noise at two
    rows and ~25% apart at one (draft models decode one row). With `pad`, groups
    whose one-row kernel differs run on the padded rows (`_RowPad`); with `keep_pad`, a result
    whose groups all ran padded keeps its pad rows (the caller continues on them).
    """
    outs = []
    blocksums: dict[tuple[str, int], str] = {}
    padded_all = pad is not None and all(_kernel_rows_matter(lin) for lin in lins)
    for lin in lins:
        xin = x if pad is None else pad.input_for(gr, x, lin)
        if lin.bits == 0:
            y = gr.op("MatMul", [xin, lin.b])
            if lin.bias:
                y = gr.op("Add", [y, lin.bias])
        else:
            ins = [xin, lin.b, lin.scales] + (["", "", lin.bias] if lin.bias else [])
            y = gr.op(
                "MatMulNBits",
                ins,
                domain="com.microsoft",
                K=lin.k,
                N=lin.n,
                bits=lin.bits,
                block_size=32,
                accuracy_level=level,
            )
            if lin.mins:
                if (xin, lin.k) not in blocksums:  # [S, K] -> [S, K/32, 32] -> [S, K/32]
                    xb = gr.op("Reshape", [xin, gr.ints([-1, lin.k // 32, 32])])
                    blocksums[(xin, lin.k)] = gr.op("ReduceSum", [xb, gr.ints([-1])], keepdims=0)
                y = gr.op("Gemm", [blocksums[(xin, lin.k)], lin.mins, y], transB=1)
        if pad is not None and _kernel_rows_matter(lin):
            pad.carrying.add(y)
            if not (keep_pad and padded_all):
                y = pad.unpad(gr, y)
        outs.append(y)
    out = outs[0] if len(outs) == 1 else gr.op("Concat", outs, axis=-1)
    if pad is not None and keep_pad and padded_all:
        pad.carrying.add(out)
    return out


def _value_info(name: str, dims: Sequence[int | str], elem: int = TensorProto.FLOAT) -> Any:
    return helper.make_tensor_value_info(name, elem, list(dims))


def _attend_split(
    gr: _Graph, i: int, q: str, k_new: str, v_new: str, mask: str, split_cs: str
) -> str:
    """Attention over the read-only cache plus the S new rows as separate column blocks.

    The static (NPU) layout: the cache is never copied, only the new rows come out (`new_k_i`,
    `new_v_i`, named by the caller) and the host writes them back.
    """
    kt_past = gr.op("Transpose", [f"past_k_{i}"], perm=[0, 1, 3, 2])
    kt_new = gr.op("Transpose", [k_new], perm=[0, 1, 3, 2])
    scores = gr.op("Concat", [gr.op("MatMul", [q, kt_past]), gr.op("MatMul", [q, kt_new])], axis=-1)
    probs = gr.op("Softmax", [gr.op("Add", [scores, mask])], axis=-1)
    p_past, p_new = gr.op("Split", [probs, split_cs], n_out=2, axis=-1)
    return gr.op("Add", [gr.op("MatMul", [p_past, f"past_v_{i}"]), gr.op("MatMul", [p_new, v_new])])


def _attend_inplace(gr: _Graph, i: int, q: str, k_new: str, v_new: str, mask: str) -> str:
    """Attention after scattering the S new rows into the cache at `kv_slots` (the CPU layout).

    Every row then attends the same `[C]` columns in the same order whether it came in a decode
    step or a verify step, so the two give bit-identical results (speculation is exact). The
    host binds `present_*_i` to the same buffers as `past_*_i`, and ONNX Runtime's ScatterND
    skips its copy when input and output are one buffer: the rows land in the cache in place.
    """
    k_all = gr.op("ScatterND", [f"past_k_{i}", "kv_slots", k_new], outputs=[f"present_k_{i}"])
    v_all = gr.op("ScatterND", [f"past_v_{i}", "kv_slots", v_new], outputs=[f"present_v_{i}"])
    scores = gr.op("MatMul", [q, gr.op("Transpose", [k_all], perm=[0, 1, 3, 2])])
    probs = gr.op("Softmax", [gr.op("Add", [scores, mask])], axis=-1)
    return gr.op("MatMul", [probs, v_all])


def make_graph(cfg: ModelConfig, weights: _Weights, spec: GraphSpec) -> onnx.ModelProto:
    """The decoder graph for one `spec`, referencing the already written weights."""
    gr = _Graph(weights.tensors)
    d, dh = cfg.d_model, cfg.head_dim
    h, hkv, grp = cfg.n_heads, cfg.n_kv_heads, cfg.n_groups
    s_dim: int | str = spec.seq_len if spec.seq_len is not None else "S"
    c_dim: int | str = spec.capacity if spec.capacity is not None else "C"
    r_dim: int | str = spec.logit_rows if spec.logit_rows is not None else "R"
    total: int | str = s_dim + c_dim if isinstance(s_dim, int) and isinstance(c_dim, int) else "CS"
    level = spec.accuracy_level
    eps = float(cfg.rms_eps)

    inplace = spec.kv_inplace
    inputs = [
        _value_info("embeddings", [1, s_dim, d]),
        _value_info("mask", [1, 1, s_dim, c_dim if inplace else total]),
        _value_info("cos", [1, s_dim, dh // 2]),
        _value_info("sin", [1, s_dim, dh // 2]),
        _value_info("logit_rows", [r_dim], TensorProto.INT64),
    ]
    if cfg.mixed_windows:  # the sliding layers' mask (`layer_inputs`)
        inputs.append(_value_info("mask_swa", [1, 1, s_dim, c_dim if inplace else total]))
    if cfg.local_rope:  # the sliding layers' rotary tables
        inputs += [_value_info(f"{t}_swa", [1, s_dim, dh // 2]) for t in ("cos", "sin")]
    if inplace:
        inputs.append(_value_info("kv_slots", [1, hkv, s_dim, 3], TensorProto.INT64))
    if spec.row_padding:
        inputs.append(_value_info("pad_rows", ["P"], TensorProto.INT64))
    outputs = [_value_info("logits", [r_dim, cfg.vocab_size])]
    rows_dim = c_dim if inplace else s_dim
    out_prefix = "present" if inplace else "new"
    for i in range(cfg.n_layers):
        inputs += [
            _value_info(f"past_k_{i}", [1, hkv, c_dim, dh]),
            _value_info(f"past_v_{i}", [1, hkv, c_dim, dh]),
        ]
        outputs += [
            _value_info(f"{out_prefix}_k_{i}", [1, hkv, rows_dim, dh]),
            _value_info(f"{out_prefix}_v_{i}", [1, hkv, rows_dim, dh]),
        ]

    # Shared per-step tensors: the mask tiled over the G query heads of each KV head, and the
    # [C, S] split of the attention columns into cached slots and new rows.
    def tiled(name: str) -> str:
        return gr.op("Tile", [name, gr.ints([1, 1, grp, 1])]) if grp > 1 else name

    masks = {False: tiled("mask")}
    if cfg.mixed_windows:
        masks[True] = tiled("mask_swa")
    pad = _RowPad(gr.op("Shape", ["embeddings"], start=1, end=2)) if spec.row_padding else None
    if inplace:
        split_cs = None  # no [C, S] column split: attention reads the cache only
    elif spec.capacity is not None and spec.seq_len is not None:
        split_cs = gr.ints([spec.capacity, spec.seq_len])
    else:
        cap = gr.op("Shape", ["past_k_0"], start=2, end=3)
        seq = gr.op("Shape", ["embeddings"], start=1, end=2)
        split_cs = gr.op("Concat", [cap, seq], axis=0)

    def norm(x: str, weight: str, delta: str | None) -> tuple[str, str]:
        """RMSNorm of `x + delta`; returns (normed, new residual stream)."""
        if delta is None:
            return gr.op("SimplifiedLayerNormalization", [x, weight], axis=-1, epsilon=eps), x
        if spec.fused_norms:
            normed, _, _, summed = gr.op(
                "SkipSimplifiedLayerNormalization",
                [delta, x, weight],
                n_out=4,
                domain="com.microsoft",
                epsilon=eps,
            )
            return normed, summed
        summed = gr.op("Add", [x, delta])
        return gr.op("SimplifiedLayerNormalization", [summed, weight], axis=-1, epsilon=eps), summed

    def rope(x: str, local: bool, out: str | None = None) -> str:
        cos, sin = ("cos_swa", "sin_swa") if local and cfg.local_rope else ("cos", "sin")
        return gr.op("RotaryEmbedding", [x, cos, sin], outputs=[out] if out else None)

    def heads(x: str, n: int, norm_weight: str) -> str:
        """[S, n·dh] -> [1, n, S, dh], each head RMS-normed first when the arch norms Q/K."""
        if norm_weight:  # over [S·n, dh] rows: on 4-D input the HTP computed wrong norms
            x = gr.op("Reshape", [x, gr.ints([-1, dh])])
            x = gr.op("SimplifiedLayerNormalization", [x, norm_weight], axis=-1, epsilon=eps)
        x = gr.op("Reshape", [x, gr.ints([1, -1, n, dh])])
        return gr.op("Transpose", [x], perm=[0, 2, 1, 3])

    def post_norm(x: str, weight: str) -> str:
        if not weight:
            return x
        return gr.op("SimplifiedLayerNormalization", [x, weight], axis=-1, epsilon=eps)

    # The residual stream is 2-D [S, D] (MatMulNBits and the norms take it; Gemm needs it).
    x, delta = gr.op("Reshape", ["embeddings", gr.ints([-1, d])]), None
    if cfg.embed_scale != 1.0:
        x = gr.op("Mul", [x, gr.scalar(cfg.embed_scale)])
    for i, layer in enumerate(weights.layers):
        local = bool(cfg.swa_layers) and cfg.swa_layers[i]
        mask = masks[local and cfg.mixed_windows]
        n1, x = norm(x, layer.attn_norm, delta)
        qkv = _linear(gr, n1, layer.qkv, level, pad)
        q, k, v = gr.op("Split", [qkv, gr.ints([h * dh, hkv * dh, hkv * dh])], n_out=3, axis=-1)
        # Q [1,S,H·dh] -> [1,H,S,dh] -> rotary -> [1,Hkv,G·S,dh] (rows g·S + s, as Tile(mask))
        q = gr.op("Reshape", [rope(heads(q, h, layer.q_norm), local), gr.ints([0, hkv, -1, dh])])
        k = heads(k, hkv, layer.k_norm)
        v = gr.op(
            "Transpose",
            [gr.op("Reshape", [v, gr.ints([1, -1, hkv, dh])])],
            outputs=None if inplace else [f"new_v_{i}"],
            perm=[0, 2, 1, 3],
        )
        if split_cs is None:
            att = _attend_inplace(gr, i, q, rope(k, local), v, mask)
        else:
            att = _attend_split(gr, i, q, rope(k, local, f"new_k_{i}"), v, mask, split_cs)
        att = gr.op("Reshape", [att, gr.ints([0, h, -1, dh])])
        att = gr.op("Transpose", [att], perm=[0, 2, 1, 3])
        att = gr.op("Reshape", [att, gr.ints([-1, h * dh])])
        attn_out = post_norm(_linear(gr, att, layer.out, level, pad), layer.post_attn_norm)
        n2, x = norm(x, layer.ffn_norm, attn_out)
        gu = _linear(gr, n2, layer.gate_up, level, pad, keep_pad=True)
        gate, up = gr.op("Split", [gu, gr.ints([cfg.ffn_dim, cfg.ffn_dim])], n_out=2, axis=-1)
        if cfg.activation == "gelu_tanh":
            act = gr.op("Mul", [gr.op("Gelu", [gate], approximate="tanh"), up])
        else:
            act = gr.op("Mul", [gr.op("Mul", [gate, gr.op("Sigmoid", [gate])]), up])
        if pad is not None and gu in pad.carrying:
            pad.carrying.add(act)  # row-wise ops: the pad rows ride along
        delta = post_norm(_linear(gr, act, layer.down, level, pad), layer.post_ffn_norm)

    # Only the requested rows reach the final norm and the LM head.
    rows_x = gr.op("Gather", [x, "logit_rows"], axis=0)
    rows_d = gr.op("Gather", [delta, "logit_rows"], axis=0) if delta else None
    fin, _ = norm(rows_x, weights.out_norm, rows_d)
    head_pad = _RowPad(gr.op("Shape", ["logit_rows"])) if spec.row_padding else None
    logits = _linear(gr, fin, weights.lm_head, level, head_pad)
    gr.nodes.append(helper.make_node("Identity", [logits], ["logits"]))

    used = {name for node in gr.nodes for name in node.input}
    inits = [t for name, t in gr.inits.items() if name in used] + list(gr.consts.values())
    graph = helper.make_graph(gr.nodes, "npuchat_decoder", inputs, outputs, initializer=inits)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)],
        producer_name="npuchat",
        producer_version=BUILDER_VERSION,
    )
    model.ir_version = 10
    return model


def build_graphs(
    gguf_path: Path,
    specs: Mapping[str, GraphSpec],
    out_dir: Path,
    progress: Callable[[float], None] | None = None,
) -> dict[str, Path]:
    """Write `weights.bin` once and one `<name>.onnx` per spec into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with GGUFFile(gguf_path) as g:
        weights = write_weights(g, out_dir, progress)
        cfg = g.config
    paths = {}
    for name, spec in specs.items():
        model = make_graph(cfg, weights, spec)
        path = out_dir / f"{name}.onnx"
        onnx.save_model(model, str(path))
        paths[name] = path
    if progress:
        progress(1.0)
    return paths


def spec_digest(specs: Mapping[str, GraphSpec]) -> str:
    """A stable text of the graph set, for the compile-cache key."""
    blob = json.dumps({k: v.key() for k, v in sorted(specs.items())}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()
