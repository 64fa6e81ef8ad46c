"""GGUF → ONNX graphs of the whole decoder: one step of S new tokens over a static KV cache.

One graph computes S new positions for each of B sequences against C cached ones; each sequence
is one row of the batch dimension and of the cache, with its own positions and mask. Inputs
(all float32 unless noted):

* `embeddings` `[B, S, D]` — rows of the token embedding, looked up on the host (the table stays
  quantized in the GGUF mapping; only the rows used are ever decoded);
* `mask` `[B, 1, S, C+S]` — additive: 0 = attend, `MASK_NEG` = ignore; columns are the C cached
  slots followed by the S new rows (causal among themselves);
* `cos`, `sin` `[B, S, dh/2]` — rotary tables for each row's S positions, computed on the host;
* `logit_rows` int64 `[R]` — which of the B·S rows (row-major) get logits (prefill: the last of
  each sequence; verify: all); with `token_rows`, which of those N rows;
* `past_k_i`, `past_v_i` `[B, Hkv, C, dh]` — the cache rows of the B sequences, read only.

Outputs: `logits` `[R, vocab]` and `new_k_i`, `new_v_i` `[B, Hkv, S, dh]` — only the new
rows; the host writes them into the cache (DESIGN §3). Attention is decomposed into MatMul →
Add(mask) → Softmax → MatMul with Q reshaped to `[B, Hkv, G·S, dh]` and the mask tiled by G
(DESIGN §5: fastest on HTP; no GroupQueryAttention and no com.microsoft RotaryEmbedding, which
the NPU rejects; rotary is ONNX's own opset-23 `RotaryEmbedding`, which it accepts). Scores
against the cache and against the new rows are computed separately and concatenated, so the
cache itself is never concatenated (copied) inside the graph. The matmuls take the B·S rows as
one 2-D input, so a batched decode step reads every weight once for all B sequences (decode is
bound by reading the weights); attention is per sequence (batched MatMuls over B).

The CPU graph (`GraphSpec.kv_inplace`) differs in attention only: an int64 input `kv_slots` `[B,
Hkv, S, 3]` says where the new rows go (batch row, head, slot), ScatterND writes them into the
cache, and every row attends the cache's first A columns under a `[B, 1, S, A]` mask, A ≤ C
(`GraphSpec.attn_window`: the host picks A for the step's rows, `kv_layout.attention_window`).
Its outputs `present_k_i`, `present_v_i` are the whole cache, bound by the host to the input buffers
themselves, so the scatter is in place (ONNX Runtime skips ScatterND's copy when input and
output share a buffer). Why: a token's row is then computed identically whether it arrives alone
(decode) or with the drafts after it (verify), which exact speculative decoding needs (`model`
module doc).

The CPU cache may store K/V as float16 or int8 with a scale per (token, head), K smoothed per
channel (`GraphSpec.kv_dtype`, `kv_layout`, `kv_smoothing`): the scatter then writes converted
rows (and, for int8, `past_*_i_scale` inputs /
`present_*_i_scale` outputs `[B, Hkv, C, 1]`, bound in place the same way) and attention reads
the cache back as float32. The static (NPU) graph may read an int8 cache too (its scales as
`past_*_i_scale` inputs; `graph_attention.attend_split`); its new rows still come out as float32
and the host quantizes them.

The CPU graph also takes `token_rows` int64 `[N]` (which of the B·S rows are real tokens) and
`row_tokens` int64 `[B·S]` (which of those N tokens each row of the rectangle copies): the
residual stream and every matmul run on the N real rows only, and the rectangle is rebuilt for
attention (`Gather` by `row_tokens`) and left again after it. A step that mixes a prefill chunk of
S tokens with decode tokens of other sequences then costs S + decodes rows of matmuls instead of
B·S (the left-padded rows of the decode sequences); a plain step passes the identity (two
Gathers per layer).

Every op costs ~2–5 µs of dispatch on this CPU whatever its size, and SmolLM2 runs 30 layers per
token in a ~8 ms budget, so the graph is built for few ops: Q/K/V and gate/up are one fused
matmul each, biases ride in `MatMulNBits`' bias input, attention's 1/√dh is folded into the Q
weights, and on the CPU residual adds fuse into `SkipSimplifiedLayerNormalization`
(`GraphSpec.fused_norms`; the NPU rejects that op and gets Add + norm). With the native kernels
the norm and its residual Add go into the QMatMul that reads them (`graph_ops.normed_linear`),
and everything between a layer's Q|K|V matmul and its output projection (row selection, split,
head norms, rotary, the cache writes, attention) is one `npuchat.RopeAttention`
(`graph_attention.rope_attend`; `GraphSpec.fused_attention`), `RopeAttentionF16` over an f16
cache (half the bytes a long context's decode step reads, as llama.cpp's default cache).

Sliding-window layers may keep a ring of their own size instead of C rows (`GraphSpec.ring`,
`kv_ring`): their `past_*_i` are `[B, Hkv, W, dh]`, their mask (`mask_swa`, or `mask` when every
layer slides) covers those W columns (W + S in the static layout), and the CPU graph scatters
their rows at `kv_slots_swa` (position mod W; `kv_slots` when every layer slides).

S and C may be fixed (static graphs, what an NPU compiles) or left symbolic (`None`): on the CPU
one symbolic graph serves prefill, decode and verify at every capacity from one session, so the
weights are prepacked once (ONNX Runtime's Python API cannot share prepacked weights between
sessions; three static sessions would hold three copies).

All three architectures use NEOX rotary. llama.cpp applies "normal" (adjacent-pair) rotary to
llama models, whose Q/K rows the GGUF converter permuted; permuting those rows back per head
makes NEOX rotary on the result identical (attention scores are invariant to a common
permutation of Q and K dims), so the graph has one rotary form.

The weights are written by `graph_weights` (once per model, shared by every graph), the
matmul building blocks live in `graph_ops`, the spec and dims in `graph_inputs`, the I/O list in
`graph_io`, what keys a built folder in `graph_key`; this module assembles the decoder from them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from .custom_ops import DOMAIN as KERNEL_DOMAIN
from .errors import NpuchatError
from .gguf_initializers import write_index
from .gguf_reader import GGUFFile, ModelConfig
from .graph_attention import attend_inplace, attend_split, rope_attend
from .graph_inputs import GraphDims, GraphSpec
from .graph_io import graph_io
from .graph_key import BUILDER_VERSION
from .graph_ops import (
    Graph,
    Norm,
    RowPad,
    fuses_norm,
    gated_mlp,
    glu_fuses,
    linear,
    normed_linear,
)
from .graph_weights import Layer, Weights, write_weights
from .kv_smoothing import graph_layout, k_smoothing
from .layer_inputs import rope_tables

__all__ = ["GraphSpec", "build_graphs", "make_graph", "rope_tables", "write_weights"]

OPSET = 23  # RotaryEmbedding


def make_graph(
    cfg: ModelConfig,
    weights: Weights,
    spec: GraphSpec,
    k_smooth: Sequence[np.ndarray] = (),
) -> onnx.ModelProto:
    """The decoder graph for one `spec`, referencing the already written weights; an int8 cache
    stores K smoothed by `k_smooth` (per layer, file order: `kv_smoothing`)."""
    gr = Graph(weights.tensors)
    d, dh = cfg.d_model, cfg.head_dim
    h, hkv, grp = cfg.n_heads, cfg.n_kv_heads, cfg.n_groups
    dims = GraphDims.of(cfg, spec)
    s_dim, ring, rows_of = dims.seq, dims.ring, dims.rows_of
    level = spec.accuracy_level
    eps = float(cfg.rms_eps)
    inplace = spec.kv_inplace
    if spec.kv_dtype == "f16" and not inplace:
        raise NpuchatError("f16 K/V is built for the CPU graph only; use f32 or int8")
    inputs, outputs = graph_io(cfg, spec, dims)

    # Shared per-step tensors: the mask tiled over the G query heads of each KV head, and the
    # [C, S] split of the attention columns into cached slots and new rows.
    def tiled(name: str) -> str:
        return gr.op("Tile", [name, gr.ints([1, 1, grp, 1])]) if grp > 1 else name

    masks: dict[bool, str] = {}  # made when a layer needs one (not by the fused attention)

    def tiled_mask(local: bool) -> str:
        key = local and cfg.mixed_windows
        if key not in masks:
            masks[key] = tiled("mask_swa" if key else "mask")
        return masks[key]

    splits: dict[int | str, str] = {}
    ends: dict[str, str] = {}

    def windows(local: bool) -> str | None:
        """The slots a layer over the full capacity attends: its mask's width (`attn_window`);
        a ring layer (`kv_ring`) attends its whole ring."""
        if local and ring:
            return None
        name = "mask_swa" if local and cfg.mixed_windows else "mask"
        if name not in ends:
            ends[name] = gr.op("Shape", [name], start=3, end=4)
        return ends[name]

    def split_cs(layer: int) -> str:
        """The [C, S] split of the attention columns into cached slots and new rows."""
        rows = rows_of(layer)
        if rows not in splits:
            if isinstance(rows, int) and isinstance(s_dim, int):
                splits[rows] = gr.ints([rows, s_dim])
            else:
                cap = gr.op("Shape", [f"past_k_{layer}"], start=2, end=3)
                seq = gr.op("Shape", ["embeddings"], start=1, end=2)
                splits[rows] = gr.op("Concat", [cap, seq], axis=0)
        return splits[rows]

    fuse_norms = spec.fused_norms and spec.native_kernels  # into QMatMul (`normed_linear`)

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

    def rotary(local: bool) -> tuple[str, str]:
        """A layer's (cos, sin) inputs."""
        return ("cos_swa", "sin_swa") if local and cfg.local_rope else ("cos", "sin")

    def rope(x: str, local: bool, out: str | None = None) -> str:
        return gr.op("RotaryEmbedding", [x, *rotary(local)], outputs=[out] if out else None)

    def cache_io(local: bool) -> tuple[str, str]:
        """An in-place layer's slot input and its own (untiled) mask."""
        slots = "kv_slots_swa" if local and ring and cfg.mixed_windows else "kv_slots"
        return slots, "mask_swa" if local and cfg.mixed_windows else "mask"

    def post_norm(x: str, weight: str) -> str:
        if not weight:
            return x
        return gr.op("SimplifiedLayerNormalization", [x, weight], axis=-1, epsilon=eps)

    # The residual stream is 2-D [B·S, D] (MatMulNBits and the norms take it; Gemm needs it):
    # the matmuls see the batch's rows as one, so the weights are read once per step.
    x, delta = gr.op("Reshape", ["embeddings", gr.ints([-1, d])]), None
    if spec.row_select:  # the N real rows only (module doc)
        x = gr.op("Gather", [x, "token_rows"], axis=0)
    if cfg.embed_scale != 1.0:
        x = gr.op("Mul", [x, gr.scalar(cfg.embed_scale)])
    pad = RowPad(gr.op("Shape", [x], start=0, end=1)) if spec.row_padding else None
    heads: dict[int, str] = {}

    def per_head(n_heads: int) -> str:
        """The shape `[B, S, n_heads, dh]` that splits `[B·S, n_heads·dh]` back into rows."""
        if n_heads not in heads:
            if spec.batch is not None:
                heads[n_heads] = gr.ints([spec.batch, -1, n_heads, dh])
            else:
                batch = gr.op("Shape", ["embeddings"], start=0, end=1)
                heads[n_heads] = gr.op("Concat", [batch, gr.ints([-1, n_heads, dh])], axis=0)
        return heads[n_heads]

    def split_heads(x: str, n: int, norm_weight: str) -> str:
        """[B·S, n·dh] -> [B, n, S, dh], each head RMS-normed first when the arch norms Q/K."""
        if norm_weight:  # over [B·S·n, dh] rows: on 4-D input the HTP computed wrong norms
            x = gr.op("Reshape", [x, gr.ints([-1, dh])])
            x = gr.op("SimplifiedLayerNormalization", [x, norm_weight], axis=-1, epsilon=eps)
        return gr.op("Transpose", [gr.op("Reshape", [x, per_head(n)])], perm=[0, 2, 1, 3])

    def attention(i: int, layer: Layer, local: bool, qkv: str) -> str:
        """Layer i's attention as separate ops, from its Q|K|V rows to the rows the output
        projection reads (what `rope_attend` fuses where it applies)."""
        mask = tiled_mask(local)
        if spec.row_select:  # back to the B·S rows attention takes
            qkv = gr.op("Gather", [qkv, "row_tokens"], axis=0)
        q, k, v = gr.op("Split", [qkv, gr.ints([h * dh, hkv * dh, hkv * dh])], n_out=3, axis=-1)
        # Q [B·S,H·dh] -> [B,H,S,dh] -> rotary -> [B,Hkv,G·S,dh] (rows g·S + s, as Tile(mask))
        q = split_heads(q, h, layer.q_norm)
        q = gr.op("Reshape", [rope(q, local), gr.ints([0, hkv, -1, dh])])
        k = split_heads(k, hkv, layer.k_norm)
        v = gr.op(
            "Transpose",
            [gr.op("Reshape", [v, per_head(hkv)])],
            outputs=None if inplace else [f"new_v_{i}"],
            perm=[0, 2, 1, 3],
        )
        smooth = graph_layout(k_smooth[i], cfg) if spec.kv_dtype == "int8" else None
        if inplace:  # no [C, S] column split: attention reads the cache only
            slots, own_mask = cache_io(local)
            store = (spec.kv_dtype, dh)
            window = windows(local) if spec.attn_window else None
            native = own_mask if spec.native_kernels else None
            att = attend_inplace(
                gr, i, q, rope(k, local), v, mask, store, smooth, slots, window, native
            )
        elif smooth is not None:  # int8: attend_split names the smoothed rows `new_k_i`
            att = attend_split(gr, i, q, rope(k, local), v, mask, split_cs(i), smooth)
        else:
            att = attend_split(gr, i, q, rope(k, local, f"new_k_{i}"), v, mask, split_cs(i))
        att = gr.op("Reshape", [att, gr.ints([0, h, -1, dh])])
        att = gr.op("Transpose", [att], perm=[0, 2, 1, 3])
        att = gr.op("Reshape", [att, gr.ints([-1, h * dh])])
        if spec.row_select:
            att = gr.op("Gather", [att, "token_rows"], axis=0)
        return att

    for i, layer in enumerate(weights.layers):
        local = bool(cfg.swa_layers) and cfg.swa_layers[i]
        if fuse_norms and delta is not None and fuses_norm(layer.qkv):
            qkv, x = normed_linear(gr, x, Norm(layer.attn_norm, eps, delta), layer.qkv)
        else:
            n1, x = norm(x, layer.attn_norm, delta)
            qkv = linear(gr, n1, layer.qkv, level, pad)
        fused = inplace and spec.native_kernels and spec.fused_attention
        head_norms = bool(layer.q_norm or layer.k_norm)
        if fused and spec.kv_dtype != "int8" and (dh % 8 == 0 or not head_norms):
            norms = (layer.q_norm, layer.k_norm, eps)
            half = spec.kv_dtype == "f16"
            cache = (*cache_io(local), spec.row_select, norms, half)
            att = rope_attend(gr, i, qkv, (h, hkv), rotary(local), *cache)
        else:
            att = attention(i, layer, local, qkv)
        attn_out = post_norm(linear(gr, att, layer.out, level, pad), layer.post_attn_norm)
        if fuse_norms and glu_fuses(layer.gate_up, cfg.activation):
            ffn_norm = Norm(layer.ffn_norm, eps, attn_out)
            act, x = normed_linear(gr, x, ffn_norm, layer.gate_up, glu=True)
        else:
            n2, x = norm(x, layer.ffn_norm, attn_out)
            act = gated_mlp(gr, n2, layer.gate_up, cfg.ffn_dim, cfg.activation, level, pad)
        delta = post_norm(linear(gr, act, layer.down, level, pad), layer.post_ffn_norm)

    # Only the requested rows reach the final norm and the LM head.
    rows_x = gr.op("Gather", [x, "logit_rows"], axis=0)
    rows_d = gr.op("Gather", [delta, "logit_rows"], axis=0) if delta else None
    if fuse_norms and rows_d is not None and fuses_norm(weights.lm_head):
        out_norm = Norm(weights.out_norm, eps, rows_d)
        logits, _ = normed_linear(gr, rows_x, out_norm, weights.lm_head)
    else:
        fin, _ = norm(rows_x, weights.out_norm, rows_d)
        head_pad = RowPad(gr.op("Shape", ["logit_rows"])) if spec.row_padding else None
        logits = linear(gr, fin, weights.lm_head, level, head_pad)
    gr.nodes.append(helper.make_node("Identity", [logits], ["logits"]))

    used = {name for node in gr.nodes for name in node.input}
    inits = [t for name, t in gr.inits.items() if name in used] + list(gr.consts.values())
    graph = helper.make_graph(gr.nodes, "npuchat_decoder", inputs, outputs, initializer=inits)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)]
        + ([helper.make_opsetid(KERNEL_DOMAIN, 1)] if spec.native_kernels else []),
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
        native = any(s.native_kernels for s in specs.values())
        if native and not all(s.native_kernels for s in specs.values()):
            raise ValueError("graphs sharing one weights.bin all use the native kernels or none")
        regroup = {s.regroup_k for s in specs.values()}
        if len(regroup) > 1:
            raise ValueError("graphs sharing one weights.bin all regroup K-quant rows or none")
        weights = write_weights(g, out_dir, progress, native=native, regroup=regroup.pop())
        cfg = g.config
        smooth = k_smoothing(g) if any(s.kv_dtype == "int8" for s in specs.values()) else []
    paths = {}
    for name, spec in specs.items():
        model = make_graph(cfg, weights, spec, smooth)
        path = out_dir / f"{name}.onnx"
        onnx.save_model(model, str(path))
        write_index(model, path)
        paths[name] = path
    if progress:
        progress(1.0)
    return paths
