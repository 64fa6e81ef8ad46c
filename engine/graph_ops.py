"""The graph's building blocks: a node accumulator and the matmuls (quantized, offset, padded).

`linear` is the one place a weight matrix becomes ops: `MatMulNBits` (with the block-offset Gemm
for asymmetric blocks) or a dense MatMul, and, for exact decode steps, the row padding that makes
a lone row take the same kernels as a row among others (`RowPad`).

Decode and verify agree bit for bit, which is what makes speculative decoding exact. Two things
would otherwise make them differ, and ONNX Runtime's int8-activation kernels turn a 1e-6
difference into logit differences of 0.2–0.9 within one forward pass (a rounding flip of one
quantized activation moves it by a whole step; measured on SmolLM2 and Qwen2.5-0.5B):

* attention summing the same terms in another order: solved in the graph (K/V scattered into the
  cache first, so every row attends the same columns in the same order);
* `MatMulNBits` choosing a one-row kernel for one row and a multi-row kernel for more, which
  round differently (~1e-6 for 4-bit weights; 8-bit ones agree): so a step with one row of
  logits (a decode step; a prefill chunk, whose LM head sees its last row only) passes
  `pad_rows = [0]` and the graph runs just the matmuls whose kernels differ on its rows plus a
  copy of row 0 (`RowPad`); every other op runs on the real rows (`Model.exact_decode`).
  A prefill chunk then gives the same logits alone as mixed into a batched step.
  Padding only those matmuls, rather than running the whole step on two rows as builder v8 did,
  gave qwen2.5-coder-0.5b (mostly 8-bit) 6–13% more decode speed, and SmolLM2 and the 1.5B
  (mostly 4-bit) the same speed within noise (A/B runs, alternating). A draft model's own
  decode need not match its verify rows, so drafters turn padding off.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .custom_ops import DOMAIN as KERNEL_DOMAIN
from .graph_weights import Linear

__all__ = ["Graph", "Norm", "RowPad", "fuses_norm", "glu_fuses", "linear", "normed_linear"]


class Graph:
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


def _kernel_rows_matter(lin: Linear) -> bool:
    """Whether this matmul gives a row different bits alone than among other rows.

    ONNX Runtime runs `MatMulNBits` through a one-row kernel when M = 1. For symmetric 8-bit
    weights it agrees with the multi-row kernel bit for bit; for 4-bit weights it rounds
    differently (~1e-6, measured on ORT 1.32, AVX2). Offset Gemms and dense float MatMuls are
    counted as differing too (MLAS has GEMV paths for one row). `npuchat.QMatMul` computes
    every row alone (`custom_ops`).
    """
    if lin.ggml_type:
        return False
    return lin.bits != 8 or bool(lin.mins)


class RowPad:
    """Runs the matmuls whose one-row kernel differs on `x` plus the rows `pad_rows` of `x`.

    A step with one row of logits (decode; a prefill chunk, at the LM head) passes
    `pad_rows = [0]`: those matmuls then see one more row and take the multi-row kernel a
    verify step takes, and their output is sliced back to the S real rows; every other op runs
    on the real rows. Verify, batched and draft steps pass no rows; the Concat and Slice still
    copy their tensors then (~2% of a 1.5B prefill chunk), so the MLP keeps the pad
    rows from gate/up through to down (`carrying`) instead of slicing and re-padding its widest
    tensors. `None` when the graph has no `pad_rows` input (the NPU's static graphs).
    """

    def __init__(self, rows: str) -> None:
        self.rows = rows  # the row count of every input padded here (a [1] int64 tensor)
        self.padded: dict[str, str] = {}  # x -> x with the pad rows
        self.sliced: dict[str, str] = {}  # a carrying tensor -> its S real rows
        self.carrying: set[str] = set()  # tensors that already hold the pad rows

    def pad(self, gr: Graph, x: str) -> str:
        if x in self.carrying:
            return x
        if x not in self.padded:
            extra = gr.op("Gather", [x, "pad_rows"], axis=0)
            self.padded[x] = gr.op("Concat", [x, extra], axis=0)
        return self.padded[x]

    def unpad(self, gr: Graph, y: str) -> str:
        if y not in self.carrying:
            return y
        if y not in self.sliced:
            self.sliced[y] = gr.op("Slice", [y, gr.ints([0]), self.rows, gr.ints([0])])
        return self.sliced[y]

    def input_for(self, gr: Graph, x: str, lin: Linear) -> str:
        """`x` as the matmul `lin` takes it: padded if its kernels differ, else plain rows."""
        return self.pad(gr, x) if _kernel_rows_matter(lin) else self.unpad(gr, x)


@dataclass(frozen=True)
class Norm:
    """RMSNorm(x + skip) * weight, applied by the QMatMul that reads it (`normed_linear`)."""

    weight: str
    eps: float
    skip: str  # the residual added to x first


def qmatmul(
    gr: Graph, x: str, lin: Linear, glu: bool = False, norm: Norm | None = None, sums: bool = False
) -> Any:
    """`npuchat.QMatMul` on `lin`'s blocks, its bias added by the op (the same float sum as an
    Add after it, one op fewer); `glu`: `lin` is gate|up and the op gives silu(gate) * up;
    `norm`: the op reads `norm` of `x` (and with `sums`, also returns x + skip: (y, sum))."""
    extra: dict[str, Any] = {"glu": 1} if glu else {}
    if lin.layout:
        extra["layout"] = lin.layout
    if lin.paired:
        extra["paired"] = 1
    ins = [x, lin.b] + ([lin.bias] if lin.bias else [])
    if norm is not None:  # no skip: `x` is already the sum
        ins = [x, lin.b, lin.bias, norm.skip if sums else "", norm.weight]
        extra["epsilon"] = float(norm.eps)
    return gr.op(
        "QMatMul",
        ins,
        n_out=2 if sums else 1,
        domain=KERNEL_DOMAIN,
        ggml_type=lin.ggml_type,
        N=lin.n,
        K=lin.k,
        scale=float(lin.scale),
        scaled_rows=lin.scaled_rows,
        **extra,
    )


def fuses_norm(lins: Sequence[Linear]) -> bool:
    """Whether every group of a matmul runs on QMatMul, which then applies the norm before it
    itself (`normed_linear`)."""
    return bool(lins) and all(lin.ggml_type for lin in lins)


def normed_linear(
    gr: Graph, x: str, norm: Norm, lins: Sequence[Linear], glu: bool = False
) -> tuple[str, str]:
    """`linear` of `norm`(x) for groups that all run on QMatMul (`fuses_norm`): each op
    normalises its input itself, so the `SkipSimplifiedLayerNormalization` leaves the graph
    (one dispatch fewer per norm; no normed copy of the residual stream written and read back),
    with the same bits: the op sums, norms and scales as ONNX Runtime's does. The first group
    adds the skip and returns the sum; later groups read that sum. Returns (y, x + skip)."""
    outs = []
    y, stream = qmatmul(gr, x, lins[0], glu, norm, sums=True)
    outs.append(y)
    for lin in lins[1:]:
        outs.append(qmatmul(gr, stream, lin, glu, norm))
    out = outs[0] if len(outs) == 1 else gr.op("Concat", outs, axis=-1)
    return out, stream


def glu_fuses(gate_up: Sequence[Linear], activation: str) -> bool:
    """Whether one QMatMul computes the MLP's silu(gate) * up itself (`gated_mlp`)."""
    one = len(gate_up) == 1 and bool(gate_up[0].ggml_type) and gate_up[0].scaled_rows == 0
    return one and activation != "gelu_tanh"


def gated_mlp(
    gr: Graph, x: str, gate_up: Sequence[Linear], ffn_dim: int, activation: str, level: int,
    pad: RowPad | None = None,
) -> str:  # fmt: skip
    """`act(gate) * up` of the MLP's fused gate|up matmul (`x` -> [rows, ffn_dim]).

    One QMatMul of one block type holding both halves computes SwiGLU itself (four ops fewer
    per layer: the dispatch is a measurable share of a small model's decode step); anything
    else runs the matmul, a Split and the activation's ops.
    """
    if glu_fuses(gate_up, activation):
        xin = x if pad is None else pad.unpad(gr, x)
        return qmatmul(gr, xin, gate_up[0], glu=True)
    if any(lin.paired for lin in gate_up):
        raise ValueError("gate/up rows paired for the fused SwiGLU but the MLP does not fuse it")
    gu = linear(gr, x, gate_up, level, pad, keep_pad=True)
    gate, up = gr.op("Split", [gu, gr.ints([ffn_dim, ffn_dim])], n_out=2, axis=-1)
    if activation == "gelu_tanh":
        act = gr.op("Mul", [gr.op("Gelu", [gate], approximate="tanh"), up])
    else:
        act = gr.op("Mul", [gr.op("Mul", [gate, gr.op("Sigmoid", [gate])]), up])
    if pad is not None and gu in pad.carrying:
        pad.carrying.add(act)  # row-wise ops: the pad rows ride along
    return act


def linear(
    gr: Graph,
    x: str,
    lins: Sequence[Linear],
    level: int,
    pad: RowPad | None = None,
    keep_pad: bool = False,
) -> str:
    """`x @ Wᵀ (+ bias)` for 2-D `x` over fused groups: QMatMul, MatMulNBits or a dense MatMul.

    Blocks with offsets (`w = scale·(q − mid) + min`) add `(Σ x per block) @ offsetsᵀ`: Reshape +
    ReduceSum (O(K); a MatMul with a 0/1 block matrix would read K²/32 floats, 10 MB per call
    for K = 8960) and a Gemm that takes the matmul's output as its C input. The offsets are
    stored `[N, K/32]` and read transposed (`transB`): ONNX Runtime's Gemm runs that layout
    2–3× faster than `[K/32, N]` on one or two rows of a wide N (gate/up) when it sits in cache;
    in a whole 1.5B step, where it streams from memory, the two measured within noise at two
    rows and ~25% apart at one (draft models decode one row). With `pad`, groups
    whose one-row kernel differs run on the padded rows (`RowPad`); with `keep_pad`, a result
    whose groups all ran padded keeps its pad rows (the caller continues on them).
    """
    outs = []
    blocksums: dict[tuple[str, int], str] = {}
    padded_all = pad is not None and all(_kernel_rows_matter(lin) for lin in lins)
    for lin in lins:
        xin = x if pad is None else pad.input_for(gr, x, lin)
        if lin.ggml_type:
            y = qmatmul(gr, xin, lin)
        elif lin.bits == 0:
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
