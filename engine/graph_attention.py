"""Attention inside the decoder graph: the two cache layouts and how new K/V rows are stored.

`attend_split` is the NPU's static layout (the cache read only, the new rows returned for the
host to write); `attend_inplace` the CPU's (the new rows scattered into the cache first, in its
dtype, `kv_layout`). Both decompose attention into MatMul, Add(mask), Softmax, MatMul with Q as
`[B, Hkv, G·S, dh]` (`graph_builder` says why).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, numpy_helper

from .custom_ops import DOMAIN as KERNEL_DOMAIN
from .graph_ops import Graph
from .layer_inputs import MASK_NEG

__all__ = ["attend_inplace", "attend_split", "rope_attend"]


def attend_split(
    gr: Graph,
    i: int,
    q: str,
    k_new: str,
    v_new: str,
    mask: str,
    split_cs: str,
    k_smooth: np.ndarray | None = None,
) -> str:
    """Attention over the read-only cache plus the S new rows as separate column blocks.

    The static (NPU) layout: the cache is never copied, only the new rows come out (`new_k_i`,
    `new_v_i`, named by the caller) and the host writes them back, in the cache's dtype.
    `k_smooth` `[Hkv, dh]`: the cache is int8 (`kv_layout`), K stored as `k / s` with Q
    multiplied by `s` as in `attend_inplace`; this function then names `new_k_i` itself (the
    smoothed rows the host quantizes). int8 rows are read through a DequantizeLinear of scale
    1 (their integers; the QNN HTP rejects a Cast from int8, and takes the DequantizeLinear
    only straight into a MatMul's first input, so K's product is taken as `K·Qᵀ` and
    transposed after; the integers come in over 127 and the scales times 127, which keeps
    fp16 products in range), and each slot's scale multiplies its score row (K) and
    probability column (V). The new rows are attended rounded as their int8 storage will read
    back (`_rounded_like_int8`), as the CPU graph attends them from its cache; they come out
    unrounded for the host to quantize in float32.
    """
    past_k, past_v = f"past_k_{i}", f"past_v_{i}"
    if k_smooth is not None:
        k_new = gr.op(
            "Mul",
            [k_new, _per_channel(gr, f"k_inv_smooth_{i}", 1.0 / k_smooth)],
            outputs=[f"new_k_{i}"],
        )
        q = gr.op("Mul", [q, _per_channel(gr, f"k_smooth_{i}", k_smooth)])
        unit = gr.scalar(1.0 / 127.0)  # the integers over 127: |x| <= 1
        k_unit = gr.op("DequantizeLinear", [past_k, unit])
        qt = gr.op("Transpose", [q], perm=[0, 1, 3, 2])
        k_absmax = gr.op("Mul", [f"{past_k}_scale", gr.scalar(127.0)])  # [B, Hkv, C, 1]
        scored = gr.op("Mul", [gr.op("MatMul", [k_unit, qt]), k_absmax])  # [B, Hkv, C, G·S]
        scores_past = gr.op("Transpose", [scored], perm=[0, 1, 3, 2])
    else:
        scores_past = gr.op("MatMul", [q, gr.op("Transpose", [past_k], perm=[0, 1, 3, 2])])
    if k_smooth is not None:  # attend the new rows as the cache will hold them
        k_new, v_new = _rounded_like_int8(gr, k_new), _rounded_like_int8(gr, v_new)
    kt_new = gr.op("Transpose", [k_new], perm=[0, 1, 3, 2])
    scores = gr.op("Concat", [scores_past, gr.op("MatMul", [q, kt_new])], axis=-1)
    probs = gr.op("Softmax", [gr.op("Add", [scores, mask])], axis=-1)
    p_past, p_new = gr.op("Split", [probs, split_cs], n_out=2, axis=-1)
    if k_smooth is not None:
        v_absmax = gr.op("Mul", [f"{past_v}_scale", gr.scalar(127.0)])
        p_past = gr.op("Mul", [p_past, gr.op("Transpose", [v_absmax], perm=[0, 1, 3, 2])])
        past_v = gr.op("DequantizeLinear", [past_v, unit])
    return gr.op("Add", [gr.op("MatMul", [p_past, past_v]), gr.op("MatMul", [p_new, v_new])])


def attend_inplace(
    gr: Graph,
    i: int,
    q: str,
    k_new: str,
    v_new: str,
    mask: str,
    kv: tuple[str, int],
    k_smooth: np.ndarray | None = None,
    slots: str = "kv_slots",
    window: str | None = None,
    native_mask: str | None = None,
) -> str:
    """Attention after scattering the S new rows into the cache at `kv_slots` (the CPU layout).

    Every row then attends the same `[C]` columns in the same order whether it came in a decode
    step or a verify step, so the two give bit-identical results (speculation is exact). The
    host binds `present_*_i` to the same buffers as `past_*_i`, and ONNX Runtime's ScatterND
    skips its copy when input and output are one buffer: the rows land in the cache in place.
    A cache of another dtype (`kv_layout`) stores the rows converted and attention reads them
    back as float32; each row is converted alone, so decode and verify still agree. int8 rows
    are read as their integers and each slot's scale multiplies its score column (K) and its
    probability column (V): `[G·S, C]` products instead of `[C, dh]` ones, and a plain Cast
    instead of a blocked DequantizeLinear, which ONNX Runtime runs ~20x slower than Cast.
    `k_smooth` `[Hkv, dh]` (int8, `kv_smoothing`): K is stored as `k / s` and Q multiplied by
    `s`, powers of two, so the scores are those of the unscaled rows.
    `slots` names the slot input (a sliding-window layer's ring has its own, `kv_ring`).
    `window`: a `[1]` int64 tensor A (the mask's width): attention reads only the cache's first
    A slots. A step whose rows hold a few hundred slots then pays for those, not for the
    capacity a long prompt in another row moved the cache to; the columns it leaves out are
    ones the mask hides, so every row's result is the same bit for bit at any A that covers it
    (the products and sums over hidden columns add exact zeros).
    `native_mask`: the step's own `[B, 1, S, A]` mask (not tiled by G); a float32 cache is then
    attended by the native `npuchat.Attention` op, which reads the cache's first A slots in
    place (no Slice copy, no packing of K and V for a MatMul; `native/attention_op.cc`), and
    skips the slots the mask hides (`MASK_NEG`): a decode row beside a long prompt reads its
    own slots only. An f16 cache's first A slots are widened by a Cast for it (what
    `RopeAttentionF16` computes, bit for bit, without the copy).
    """
    if native_mask is not None and kv[0] in ("f32", "f16"):
        if kv[0] == "f32":  # read in place
            k_all = gr.op("ScatterND", [f"past_k_{i}", slots, k_new], outputs=[f"present_k_{i}"])
            v_all = gr.op("ScatterND", [f"past_v_{i}", slots, v_new], outputs=[f"present_v_{i}"])
        else:  # the window's slots widened
            k_all, _ = _store_rows(gr, i, "k", k_new, *kv, slots, window)
            v_all, _ = _store_rows(gr, i, "v", v_new, *kv, slots, window)
        inputs = [q, k_all, v_all, native_mask]  # a slot at MASK_NEG never reaches the result
        return gr.op("Attention", inputs, domain=KERNEL_DOMAIN, hidden=MASK_NEG)
    if k_smooth is not None:
        k_new = gr.op("Mul", [k_new, _per_channel(gr, f"k_inv_smooth_{i}", 1.0 / k_smooth)])
        q = gr.op("Mul", [q, _per_channel(gr, f"k_smooth_{i}", k_smooth)])
    k_all, k_scale = _store_rows(gr, i, "k", k_new, *kv, slots, window)
    v_all, v_scale = _store_rows(gr, i, "v", v_new, *kv, slots, window)
    scores = gr.op("MatMul", [q, gr.op("Transpose", [k_all], perm=[0, 1, 3, 2])])
    if k_scale:
        scores = gr.op("Mul", [scores, k_scale])
    probs = gr.op("Softmax", [gr.op("Add", [scores, mask])], axis=-1)
    if v_scale:
        probs = gr.op("Mul", [probs, v_scale])
    return gr.op("MatMul", [probs, v_all])


def rope_attend(
    gr: Graph,
    i: int,
    qkv: str,
    heads: tuple[int, int],
    rope: tuple[str, str],
    slots: str,
    mask: str,
    row_select: bool,
    norms: tuple[str, str, float] = ("", "", 0.0),
    half: bool = False,
) -> str:
    """One layer's attention from its Q|K|V matmul rows to the output projection's input rows,
    as the native `npuchat.RopeAttention` op (`RopeAttentionF16` when `half`: the cache holds
    float16, rows rounded as a Cast rounds them): the rows' split and rotary, the new K/V rows
    written into the cache in place (`present_*_i`, bound to the past buffers), and
    `npuchat.Attention`'s arithmetic over the mask's slots, in one op instead of seventeen (a
    small model's decode step pays per op). `heads`: (H, Hkv); `rope`: its (cos, sin) inputs;
    `row_select`: `row_tokens` / `token_rows` pick the matmuls' rows (module doc of
    `graph_builder`); `norms`: the layer's Q and K head-norm weights ("" for none) and their
    epsilon (qwen3, gemma3). The results are the separate ops' bit for bit
    (`tests/test_rope_attention.py`).
    """
    inputs = [qkv, *rope, slots, f"past_k_{i}", f"past_v_{i}", mask]
    inputs += ["row_tokens", "token_rows"] if row_select else ["", ""]
    inputs += norms[:2]
    while not inputs[-1]:  # optional inputs at the end are left out
        inputs.pop()
    att, _, _ = gr.op(
        "RopeAttentionF16" if half else "RopeAttention",
        inputs,
        outputs=[f"rope_attention_{i}", f"present_k_{i}", f"present_v_{i}"],
        domain=KERNEL_DOMAIN,
        num_heads=heads[0],
        kv_heads=heads[1],
        hidden=MASK_NEG,
        epsilon=norms[2],
    )
    return att


def _store_rows(
    gr: Graph,
    i: int,
    kind: str,
    new: str,
    kv_dtype: str,
    head_dim: int,
    slots: str,
    window: str | None = None,
) -> tuple[str, str | None]:
    """Scatter the new rows `[B, Hkv, S, dh]` into cache `kind` of layer i in its dtype.

    Returns the cache as float32 `[B, Hkv, C, dh]` (its first `window` slots when given) and,
    for int8, its scales as a row `[B, Hkv, 1, C]` (the values are then the integers; the
    caller applies the scales). int8: one scale per row of a head, `max(absmax / 127, tiny)`
    (tiny keeps an all-zero row finite), and one blocked QuantizeLinear over head_dim (Div,
    Round and a saturating Cast in one op). The window is cut before any conversion, so only
    its slots are converted.
    """
    past, present = f"past_{kind}_{i}", f"present_{kind}_{i}"

    def cut(x: str) -> str:  # the first `window` slots (axis 2)
        return gr.op("Slice", [x, gr.ints([0]), window, gr.ints([2])]) if window else x

    if kv_dtype == "f32":
        return cut(gr.op("ScatterND", [past, slots, new], outputs=[present])), None
    if kv_dtype == "f16":
        rows = gr.op("Cast", [new], to=TensorProto.FLOAT16)
        stored = gr.op("ScatterND", [past, slots, rows], outputs=[present])
        return gr.op("Cast", [cut(stored)], to=TensorProto.FLOAT), None
    absmax = gr.op("ReduceMax", [gr.op("Abs", [new]), gr.ints([-1])], keepdims=1)
    scale = gr.op("Max", [gr.op("Div", [absmax, gr.scalar(127.0)]), gr.scalar(1e-30)])
    rows = gr.op(
        "QuantizeLinear", [new, scale], axis=-1, block_size=head_dim, output_dtype=TensorProto.INT8
    )
    stored = gr.op("ScatterND", [past, slots, rows], outputs=[present])
    scales = gr.op("ScatterND", [f"{past}_scale", slots, scale], outputs=[f"{present}_scale"])
    columns = gr.op("Transpose", [cut(scales)], perm=[0, 1, 3, 2])  # [B, Hkv, 1, C]: C floats
    return gr.op("Cast", [cut(stored)], to=TensorProto.FLOAT), columns


def _rounded_like_int8(gr: Graph, rows: str) -> str:
    """`rows` `[B, Hkv, S, dh]` rounded to what their int8 storage reads back (scale per row,
    `absmax / 127`, as `_store_rows`), in float: the HTP runs Round but no float-int8 cast."""
    absmax = gr.op("ReduceMax", [gr.op("Abs", [rows]), gr.ints([-1])], keepdims=1)
    scale = gr.op("Max", [gr.op("Div", [absmax, gr.scalar(127.0)]), gr.scalar(1e-30)])
    return gr.op("Mul", [gr.op("Round", [gr.op("Div", [rows, scale])]), scale])


def _per_channel(gr: Graph, name: str, values: np.ndarray) -> str:
    """A float32 constant `[1, Hkv, 1, dh]` that broadcasts over batch and rows."""
    arr = np.ascontiguousarray(values, np.float32)[None, :, None, :]
    gr.consts[name] = numpy_helper.from_array(arr, name)
    return name
