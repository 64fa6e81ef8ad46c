"""What a decoder graph takes and gives: its inputs and outputs for a spec and its dims.

Kept apart from the assembly in `graph_builder` because every variant (CPU in place, NPU static,
ring layers, int8 K/V, row selection) adds inputs, and the list is easier to check as one place
than interleaved with the layer ops. The inputs themselves are described in `graph_builder`'s
module doc.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from onnx import TensorProto, ValueInfoProto, helper

from .gguf_reader import ModelConfig
from .graph_inputs import GraphDims, GraphSpec

__all__ = ["graph_io"]

KV_ELEM = {"f32": TensorProto.FLOAT, "f16": TensorProto.FLOAT16, "int8": TensorProto.INT8}


def _value_info(name: str, dims: Sequence[int | str], elem: int = TensorProto.FLOAT) -> Any:
    return helper.make_tensor_value_info(name, elem, list(dims))


def graph_io(
    cfg: ModelConfig, spec: GraphSpec, dims: GraphDims
) -> tuple[list[ValueInfoProto], list[ValueInfoProto]]:
    """The inputs and outputs of the graph for `spec` (`graph_builder` module doc)."""
    d, dh, hkv = cfg.d_model, cfg.head_dim, cfg.n_kv_heads
    b, s = dims.batch, dims.seq
    inplace = spec.kv_inplace
    kv_elem = KV_ELEM[spec.kv_dtype]
    total = dims.plus_seq(dims.capacity, "CS")
    w_total = dims.plus_seq(dims.ring_rows, "WS") if dims.ring else total
    every_slides = bool(cfg.swa_layers) and all(cfg.swa_layers)
    attended = "A" if spec.attn_window else dims.capacity  # the slots a step reads (≤ C)
    if every_slides:
        mask_cols = (dims.ring_rows if dims.ring else attended) if inplace else w_total
    else:
        mask_cols = attended if inplace else total
    inputs = [
        _value_info("embeddings", [b, s, d]),
        _value_info("mask", [b, 1, s, mask_cols]),
        _value_info("cos", [b, s, dh // 2]),
        _value_info("sin", [b, s, dh // 2]),
        _value_info("logit_rows", [dims.logit_rows], TensorProto.INT64),
    ]
    if cfg.mixed_windows:  # the sliding layers' mask (`layer_inputs`)
        swa_cols = (dims.ring_rows if dims.ring else attended) if inplace else w_total
        inputs.append(_value_info("mask_swa", [b, 1, s, swa_cols]))
    if cfg.local_rope:  # the sliding layers' rotary tables
        inputs += [_value_info(f"{t}_swa", [b, s, dh // 2]) for t in ("cos", "sin")]
    if inplace:
        inputs.append(_value_info("kv_slots", [b, hkv, s, 3], TensorProto.INT64))
        if dims.ring and cfg.mixed_windows:  # the ring layers' slots (all-sliding: `kv_slots`)
            inputs.append(_value_info("kv_slots_swa", [b, hkv, s, 3], TensorProto.INT64))
    if spec.row_padding:
        inputs.append(_value_info("pad_rows", ["P"], TensorProto.INT64))
    if spec.row_select:
        inputs.append(_value_info("token_rows", ["N"], TensorProto.INT64))
        inputs.append(_value_info("row_tokens", ["BS"], TensorProto.INT64))
    outputs = [_value_info("logits", [dims.logit_rows, cfg.vocab_size])]
    out_prefix = "present" if inplace else "new"
    for i in range(cfg.n_layers):
        c_i = dims.rows_of(i)
        rows_dim = c_i if inplace else s
        for kind in "kv":
            inputs.append(_value_info(f"past_{kind}_{i}", [b, hkv, c_i, dh], kv_elem))
            out = f"{out_prefix}_{kind}_{i}"
            out_elem = kv_elem if inplace else TensorProto.FLOAT  # static: the host stores them
            outputs.append(_value_info(out, [b, hkv, rows_dim, dh], out_elem))
        if spec.kv_dtype == "int8":  # a scale per (token, head): `kv_layout`
            for kind in "kv":
                inputs.append(_value_info(f"past_{kind}_{i}_scale", [b, hkv, c_i, 1]))
                if inplace:
                    outputs.append(_value_info(f"present_{kind}_{i}_scale", [b, hkv, c_i, 1]))
    return inputs, outputs
