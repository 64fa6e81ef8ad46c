"""Minimal reproduction: loading a QNN context binary shared by two graphs crashes the simulator.

Two tiny graphs (`y = x @ W`, one with 1 row and one with 4, the same 64x64 float initializer
W) are compiled in one process with QNN EP weight sharing, as its documentation describes
(`ep.share_ep_contexts=1` on both compile sessions, `ep.stop_share_ep_contexts=1` on the last,
provider option `enable_htp_weight_sharing=1`, embed mode 0). That writes one `.bin` holding
both graphs and two `_ctx.onnx` files pointing at it. Each graph is then loaded and run in a
child process (the load may kill the process), once with `ep.share_ep_contexts=1` and once
without; and, as the control, a shared binary holding one graph alone.

Nothing here comes from npuchat: only onnx, numpy, onnxruntime and onnxruntime-qnn. Measured
with onnxruntime 1.32.0, onnxruntime-qnn 2.7.0 (QAIRT 2.51.0, the newest wheel on PyPI on
2026-12-01), the x86_64 Linux HTP simulator, `htp_arch=73`, `soc_model=60`:

    one-graph binary (control)       loads and runs
    two-graph binary, either graph   killed by signal 11 (SIGSEGV), with or without sharing
                                     at load: inside libQnnHtp.so while creating the context
                                     from the binary (after "Graph count from QNN context: 2")

    python benchmarks/npu_shared_repro.py
"""

from __future__ import annotations

import functools
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort  # type: ignore[import-untyped]
import onnxruntime_qnn  # type: ignore[import-untyped]
from onnx import TensorProto, helper, numpy_helper

EP = "QNNExecutionProvider"
OPTIONS = {
    "backend_type": "htp",
    "enable_htp_fp16_precision": "1",
    "soc_model": "60",
    "htp_arch": "73",
    "enable_htp_weight_sharing": "1",
}
DIM = 64


@functools.cache
def _device() -> object:
    ort.register_execution_provider_library(EP, onnxruntime_qnn.get_library_path())
    return next(d for d in ort.get_ep_devices() if d.ep_name == EP)


def _graph(path: Path, rows: int) -> None:
    """`y[rows, 64] = x @ W` with one fixed W (the weights both graphs share)."""
    w = np.random.default_rng(0).standard_normal((DIM, DIM)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        f"g{rows}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, DIM])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, DIM])],
        [numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save_model(model, str(path))


def _options(entries: dict[str, str]) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    entries = {"session.disable_cpu_ep_fallback": "1", **entries}
    for key, value in entries.items():
        so.add_session_config_entry(key, value)
    so.add_provider_for_devices([_device()], OPTIONS)
    return so


def compile_shared(folder: Path, rows: list[int]) -> list[Path]:
    """Compile one graph per row count into one shared context binary; the ctx models."""
    out = []
    for i, r in enumerate(rows):
        src, ctx = folder / f"g{r}.onnx", folder / f"g{r}_ctx.onnx"
        _graph(src, r)
        entries = {
            "ep.context_enable": "1",
            "ep.context_embed_mode": "0",
            "ep.context_file_path": str(ctx),
            "ep.share_ep_contexts": "1",
        }
        if i == len(rows) - 1:
            entries["ep.stop_share_ep_contexts"] = "1"
        ort.InferenceSession(str(src), _options(entries))
        out.append(ctx)
    return out


def load_and_run(ctx: Path, share: bool) -> None:
    """Child process: open one compiled graph and run it on ones."""
    session = ort.InferenceSession(
        str(ctx), _options({"ep.share_ep_contexts": "1" if share else "0"})
    )
    shape = session.get_inputs()[0].shape
    session.run(None, {"x": np.ones(shape, np.float32)})


def _verdict(ctx: Path, share: bool) -> str:
    args = [sys.executable, __file__, "--child", str(ctx), "1" if share else "0"]
    res = subprocess.run(args, capture_output=True, text=True, timeout=300)
    if res.returncode == 0:
        return "loads and runs"
    if res.returncode < 0:
        return f"killed by signal {-res.returncode}"
    return f"exit code {res.returncode}: {res.stderr.strip().splitlines()[-1:]}"


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        load_and_run(Path(sys.argv[2]), sys.argv[3] == "1")
        return 0
    from onnxruntime_qnn import build_and_package_info as info  # type: ignore[import-untyped]

    print(f"onnxruntime {ort.__version__}, onnxruntime-qnn {info.__version__}, ", end="")
    print(f"QAIRT {info.qnn_version}")
    with tempfile.TemporaryDirectory(prefix="qnn-shared-") as tmp:
        results = {}
        for rows in ([1], [1, 4]):
            folder = Path(tmp) / f"{len(rows)}-graphs"
            folder.mkdir()
            ctxs = compile_shared(folder, rows)
            bins = sorted(p.name for p in folder.glob("*.bin"))
            print(f"{len(rows)} graph(s) compiled into context binaries {bins}", flush=True)
            for ctx in ctxs:
                for share in (True, False):
                    how = "with" if share else "without"
                    results[f"{len(rows)}-graph binary, {ctx.name}, {how} sharing"] = _verdict(
                        ctx, share
                    )
        for what, verdict in results.items():
            print(f"{what}: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
