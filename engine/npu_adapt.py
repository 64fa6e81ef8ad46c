"""Builder graphs rewritten into the forms the QNN HTP accepts, before they are compiled.

Apart from `npu_compile` because it needs the `onnx` package, which a start whose compiled
graphs are cached never imports (`graph_key` says why): this module is imported only when a
graph is compiled or explained.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["adapt_file_for_htp", "adapt_for_htp"]


def adapt_file_for_htp(src: Path) -> None:
    """`adapt_for_htp` on the graph file `src` (its weights stay where they are)."""
    onnx.save_model(adapt_for_htp(onnx.load(str(src), load_external_data=False)), str(src))


def adapt_for_htp(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rewrite a builder graph into the forms the QNN HTP accepts (in place; returns it).

    The builder keeps the residual stream 2-D `[S, D]` (the CPU's Gemm and norm fusions want
    it), but QNN's `MatMulNBits` takes only a 3-D `A` ("Unsupported input A rank, expecting 3D
    shape", measured). Each one is wrapped in Reshape `[1, S, K]` → MatMulNBits → Reshape
    `[S, N]`; reshapes are free layout changes on the HTP. Its bias input is rejected too
    ("Unsupported inputs g_idx or bias"), so a bias becomes an `Add` after it.
    """
    graph = model.graph
    consts: dict[str, onnx.TensorProto] = {}

    def shape_const(values: list[int]) -> str:
        name = "htp_shape_" + "_".join(str(v).replace("-", "m") for v in values)
        if name not in consts:
            consts[name] = numpy_helper.from_array(np.array(values, np.int64), name)
        return name

    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type != "MatMulNBits":
            nodes.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        a3, y3, out = f"{node.name}_a3", f"{node.name}_y3", node.output[0]
        nodes.append(
            helper.make_node(
                "Reshape",
                [node.input[0], shape_const([1, -1, attrs["K"]])],
                [a3],
                f"{node.name}_3d",
            )
        )
        node.input[0] = a3
        node.output[0] = y3
        nodes.append(node)
        bias = node.input[5] if len(node.input) > 5 else ""
        if bias:  # QNN: "Unsupported inputs g_idx or bias" -> a separate Add
            inputs = list(node.input[:5])
            while inputs and not inputs[-1]:
                inputs.pop()
            del node.input[:]
            node.input.extend(inputs)
            y3 = _append(nodes, "Add", [y3, bias], f"{node.name}_bias")
        nodes.append(
            helper.make_node(
                "Reshape", [y3, shape_const([-1, attrs["N"]])], [out], f"{node.name}_2d"
            )
        )
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(consts.values())
    return model


def _append(nodes: list[onnx.NodeProto], op: str, inputs: list[str], name: str) -> str:
    nodes.append(helper.make_node(op, inputs, [f"{name}_0"], name))
    return f"{name}_0"
